//! Generation with the device sampler (the fake backend runs the shared algorithm on the CPU,
//! fed only what a device gets: the prefill's tokens and each step's token and position)
//! against the CPU engine with the host sampler, on the llama-tiny fixture: the same seed gives
//! the same tokens for every sampler option, also when the device refuses mid-run and the CPU
//! takes over, and when the spec is past the device's limits (the host samples then).

mod common;
use cmf_gpu::facade::fake::FakeBackend;
use cmf_gpu::facade::{Gpu, GpuMode};
use cmf_llm::chat::Tokenizer;
use cmf_llm::engine::{CpuEngine, Engine};
use cmf_llm::generate::{generate, GenerationConfig};
use cmf_llm::gpu::{GpuEngine, GpuModel};
use cmf_llm::sampling::SamplingParams;
use cmf_llm::Model;
use common::*;
use std::sync::Arc;

fn fake_gpu() -> Gpu {
    Gpu::with_backend(GpuMode::Auto, Arc::new(FakeBackend::new(1 << 40)))
}

/// Generated ids, and whether the engine was still on the device at the end.
fn run(
    engine: &mut dyn Engine,
    tok: &Tokenizer,
    prompt: &[u32],
    params: &SamplingParams,
) -> Vec<u32> {
    let cfg = GenerationConfig {
        max_tokens: 24,
        sampling: *params,
        ..Default::default()
    };
    let mut history = Vec::new();
    generate(engine, tok, prompt, &mut history, &cfg, &mut |_| {}).unwrap();
    history[prompt.len()..].to_vec()
}

#[test]
fn device_sampler_equals_host_sampler_on_seeded_runs() {
    with_fixture("llama-tiny", seeded_runs_agree);
}

fn seeded_runs_agree(model: &Model, tok: &Tokenizer, prompt: &[u32]) {
    let base = SamplingParams::default();
    let cases = [
        base,
        SamplingParams {
            temperature: 0.8,
            top_p: 0.9,
            seed: 1,
            ..base
        },
        SamplingParams {
            temperature: 1.3,
            top_k: 20,
            min_p: 0.02,
            seed: 2,
            ..base
        },
        SamplingParams {
            temperature: 1.0,
            repeat_penalty: 1.3,
            presence_penalty: 0.4,
            frequency_penalty: 0.2,
            penalty_last_n: 16,
            seed: 3,
            ..base
        },
        // Greedy with penalties: the device graph with the penalty kernel and an arg-max.
        SamplingParams {
            repeat_penalty: 2.0,
            ..base
        },
        // Past the device's limits: the host samples from read-back logits.
        SamplingParams {
            temperature: 1.0,
            top_k: 100,
            seed: 4,
            ..base
        },
    ];
    let gpu = fake_gpu();
    let mut spread = std::collections::HashSet::new();
    for params in &cases {
        let mut cpu = CpuEngine::new(model, 256, cmf_kernels::KvDtype::F32).unwrap();
        let want = run(&mut cpu, tok, prompt, params);
        for inject in [u64::MAX, 6] {
            let g = GpuModel::load(&gpu, model, 256, None).expect("the fake loads it");
            let mut dev = GpuEngine::new(model, g, 256, cmf_kernels::KvDtype::F32);
            gpu.inject_refusal_after(inject);
            let got = run(&mut dev, tok, prompt, params);
            gpu.inject_refusal_after(u64::MAX);
            assert_eq!(dev.is_gpu(), inject == u64::MAX, "{params:?}");
            assert_eq!(got, want, "{params:?}, refusal after {inject} calls");
        }
        spread.insert(want);
    }
    assert_eq!(
        spread.len(),
        cases.len(),
        "the cases should generate different ids"
    );
}

/// A grammar that counts how its mask was taken: on logits (`process`, the host path) or as a
/// bitset (`mask_bits`, applied by the device).
struct Counted {
    inner: cmf_llm::constraint::Constrained,
    on_logits: usize,
    as_bits: usize,
}

impl cmf_llm::logits::LogitProcessor for Counted {
    fn process(&mut self, logits: &mut [f32]) -> cmf_llm::Result<()> {
        self.on_logits += 1;
        self.inner.process(logits)
    }
    fn accept(&mut self, token: u32) -> cmf_llm::Result<()> {
        self.inner.accept(token)
    }
    fn allowed(&self, token: u32) -> bool {
        self.inner.allowed(token)
    }
    fn finished(&self) -> bool {
        self.inner.finished()
    }
    fn masks_only(&self) -> bool {
        self.inner.masks_only()
    }
    fn mask_bits(&mut self, words: &mut [u32]) -> cmf_llm::Result<()> {
        self.as_bits += 1;
        self.inner.mask_bits(words)
    }
}

