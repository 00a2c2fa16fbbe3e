//! What grammar-constrained decoding costs: decode throughput of the guided loop with a JSON
//! schema against the same loop without one (end-of-sequence banned, so both generate the same
//! number of tokens), on the model named by `CMF_BENCH_MODEL`. Ignored by default (it needs a
//! real model); run with
//! `CMF_BENCH_MODEL=model.cmf cargo test --release -p cmf-llm --test constraint_overhead -- --ignored --nocapture`.
//! With `CMF_BENCH_GPU=1` the single-stream measurement runs on the CUDA device instead, where
//! the grammar's mask is applied on the device: there no bias bans the end of sequence (a bias
//! would bring the logits to the host), so the free answer may be shorter; rates are per token.

use cmf_format::CmfModel;
use cmf_llm::chat::TextAssets;
use cmf_llm::constraint::{Grammar, Grammars};
use cmf_llm::engine::{CpuEngine, Engine};
use cmf_llm::generate::GenerationConfig;
use cmf_llm::gpu::{GpuEngine, GpuModel};
use cmf_llm::guided::{generate_guided, Hooks};
use cmf_llm::logits::{LogitBias, LogitProcessor};
use cmf_llm::Model;
use std::time::Instant;

#[test]
#[ignore]
fn constrained_decode_throughput() {
    let Ok(path) = std::env::var("CMF_BENCH_MODEL") else {
        println!("SKIPPED: set CMF_BENCH_MODEL to a .cmf LLM");
        return;
    };
    let file = CmfModel::open(&path).unwrap();
    let model = Model::load(&file).unwrap();
    let assets = TextAssets::from_cmf(&file).unwrap();
    let t = Instant::now();
    let grammars = Grammars::new(
        file.vocab().unwrap(),
        &assets.eos_ids,
        model.config.vocab_size,
    )
    .unwrap();
    println!(
        "token trie built in {:.0} ms",
        t.elapsed().as_secs_f64() * 1e3
    );
    let schema = serde_json::json!({"type": "object", "properties": {"items": {"type": "array",
        "items": {"type": "string", "maxLength": 24}, "minItems": 100, "maxItems": 100}},
        "required": ["items"], "additionalProperties": false});
    let msgs = [cmf_llm::chat::Message::new(
        "user",
        "List one hundred fruits as JSON.",
    )];
    let text = assets.template.render(&msgs, true).unwrap();
    let ids = assets.tokenizer.encode(&text, false).unwrap();
    let n = 256;
    let cfg = GenerationConfig {
        max_tokens: n,
        eos_ids: assets.eos_ids.clone(),
        ..Default::default()
    };
    let ban_eos = LogitBias(assets.eos_ids.iter().map(|&e| (e, -1000.0)).collect());
    let mut rates = [Vec::new(), Vec::new()];
    let mut outsides = [Vec::new(), Vec::new()];
    let gpu = std::env::var("CMF_BENCH_GPU")
        .is_ok_and(|v| v == "1")
        .then(|| {
            cmf_gpu::Gpu::open(cmf_gpu::GpuMode::Cuda).expect("CMF_BENCH_GPU=1 needs a CUDA device")
        });
    for round in 0..10 {
        let constrained = round % 2 == 1;
        let mut engine: Box<dyn Engine> = match &gpu {
            Some(g) => {
                let m = GpuModel::try_load(g, &model, 1024, None).expect("the model on the device");
                Box::new(GpuEngine::new(&model, m, 1024, cmf_kernels::KvDtype::F16))
            }
            None => Box::new(CpuEngine::new(&model, 1024, cmf_kernels::KvDtype::F16).unwrap()),
        };
        let mut bias = ban_eos.clone();
        let mut c = grammars
            .constrain(&Grammar::JsonSchema(schema.clone()))
            .unwrap();
        let mut processors: Vec<&mut dyn LogitProcessor> = Vec::new();
        if gpu.is_none() {
            processors.push(&mut bias);
        }
        if constrained {
            processors.push(&mut c);
        }
        let mut hooks = Hooks {
            processors,
            ..Hooks::default()
        };
        let mut first = None;
        let t0 = Instant::now();
        let mut count = 0;
        let stats = generate_guided(
            engine.as_mut(),
            &assets.tokenizer,
            &ids,
            &mut Vec::new(),
            &cfg,
            &mut hooks,
            &mut |s| {
                if let cmf_llm::guided::Step::Token(..) = s {
                    count += 1;
                    if count == 1 {
                        first = Some(Instant::now());
                    }
                }
            },
            &|| false,
        )
        .unwrap();
        let _ = t0;
        let secs = first.unwrap().elapsed().as_secs_f64();
        let rate = (stats.generated_tokens - 1) as f64 / secs;
        // Time per token outside the engine's forward pass (sampling, masks, detokenizing):
        // robust to other load on the machine, which slows the forward pass most.
        let outside = (secs - stats.decode_time.as_secs_f64()) / stats.decode_steps as f64;
        println!(
            "{}: {} tokens, {rate:.1} tok/s after the first token (engine decode alone {:.1} tok/s; {:.3} ms a token outside it)",
            if constrained { "json schema" } else { "free      " },
            stats.generated_tokens,
            stats.decode_tok_per_s(),
            outside * 1e3
        );
        rates[constrained as usize].push(rate);
        outsides[constrained as usize].push(outside * 1e3);
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (free, cons) = (med(&mut rates[0]), med(&mut rates[1]));
    let (o_free, o_cons) = (med(&mut outsides[0]), med(&mut outsides[1]));
    println!(
        "median: free {free:.1} tok/s, constrained {cons:.1} tok/s ({:.1} % slower); outside the forward pass {o_free:.3} vs {o_cons:.3} ms a token: the mask costs {:.1} % of a {:.2} ms token",
        (1.0 - cons / free) * 100.0,
        (o_cons - o_free) / (1e3 / free) * 100.0,
        1e3 / free
    );
}

/// A processor that times another (the host's work on a constrained sequence's logits).
struct Timed<P> {
    inner: P,
    spent: std::rc::Rc<std::cell::Cell<f64>>,
}

impl<P: LogitProcessor> LogitProcessor for Timed<P> {
    fn process(&mut self, logits: &mut [f32]) -> cmf_llm::Result<()> {
        let t = Instant::now();
        let r = self.inner.process(logits);
        self.spent.set(self.spent.get() + t.elapsed().as_secs_f64());
        r
    }
    fn accept(&mut self, token: u32) -> cmf_llm::Result<()> {
        let t = Instant::now();
        let r = self.inner.accept(token);
        self.spent.set(self.spent.get() + t.elapsed().as_secs_f64());
        r
    }
    fn allowed(&self, token: u32) -> bool {
        self.inner.allowed(token)
    }
    fn finished(&self) -> bool {
        self.inner.finished()
    }
}

/// The same with 4 sequences at once on the batched engine (as `cmf serve --parallel 4`):
/// aggregate decode throughput of 4 requests with the schema against 4 without, alternating, and
/// the share of each step the grammars take on the host (mask and advance, timed directly: robust
/// to other load on the machine). Ignored by default; run as the test above with
/// `constrained_batch_throughput`.
#[test]
#[ignore]
fn constrained_batch_throughput() {
    use cmf_llm::batch::{BatchConfig, BatchEngine, Event, Request, Scheduler, SchedulerConfig};
    let Ok(path) = std::env::var("CMF_BENCH_MODEL") else {
        println!("SKIPPED: set CMF_BENCH_MODEL to a .cmf LLM");
        return;
    };
    let file = CmfModel::open(&path).unwrap();
    let model = Model::load(&file).unwrap();
    let assets = TextAssets::from_cmf(&file).unwrap();
    let grammars = Grammars::new(
        file.vocab().unwrap(),
        &assets.eos_ids,
        model.config.vocab_size,
    )
    .unwrap();
    let schema = serde_json::json!({"type": "object", "properties": {"items": {"type": "array",
        "items": {"type": "string", "maxLength": 24}, "minItems": 100, "maxItems": 100}},
        "required": ["items"], "additionalProperties": false});
    let questions = ["fruits", "cities", "colours", "animals"];
    let prompts: Vec<Vec<u32>> = questions
        .iter()
        .map(|q| {
            let msgs = [cmf_llm::chat::Message::new(
                "user",
                format!("List one hundred {q} as JSON."),
            )];
            let text = assets.template.render(&msgs, true).unwrap();
            assets.tokenizer.encode(&text, false).unwrap()
        })
        .collect();
    let n = 192;
    let (mut rates, mut shares) = ([Vec::new(), Vec::new()], Vec::new());
    for round in 0..10 {
        let constrained = round % 2 == 1;
        let cfg = BatchConfig::from_budget(&model, 64 << 20, cmf_kernels::KvDtype::F16, 1024);
        let engine = BatchEngine::new(&model, cfg).unwrap();
        let mut s = Scheduler::new(
            engine,
            SchedulerConfig {
                max_running: 4,
                ..Default::default()
            },
        )
        .unwrap();
        let spent = std::rc::Rc::new(std::cell::Cell::new(0.0));
        for p in &prompts {
            let ban_eos = LogitBias(assets.eos_ids.iter().map(|&e| (e, -1000.0)).collect());
            let mut procs: Vec<Box<dyn LogitProcessor>> = vec![Box::new(ban_eos)];
            if constrained {
                let c = grammars
                    .constrain(&Grammar::JsonSchema(schema.clone()))
                    .unwrap();
                procs.push(Box::new(Timed {
                    inner: c,
                    spent: spent.clone(),
                }));
            }
            let req = Request {
                prompt: p.clone(),
                max_tokens: n,
                ..Request::default()
            };
            s.submit_with(req, vec![procs]).unwrap();
        }
        // Prompts first, then time the decode steps alone.
        let (mut tokens, mut t0, mut decode_steps) = (0usize, None, 0);
        while !s.is_idle() {
            let events = s.step().unwrap();
            let got = events
                .iter()
                .filter(|e| matches!(e, Event::Token { .. }))
                .count();
            if t0.is_none() && got == prompts.len() {
                t0 = Some(Instant::now());
                spent.set(0.0);
                continue;
            }
            if t0.is_some() {
                tokens += got;
                decode_steps += 1;
            }
        }
        let secs = t0.unwrap().elapsed().as_secs_f64();
        let rate = tokens as f64 / secs;
        let share = spent.get() / secs;
        println!(
            "{}: {tokens} tokens in {decode_steps} steps, {rate:.1} tok/s; grammars on the host: {:.2} ms a step ({:.1} % of it)",
            if constrained { "json schema" } else { "free      " },
            spent.get() / decode_steps as f64 * 1e3,
            share * 100.0
        );
        rates[constrained as usize].push(rate);
        if constrained {
            shares.push(share);
        }
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (free, cons) = (med(&mut rates[0]), med(&mut rates[1]));
    println!(
        "median over 4 sequences: free {free:.1} tok/s, constrained {cons:.1} tok/s ({:.1} % slower); the grammars take {:.1} % of a constrained step",
        (1.0 - cons / free) * 100.0,
        med(&mut shares) * 100.0
    );
}