/// A JSON-schema-constrained generation with the mask applied on the (fake) device — the host
/// computes the mask as a bitset while the step runs, the device masks and samples, one id comes
/// back — gives the CPU engine's host-masked tokens for greedy, seeded and penalised sampling;
/// also when the device refuses mid-run (the CPU takes over, masking on the host). A logit bias
/// beside the grammar keeps the logits on the host.
#[test]
fn device_mask_equals_host_mask_on_constrained_runs() {
    with_fixture("llama-tiny", constrained_runs_agree);
}

fn constrained_runs_agree(model: &Model, tok: &Tokenizer, prompt: &[u32]) {
    use cmf_llm::constraint::{Grammar, Grammars};
    use cmf_llm::guided::{generate_guided, Hooks, Step};
    use cmf_llm::logits::{LogitBias, LogitProcessor};
    // The grammar compiler takes the tokenizer's JSON itself.
    let tok_json = std::fs::read(fixture_dir("llama-tiny").join("tokenizer.json")).unwrap();
    let grammars = Grammars::new(&tok_json, &[2], model.config.vocab_size).unwrap();
    let schema = serde_json::json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
        "required": ["name", "n"], "additionalProperties": false});
    let grammar = Grammar::JsonSchema(schema);
    // (ids, text, mask computations on logits, as bitsets)
    let run = |engine: &mut dyn Engine, params: &SamplingParams, bias: bool| {
        let cfg = GenerationConfig {
            max_tokens: 40,
            sampling: *params,
            eos_ids: vec![2],
            ..Default::default()
        };
        let mut c = Counted {
            inner: grammars.constrain(&grammar).unwrap(),
            on_logits: 0,
            as_bits: 0,
        };
        let mut b = LogitBias(vec![(7, 1.5)]);
        let mut processors: Vec<&mut dyn LogitProcessor> = vec![&mut c];
        if bias {
            processors.push(&mut b);
        }
        let mut hooks = Hooks {
            processors,
            ..Hooks::default()
        };
        let (mut ids, mut text) = (Vec::new(), String::new());
        generate_guided(
            engine,
            tok,
            prompt,
            &mut Vec::new(),
            &cfg,
            &mut hooks,
            &mut |s| match s {
                Step::Token(t, _) => ids.push(t),
                Step::Text(t) => text.push_str(t),
                Step::Prompt(_) => {}
            },
            &|| false,
        )
        .unwrap();
        drop(hooks);
        (ids, text, c.on_logits, c.as_bits)
    };
    let base = SamplingParams::default();
    let cases = [
        base,
        SamplingParams {
            temperature: 0.9,
            top_p: 0.95,
            seed: 3,
            ..base
        },
        SamplingParams {
            temperature: 1.2,
            top_k: 30,
            repeat_penalty: 1.3,
            presence_penalty: 0.3,
            penalty_last_n: 16,
            seed: 4,
            ..base
        },
    ];
    let gpu = fake_gpu();
    for params in &cases {
        for bias in [false, true] {
            let mut cpu = CpuEngine::new(model, 256, cmf_kernels::KvDtype::F32).unwrap();
            let want = run(&mut cpu, params, bias);
            assert!(want.0.len() > 3, "{params:?}: {want:?}");
            assert_eq!(want.3, 0, "the CPU masks on the host");
            for inject in [u64::MAX, 6] {
                let g = GpuModel::load(&gpu, model, 256, None).expect("the fake loads it");
                let mut dev = GpuEngine::new(model, g, 256, cmf_kernels::KvDtype::F32);
                gpu.inject_refusal_after(inject);
                let got = run(&mut dev, params, bias);
                gpu.inject_refusal_after(u64::MAX);
                let what = format!("{params:?}, bias {bias}, refusal after {inject} calls");
                assert_eq!((&got.0, &got.1), (&want.0, &want.1), "{what}");
                if bias {
                    assert_eq!(got.3, 0, "{what}: a bias keeps the mask on the host");
                } else if inject == u64::MAX {
                    // The first token comes from the prefill's logits; every later one from a
                    // masked device step.
                    assert_eq!(got.2, 1, "{what}");
                    assert_eq!(
                        got.3,
                        got.0.len() - 1 + usize::from(got.0.len() < 40),
                        "{what}"
                    );
                } else {
                    assert!(got.3 > 0 && got.2 > 1, "{what}: {got:?}");
                }
            }
        }
    }
}
