//! The batched engine gives every sequence what it would have got alone: greedy (and seeded)
//! outputs token-identical to the single-sequence `Model::prefill` / `decode` loop with an f32
//! KV cache, with sequences of different lengths joining and leaving, prompts chunked and mixed
//! with decoding, preemption when the pool runs out, shared prefixes and cancellation. After
//! every step the pool's bookkeeping must agree with the sequences' block tables.

mod common;
use cmf_kernels::KvDtype;
use cmf_llm::batch::{
    BatchConfig, BatchEngine, Event, Request, RequestId, Scheduler, SchedulerConfig,
};
use cmf_llm::generate::FinishReason;
use cmf_llm::logits::{token_logprob, LogitBias, LogitProcessor, TokenLogprob};
use cmf_llm::sampling::{Sampler, SamplingParams};
use cmf_llm::{Model, ModelConfig};
use common::*;
use std::collections::HashMap;

struct Fixture {
    files: Vec<Vec<u8>>,
    config: ModelConfig,
}

fn fixture(name: &str) -> Fixture {
    let dir = fixture_dir(name);
    Fixture {
        files: read_weight_files(&dir),
        config: ModelConfig::from_json(&read_json(dir.join("config.json"))).unwrap(),
    }
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 7919 + seed * 104729 + 13) % 500 + 3)
        .collect()
}

/// The single-sequence loop: prefill, then sample and decode one token at a time.
fn alone(model: &Model, req: &Request) -> Vec<u32> {
    let mut st = model.new_state_with(1024, KvDtype::F32).unwrap();
    let mut sampler = Sampler::new(req.sampling);
    let mut history = req.prompt.clone();
    let mut logits = model.prefill(&mut st, &req.prompt).unwrap().to_vec();
    let mut out = Vec::new();
    loop {
        let t = sampler.sample(&mut logits, &history);
        if req.eos_ids.contains(&t) {
            break;
        }
        out.push(t);
        history.push(t);
        if out.len() == req.max_tokens {
            break;
        }
        logits = model.decode(&mut st, t).unwrap().to_vec();
    }
    out
}

/// A generated token and its log-probabilities (when asked).
type Sampled = (u32, Option<TokenLogprob>);

struct Run {
    /// Choice 0's tokens of each request.
    outputs: HashMap<RequestId, Vec<u32>>,
    finished: HashMap<RequestId, FinishReason>,
    /// Every choice's tokens and log-probabilities.
    choices: HashMap<(RequestId, usize), Vec<Sampled>>,
    choices_finished: HashMap<(RequestId, usize), FinishReason>,
    /// The prompt log-probabilities of the requests that asked.
    prompts: HashMap<RequestId, Vec<TokenLogprob>>,
    /// The requests in submission order (the order of the returned ids).
    submitted: Vec<Request>,
}

/// Steps `s` until idle, submitting `later[i]` before step `at[i]`; checks the pool after every
/// step. Returns each request's tokens, in submission order of ids.
fn drive(
    s: &mut Scheduler,
    first: &[Request],
    later: &[(usize, Request)],
    mut on_step: impl FnMut(usize, &mut Scheduler),
) -> (Vec<RequestId>, Run) {
    let mut ids: Vec<RequestId> = first.iter().map(|r| s.submit(r.clone()).unwrap()).collect();
    let mut run = Run {
        outputs: HashMap::new(),
        finished: HashMap::new(),
        choices: HashMap::new(),
        choices_finished: HashMap::new(),
        prompts: HashMap::new(),
        submitted: first.to_vec(),
    };
    for step in 0..10_000 {
        for (at, r) in later {
            if *at == step {
                ids.push(s.submit(r.clone()).unwrap());
                run.submitted.push(r.clone());
            }
        }
        on_step(step, s);
        if s.is_idle() && later.iter().all(|(at, _)| *at < step) {
            return (ids, run);
        }
        for e in s.step().unwrap() {
            match e {
                Event::Token {
                    id,
                    choice,
                    token,
                    logprob,
                } => {
                    if choice == 0 {
                        run.outputs.entry(id).or_default().push(token);
                    }
                    run.choices
                        .entry((id, choice))
                        .or_default()
                        .push((token, logprob));
                }
                Event::Finished { id, choice, reason } => {
                    assert!(
                        run.choices_finished.insert((id, choice), reason).is_none(),
                        "{id}/{choice} finished twice"
                    );
                    if choice == 0 {
                        run.finished.insert(id, reason);
                    }
                }
                Event::Prompt { id, logprobs } => {
                    assert!(
                        !run.choices.keys().any(|k| k.0 == id),
                        "{id}: the prompt's log-probabilities came after a token"
                    );
                    assert!(
                        run.prompts.insert(id, logprobs).is_none(),
                        "{id}: the prompt's log-probabilities came twice"
                    );
                }
                Event::Failed { id, error } => panic!("request {id} failed: {error}"),
            }
        }
        s.engine().check().unwrap();
    }
    panic!("the scheduler did not finish within 10000 steps");
}

fn greedy(prompt: Vec<u32>, max_tokens: usize) -> Request {
    Request {
        prompt,
        max_tokens,
        sampling: SamplingParams::default(),
        eos_ids: vec![],
        ..Request::default()
    }
}

/// A pool of `blocks` blocks of `block_size` positions, f32 KV, sequences up to 1024 tokens.
const fn f32_pool(blocks: usize, block_size: usize) -> BatchConfig {
    BatchConfig {
        block_size,
        kv_blocks: blocks,
        kv_dtype: KvDtype::F32,
        max_seq_len: 1024,
    }
}

fn scheduler<'m, 'a>(
    model: &'m Model<'a>,
    blocks: usize,
    block_size: usize,
    cfg: SchedulerConfig,
) -> Scheduler<'m, 'a> {
    let engine = BatchEngine::new(model, f32_pool(blocks, block_size)).unwrap();
    Scheduler::new(engine, cfg).unwrap()
}

fn assert_same(model: &Model, name: &str, reqs: &[Request], ids: &[RequestId], run: &Run) {
    for (r, id) in reqs.iter().zip(ids) {
        let want = alone(model, r);
        let got = run.outputs.get(id).cloned().unwrap_or_default();
        assert_eq!(
            got,
            want,
            "{name}: request {id} (prompt {})",
            r.prompt.len()
        );
        assert!(run.finished.contains_key(id), "{name}: {id} never finished");
    }
}

/// Different lengths, joining mid-run, prompts chunked (a budget of 24 tokens a step) and mixed
/// with decoding, on all four fixture families (sliding window, biases, q/k norms included).
#[test]
fn joining_and_leaving_equals_alone() {
    for name in FIXTURES {
        let f = fixture(name);
        let source = SafetensorsSource::new(&f.files);
        let model = Model::from_source(&source, f.config.clone(), "").unwrap();
        let cfg = SchedulerConfig {
            max_running: 4,
            step_tokens: 24,
        };
        let mut s = scheduler(&model, 64, 16, cfg);
        let first: Vec<Request> = [(1, 5, 12), (2, 37, 4), (3, 70, 9)]
            .map(|(seed, len, n)| greedy(prompt(seed, len), n))
            .into();
        let later: Vec<(usize, Request)> = [(3, 4, 50, 15), (5, 5, 1, 6), (9, 6, 33, 20)]
            .map(|(at, seed, len, n)| (at, greedy(prompt(seed, len), n)))
            .into();
        let (ids, run) = drive(&mut s, &first, &later, |_, _| {});
        assert_same(&model, name, &run.submitted, &ids, &run);
        assert_eq!(s.engine().pool_stats().held, 0, "{name}: blocks leaked");
    }
}

/// A pool of 14 blocks of 4 positions for four sequences that need up to 11 each on fixture
/// `name`: the youngest is preempted and recomputed (a hybrid's slot goes back and it recomputes
/// from its first token), and every output is still what it is alone. Seeded sampling included
/// (the draw depends on the position, which a recomputation keeps). `state_bytes` > 0: a hybrid
/// model with the recurrent-state cache on (hybrid_prefix.rs).
fn check_preemption(name: &str, state_bytes: usize) {
    let f = fixture(name);
    let source = SafetensorsSource::new(&f.files);
    let model = Model::from_source(&source, f.config.clone(), "").unwrap();
    let cfg = SchedulerConfig {
        max_running: 4,
        step_tokens: 64,
    };
    let mut s = if state_bytes > 0 {
        hybrid_prefix::scheduler_with_states(&model, 14, 4, cfg, state_bytes)
    } else {
        scheduler(&model, 14, 4, cfg)
    };
    let mut reqs: Vec<Request> = (0..4)
        .map(|i| greedy(prompt(10 + i, 9 + 3 * i as usize), 30))
        .collect();
    reqs[3].sampling = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        seed: 7,
        ..SamplingParams::default()
    };
    let (ids, run) = drive(&mut s, &reqs, &[], |_, _| {});
    assert!(
        s.stats().preemptions > 0,
        "{name}: the pool was never short"
    );
    assert_same(&model, name, &reqs, &ids, &run);
    assert_eq!(s.engine().slots_in_use(), 0, "{name}: slots leaked");
    assert_eq!(s.engine().pool_stats().held, 0);
}

#[test]
fn preemption_keeps_outputs() {
    check_preemption("qwen3-tiny", 0);
}

/// Requests sharing a 40-token prefix (`s` on llama-tiny): the later ones take its full blocks
/// from the cache (never writing them) and still produce their own outputs.
fn check_shared_prefix(model: &Model, s: &mut Scheduler) {
    let system = prompt(99, 40);
    let with_tail = |seed: u32, n: usize| {
        let mut p = system.clone();
        p.extend(prompt(seed, n));
        p
    };
    let first = vec![greedy(with_tail(1, 5), 8)];
    // Submitted once the first request's prompt is computed.
    let later: Vec<(usize, Request)> = vec![
        (2, greedy(with_tail(2, 9), 8)),
        (2, greedy(with_tail(3, 1), 8)),
        (4, greedy(system.clone(), 8)),
    ];
    let (ids, run) = drive(s, &first, &later, |_, _| {});
    assert_same(model, "llama-tiny", &run.submitted, &ids, &run);
    // Two full blocks (32 tokens) of the prefix for each of the three later requests.
    assert_eq!(s.stats().prefix_tokens_reused, 3 * 32);
    let st = s.stats();
    assert_eq!(st.prefix_hits, 6, "{st:?}");
    // Blocks looked up: 2 for the first request (a miss), 3, 2 and 2 for the later ones.
    assert_eq!(st.prefix_queries, 9, "{st:?}");
    assert_eq!(s.engine().pool_stats().held, 0);
}

#[test]
fn shared_prefix_is_reused() {
    let f = fixture("llama-tiny");
    let source = SafetensorsSource::new(&f.files);
    let model = Model::from_source(&source, f.config.clone(), "").unwrap();
    let mut s = scheduler(&model, 64, 16, SchedulerConfig::default());
    check_shared_prefix(&model, &mut s);
}

/// Cancelling a request in the middle of its prompt frees its blocks at once; the others go on
/// unchanged.
#[test]
fn cancellation_frees_blocks_mid_prefill() {
    let f = fixture("mistral-tiny");
    let source = SafetensorsSource::new(&f.files);
    let model = Model::from_source(&source, f.config.clone(), "").unwrap();
    let cfg = SchedulerConfig {
        max_running: 4,
        step_tokens: 16,
    };
    let mut s = scheduler(&model, 64, 8, cfg);
    let reqs = vec![
        greedy(prompt(1, 12), 10),
        greedy(prompt(2, 200), 10),
        greedy(prompt(3, 7), 10),
    ];
    let mut victim = None;
    let (ids, run) = drive(&mut s, &reqs, &[], |step, s| {
        if step == 4 {
            let id = 1; // the long prompt: still prefilling 16 tokens a step
            let before = s.engine().pool_stats().held;
            assert!(s.engine().computed(id) < 200);
            assert!(s.cancel(id));
            let after = s.engine().pool_stats().held;
            assert!(after < before, "cancel freed nothing ({before} → {after})");
            victim = Some(id);
        }
    });
    let victim = victim.unwrap();
    assert!(!run.outputs.contains_key(&victim));
    let kept: Vec<(Request, RequestId)> = reqs
        .into_iter()
        .zip(ids)
        .filter(|(_, id)| *id != victim)
        .collect();
    let (r, i): (Vec<_>, Vec<_>) = kept.into_iter().unzip();
    assert_same(&model, "mistral-tiny", &r, &i, &run);
    assert_eq!(s.engine().pool_stats().held, 0);
    assert!(!s.cancel(victim), "a second cancel finds nothing");
}

/// Bad requests are refused by name, before anything is queued.
#[test]
fn bad_requests_are_refused() {
    let f = fixture("qwen2-tiny");
    let source = SafetensorsSource::new(&f.files);
    let model = Model::from_source(&source, f.config.clone(), "").unwrap();
    let mut s = scheduler(&model, 4, 4, SchedulerConfig::default());
    let e = s.submit(greedy(vec![3, 100_000], 4)).unwrap_err();
    assert!(e.to_string().contains("100000"), "{e}");
    let e = s.submit(greedy(prompt(1, 16), 4)).unwrap_err();
    assert!(e.to_string().contains("context full"), "{e}");
    assert!(s.submit(greedy(prompt(1, 3), 0)).is_err());
    assert!(s.is_idle());
}

/// The SmolLM2 demo model (imported from its GGUF with the default codecs) when
/// `scripts/fetch-demo-model.sh` has fetched it: four requests of different lengths batched
/// equal each alone, greedy, f32 KV.
#[test]
fn demo_model_batched_equals_alone() {
    let Some(gguf) = demo_gguf() else {
        println!(
            "SKIPPED: SmolLM2-135M-Instruct.Q4_1.gguf not found (scripts/fetch-demo-model.sh)"
        );
        return;
    };
    let out = scratch_dir("batched").join("smollm2.cmf");
    cmf_convert::import_gguf::import(&gguf, &out, &cmf_convert::Options::default()).unwrap();
    let file = cmf_format::CmfModel::open(&out).unwrap();
    let model = Model::load(&file).unwrap();
    let cfg = SchedulerConfig {
        max_running: 4,
        step_tokens: 64,
    };
    let mut s = scheduler(&model, 64, 16, cfg);
    let reqs: Vec<Request> = [(1, 9), (2, 70), (3, 23), (4, 41)]
        .map(|(seed, len)| greedy(prompt(seed, len), 16))
        .into();
    let later = [(2, greedy(prompt(5, 30), 12))];
    let (ids, run) = drive(&mut s, &reqs, &later, |_, _| {});
    assert_same(&model, "smollm2", &run.submitted, &ids, &run);
}

/// The Qwen3-Next hybrids (GatedDeltaNet + gated attention; dense and MoE feed-forward).
const HYBRID_FIXTURES: [&str; 2] = ["qwen3next-tiny", "qwen3next-dense-tiny"];

/// Hybrid models batched: every sequence advances its own recurrent-state slot, prompts chunked
/// over steps (24 tokens a step) beside decoding sequences, others joining mid-run; outputs equal
/// each alone and every slot is back when all are done.
#[test]
fn hybrid_joining_and_leaving_equals_alone() {
    for name in HYBRID_FIXTURES {
        let f = fixture(name);
        let source = SafetensorsSource::new(&f.files);
        let model = Model::from_source(&source, f.config.clone(), "").unwrap();
        let cfg = SchedulerConfig {
            max_running: 4,
            step_tokens: 24,
        };
        let mut s = scheduler(&model, 64, 16, cfg);
        let first: Vec<Request> = [(1, 5, 12), (2, 37, 4), (3, 90, 9)]
            .map(|(seed, len, n)| greedy(prompt(seed, len), n))
            .into();
        let later: Vec<(usize, Request)> = [(3, 4, 50, 15), (5, 5, 1, 6), (9, 6, 33, 20)]
            .map(|(at, seed, len, n)| (at, greedy(prompt(seed, len), n)))
            .into();
        let mut most_slots = 0;
        let (ids, run) = drive(&mut s, &first, &later, |_, s| {
            most_slots = most_slots.max(s.engine().slots_in_use());
        });
        assert_same(&model, name, &run.submitted, &ids, &run);
        assert!(most_slots > 1, "{name}: never more than one slot in use");
        assert_eq!(s.engine().slots_in_use(), 0, "{name}: slots leaked");
        assert_eq!(s.engine().pool_stats().held, 0, "{name}: blocks leaked");
    }
}

#[test]
fn hybrid_preemption_recomputes_the_recurrent_state() {
    for name in HYBRID_FIXTURES {
        check_preemption(name, 0);
    }
}

/// Cancelling a hybrid request mid-prompt gives its blocks and its slot back at once.
#[test]
fn hybrid_cancellation_frees_the_slot() {
    let f = fixture("qwen3next-tiny");
    let source = SafetensorsSource::new(&f.files);
    let model = Model::from_source(&source, f.config.clone(), "").unwrap();
    let cfg = SchedulerConfig {
        max_running: 4,
        step_tokens: 16,
    };
    let mut s = scheduler(&model, 64, 8, cfg);
    let reqs = vec![
        greedy(prompt(1, 12), 10),
        greedy(prompt(2, 200), 10),
        greedy(prompt(3, 7), 10),
    ];
    let victim = 1; // the long prompt: still prefilling 16 tokens a step at step 4
    let (ids, run) = drive(&mut s, &reqs, &[], |step, s| {
        if step == 4 {
            assert!(s.engine().computed(victim) < 200);
            let (blocks, slots) = (s.engine().pool_stats().held, s.engine().slots_in_use());
            assert!(s.cancel(victim));
            assert!(
                s.engine().pool_stats().held < blocks,
                "cancel freed no block"
            );
            assert_eq!(s.engine().slots_in_use(), slots - 1, "cancel freed no slot");
        }
    });
    assert!(!run.outputs.contains_key(&victim));
    let (r, i): (Vec<_>, Vec<_>) = reqs
        .into_iter()
        .zip(ids)
        .filter(|(_, id)| *id != victim)
        .unzip();
    assert_same(&model, "qwen3next-tiny", &r, &i, &run);
    assert_eq!(s.engine().slots_in_use(), 0);
}

/// A hybrid model takes no prefix hits (a cached block carries no recurrent state): requests
/// sharing a 40-token prefix each compute it, and each output equals the request alone.
#[test]
fn hybrid_shared_prefix_is_recomputed() {
    let f = fixture("qwen3next-dense-tiny");
    let source = SafetensorsSource::new(&f.files);
    let model = Model::from_source(&source, f.config.clone(), "").unwrap();
    let mut s = scheduler(&model, 64, 16, SchedulerConfig::default());
    assert!(!s.engine().reuses_prefixes());
    let system = prompt(99, 40);
    let with_tail = |seed: u32, n: usize| {
        let mut p = system.clone();
        p.extend(prompt(seed, n));
        p
    };
    let first = vec![greedy(with_tail(1, 5), 8)];
    let later: Vec<(usize, Request)> = vec![
        (2, greedy(with_tail(2, 9), 8)),
        (4, greedy(system.clone(), 8)),
    ];
    let (ids, run) = drive(&mut s, &first, &later, |_, _| {});
    assert_same(&model, "qwen3next-dense-tiny", &run.submitted, &ids, &run);
    let st = s.stats();
    assert_eq!(
        (st.prefix_tokens_reused, st.prefix_queries),
        (0, 0),
        "{st:?}"
    );
}

/// The single-sequence loop with `cmf_llm::guided`'s treatment of every step: processors, the
/// sampler (choice `choice`'s seed), a masked draw replaced by the best allowed token, and the
/// log-probabilities of the unprocessed logits.
fn alone_processed(
    model: &Model,
    req: &Request,
    choice: usize,
    mut processors: Vec<Box<dyn LogitProcessor>>,
) -> Vec<Sampled> {
    let mut st = model.new_state_with(1024, KvDtype::F32).unwrap();
    let mut sampling = req.sampling;
    sampling.seed = sampling.seed.wrapping_add(choice as u64);
    let mut sampler = Sampler::new(sampling);
    let mut history = req.prompt.clone();
    let mut raw = model.prefill(&mut st, &req.prompt).unwrap().to_vec();
    let mut out = Vec::new();
    while !processors.iter().any(|p| p.finished()) {
        let mut logits = raw.clone();
        for p in processors.iter_mut() {
            p.process(&mut logits).unwrap();
        }
        let mut t = sampler.sample(&mut logits, &history);
        if !processors.iter().all(|p| p.allowed(t)) {
            t = cmf_llm::sampling::argmax(&logits);
        }
        for p in processors.iter_mut() {
            p.accept(t).unwrap();
        }
        if req.eos_ids.contains(&t) {
            break;
        }
        out.push((t, req.logprobs.map(|k| token_logprob(&raw, t, k))));
        history.push(t);
        if out.len() == req.max_tokens {
            break;
        }
        raw = model.decode(&mut st, t).unwrap().to_vec();
    }
    out
}

/// A stand-in for a grammar: the `i`-th token must be ≡ i (mod 3), and the answer ends after
/// `limit` tokens (as a grammar reaching its end).
struct Cyclic {
    accepted: usize,
    limit: usize,
}

impl LogitProcessor for Cyclic {
    fn process(&mut self, logits: &mut [f32]) -> cmf_llm::Result<()> {
        for (i, l) in logits.iter_mut().enumerate() {
            if i % 3 != self.accepted % 3 {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    fn accept(&mut self, token: u32) -> cmf_llm::Result<()> {
        if !self.allowed(token) {
            return Err(cmf_llm::LlmError::Other(format!("{token} is not allowed")));
        }
        self.accepted += 1;
        Ok(())
    }

    fn allowed(&self, token: u32) -> bool {
        token as usize % 3 == self.accepted % 3
    }

    fn finished(&self) -> bool {
        self.accepted >= self.limit
    }
}

/// Fails on its `at`-th step.
struct FailsAt(usize);

impl LogitProcessor for FailsAt {
    fn process(&mut self, _: &mut [f32]) -> cmf_llm::Result<()> {
        match self.0 {
            0 => Err(cmf_llm::LlmError::Other("the grammar broke".into())),
            _ => Ok(()),
        }
    }

    fn accept(&mut self, _: u32) -> cmf_llm::Result<()> {
        self.0 -= 1;
        Ok(())
    }
}

type MakeProcessors = fn() -> Vec<Box<dyn LogitProcessor>>;

fn no_processors() -> Vec<Box<dyn LogitProcessor>> {
    Vec::new()
}

fn biased() -> Vec<Box<dyn LogitProcessor>> {
    vec![Box::new(LogitBias(vec![(40, 6.0), (41, 3.5), (7, -100.0)]))]
}

fn cyclic() -> Vec<Box<dyn LogitProcessor>> {
    vec![Box::new(Cyclic {
        accepted: 0,
        limit: 7,
    })]
}

/// Checks each choice of `run` against the request served alone: the same tokens, and
/// log-probabilities within 1e-5.
fn assert_choices(
    model: &Model,
    name: &str,
    cases: &[(Request, MakeProcessors)],
    ids: &[RequestId],
    run: &Run,
) {
    for ((req, make), &id) in cases.iter().zip(ids) {
        for choice in 0..req.n.max(1) {
            let want = alone_processed(model, req, choice, make());
            let got = run.choices.get(&(id, choice)).cloned().unwrap_or_default();
            let tokens = |v: &[Sampled]| v.iter().map(|e| e.0).collect::<Vec<_>>();
            assert_eq!(
                tokens(&got),
                tokens(&want),
                "{name}: request {id} choice {choice}"
            );
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                match (&g.1, &w.1) {
                    (None, None) => {}
                    (Some(g), Some(w)) => {
                        assert!(
                            (g.logprob - w.logprob).abs() < 1e-5,
                            "{name}: {id}/{choice} token {i}: {} vs {}",
                            g.logprob,
                            w.logprob
                        );
                        assert_eq!(g.top.len(), w.top.len());
                        for (a, b) in g.top.iter().zip(&w.top) {
                            assert!(
                                a.0 == b.0 && (a.1 - b.1).abs() < 1e-5,
                                "{name}: top {a:?} vs {b:?}"
                            );
                        }
                    }
                    other => panic!("{name}: logprobs {other:?}"),
                }
            }
            assert!(
                run.choices_finished.contains_key(&(id, choice)),
                "{name}: {id}/{choice} never finished"
            );
        }
    }
}

/// Requests with log-probabilities, a logit bias and a grammar-like mask join the batch beside
/// plain ones (one of them mid-run) and each gets what it gets alone: the same tokens (greedy
/// and seeded), log-probabilities within 1e-5, the mask's end as an end of sequence.
#[test]
fn processed_requests_join_the_batch() {
    for name in ["llama-tiny", "qwen3-tiny"] {
        let f = fixture(name);
        let source = SafetensorsSource::new(&f.files);
        let model = Model::from_source(&source, f.config.clone(), "").unwrap();
        let cfg = SchedulerConfig {
            max_running: 4,
            step_tokens: 32,
        };
        let mut s = scheduler(&model, 64, 16, cfg);
        let seeded = SamplingParams {
            temperature: 0.9,
            top_p: 0.95,
            repeat_penalty: 1.2,
            seed: 11,
            ..SamplingParams::default()
        };
        let with = |prompt: Vec<u32>, max_tokens, sampling, logprobs| Request {
            prompt,
            max_tokens,
            sampling,
            logprobs,
            ..Request::default()
        };
        let cases: Vec<(Request, MakeProcessors)> = vec![
            (
                with(prompt(1, 21), 12, SamplingParams::default(), Some(3)),
                biased,
            ),
            (with(prompt(2, 40), 20, seeded, Some(0)), cyclic),
            (
                with(prompt(3, 50), 10, SamplingParams::default(), None),
                no_processors,
            ),
            (with(prompt(4, 9), 14, seeded, Some(2)), biased),
        ];
        let mut ids = Vec::new();
        for (req, make) in &cases[..3] {
            ids.push(s.submit_with(req.clone(), vec![make()]).unwrap());
        }
        let mut run = drive_with(&mut s, 3, &cases[3], &mut ids);
        assert_choices(&model, name, &cases, &ids, &run);
        assert_eq!(
            run.choices_finished.remove(&(ids[1], 0)),
            Some(FinishReason::Eos),
            "{name}: the mask's end"
        );
        assert_eq!(s.engine().pool_stats().held, 0, "{name}: blocks leaked");
    }
}

/// Steps `s` until idle (checking the pool after every step), submitting `later` before step
/// `at`; its id goes to `ids`.
fn drive_with(
    s: &mut Scheduler,
    at: usize,
    later: &(Request, MakeProcessors),
    ids: &mut Vec<RequestId>,
) -> Run {
    let mut later = Some(later);
    let (_, run) = drive(s, &[], &[], |step, s| {
        if step == at {
            if let Some((req, make)) = later.take() {
                let n = req.n.max(1);
                ids.push(
                    s.submit_with(req.clone(), (0..n).map(|_| make()).collect())
                        .unwrap(),
                );
            }
        }
    });
    run
}

/// `n` choices: the prompt is computed once (the engine's prompt rows count it once), the
/// choices fork from it sharing its blocks (the partly filled last one copied before a write:
/// the engine refuses any write into a shared block), each samples with its own seed and equals
/// the request alone with that seed. Also on a hybrid model (the recurrent state is copied),
/// and in a pool so short that forks are preempted and recomputed.
#[test]
fn choices_share_the_prompt() {
    let seeded = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        seed: 5,
        ..SamplingParams::default()
    };
    // (fixture, blocks, block size, prompt length)
    for (name, blocks, bs, len) in [
        ("llama-tiny", 64, 16, 37),
        ("llama-tiny", 64, 16, 32),
        ("qwen3next-tiny", 64, 16, 37),
        ("qwen3-tiny", 14, 4, 10),
    ] {
        let f = fixture(name);
        let source = SafetensorsSource::new(&f.files);
        let model = Model::from_source(&source, f.config.clone(), "").unwrap();
        let cfg = SchedulerConfig {
            max_running: 4,
            step_tokens: 64,
        };
        let mut s = scheduler(&model, blocks, bs, cfg);
        let short = blocks < 20;
        let max_tokens = if short { 24 } else { 9 };
        let cases: Vec<(Request, MakeProcessors)> = vec![
            (
                Request {
                    prompt: prompt(7, len),
                    max_tokens,
                    sampling: seeded,
                    n: 3,
                    logprobs: Some(2),
                    ..Request::default()
                },
                no_processors,
            ),
            (greedy(prompt(8, 20), 6), no_processors),
        ];
        let mut ids = vec![s.submit_with(cases[0].0.clone(), Vec::new()).unwrap()];
        let run = drive_with(&mut s, 0, &cases[1], &mut ids);
        assert_choices(&model, name, &cases, &ids, &run);
        let rows = s.engine().rows_computed();
        if short {
            assert!(
                s.stats().preemptions > 0,
                "{name}: the pool was never short"
            );
        } else {
            // Every choice ran to its length: max_tokens - 1 decode rows each.
            assert_eq!(rows.prompt, (len + 20) as u64, "{name}: prompt rows");
            assert_eq!(rows.generated, (3 * (max_tokens - 1) + 5) as u64, "{name}");
        }
        let distinct: std::collections::HashSet<Vec<u32>> = (0..3)
            .map(|c| run.choices[&(ids[0], c)].iter().map(|e| e.0).collect())
            .collect();
        assert!(distinct.len() > 1, "{name}: the seeds drew the same answer");
        assert_eq!(s.engine().pool_stats().held, 0, "{name}: blocks leaked");
        assert_eq!(s.engine().slots_in_use(), 0, "{name}: slots leaked");
    }
}

/// A request sharing a long system prompt with an earlier one computes only its suffix: the
/// engine's prompt rows grow by its length less the cached whole blocks.
#[test]
fn second_request_computes_only_its_suffix() {
    let f = fixture("qwen2-tiny");
    let source = SafetensorsSource::new(&f.files);
    let model = Model::from_source(&source, f.config.clone(), "").unwrap();
    let mut s = scheduler(&model, 64, 16, SchedulerConfig::default());
    let system = prompt(42, 200);
    let with_tail = |seed: u32, n: usize| {
        let mut p = system.clone();
        p.extend(prompt(seed, n));
        p
    };
    let first = greedy(with_tail(1, 7), 4);
    drive(&mut s, &[first], &[], |_, _| {});
    let before = s.engine().rows_computed().prompt;
    assert_eq!(before, 207);
    let second = greedy(with_tail(2, 9), 4);
    let (ids, run) = drive(&mut s, std::slice::from_ref(&second), &[], |_, _| {});
    // 12 whole blocks (192 tokens) are the system prompt's; the 13th holds the first suffix.
    assert_eq!(s.engine().rows_computed().prompt - before, 209 - 192);
    assert_same(&model, "qwen2-tiny", &[second], &ids, &run);
}

/// A processor that fails ends its request (every choice, blocks back) with the error; the
/// others go on unchanged.
#[test]
fn a_failing_processor_ends_only_its_request() {
    let f = fixture("mistral-tiny");
    let source = SafetensorsSource::new(&f.files);
    let model = Model::from_source(&source, f.config.clone(), "").unwrap();
    let mut s = scheduler(&model, 64, 16, SchedulerConfig::default());
    let plain = greedy(prompt(1, 30), 8);
    let ok = s.submit(plain.clone()).unwrap();
    let failing = Request {
        n: 2,
        ..greedy(prompt(2, 25), 8)
    };
    let fails = || -> Vec<Box<dyn LogitProcessor>> { vec![Box::new(FailsAt(3))] };
    let bad = s.submit_with(failing, vec![fails(), fails()]).unwrap();
    let mut tokens = Vec::new();
    let mut failed = None;
    for _ in 0..100 {
        if s.is_idle() {
            break;
        }
        for e in s.step().unwrap() {
            match e {
                Event::Token { id, token, .. } if id == ok => tokens.push(token),
                Event::Failed { id, error } => failed = Some((id, error)),
                _ => {}
            }
        }
        s.engine().check().unwrap();
    }
    let (id, error) = failed.expect("the request never failed");
    assert_eq!(id, bad);
    assert!(error.contains("the grammar broke"), "{error}");
    assert!(!s.cancel(bad), "its choices are gone");
    assert_eq!(tokens, alone(&model, &plain));
    assert_eq!(s.engine().pool_stats().held, 0);
    let e = s.submit_with(greedy(prompt(3, 5), 4), vec![fails()]);
    assert!(e.is_ok(), "one list for one choice");
    assert!(s
        .submit_with(
            Request {
                n: 2,
                ..greedy(prompt(3, 5), 4)
            },
            vec![fails()]
        )
        .is_err());
}

/// The prompt's log-probabilities from a teacher-forced single-sequence pass (f32 cache).
fn teacher_forced(model: &Model, prompt: &[u32], top: usize) -> Vec<TokenLogprob> {
    let mut st = model.new_state_with(prompt.len(), KvDtype::F32).unwrap();
    let mut out = Vec::new();
    model
        .forward_scored(&mut st, prompt, 0, |i, logits| {
            if i + 1 < prompt.len() {
                out.push(token_logprob(logits, prompt[i + 1], top));
            }
        })
        .unwrap();
    out
}

/// A request that wants its prompt's log-probabilities (`echo`) joins the batch: its prompt
/// goes in chunks beside decoding sequences, every row scored once (also when preempted mid-way
/// in a short pool, and when an earlier request cached its prefix), equal to a teacher-forced
/// pass within 1e-5; its choices and the others' tokens are what they are alone.
#[test]
fn prompt_logprobs_join_the_batch() {
    let seeded = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        seed: 21,
        ..SamplingParams::default()
    };
    // (fixture, blocks, block size)
    for (name, blocks, bs) in [
        ("llama-tiny", 64, 16),
        ("qwen3next-tiny", 64, 16),
        ("qwen3-tiny", 24, 4),
    ] {
        let f = fixture(name);
        let source = SafetensorsSource::new(&f.files);
        let model = Model::from_source(&source, f.config.clone(), "").unwrap();
        let cfg = SchedulerConfig {
            max_running: 4,
            step_tokens: 16,
        };
        let mut s = scheduler(&model, blocks, bs, cfg);
        let short = blocks < 32;
        let shared = prompt(30, 40);
        let mut tail = shared.clone();
        tail.extend(prompt(31, 11));
        // The plain one caches `shared`'s blocks before the scored ones arrive.
        let plain = greedy(shared, if short { 20 } else { 6 });
        let cases: Vec<(Request, MakeProcessors)> = vec![
            (
                Request {
                    prompt: prompt(32, 45),
                    max_tokens: 7,
                    sampling: seeded,
                    n: 2,
                    logprobs: Some(1),
                    prompt_logprobs: Some(2),
                    ..Request::default()
                },
                no_processors,
            ),
            (
                Request {
                    prompt_logprobs: Some(0),
                    ..greedy(tail, 5)
                },
                no_processors,
            ),
        ];
        let later = [(1, cases[0].0.clone()), (2, cases[1].0.clone())];
        let (all, run) = drive(&mut s, &[plain], &later, |_, _| {});
        let (first, ids) = (all[0], &all[1..]);
        assert_choices(&model, name, &cases, ids, &run);
        for ((req, _), id) in cases.iter().zip(ids) {
            let top = req.prompt_logprobs.unwrap();
            let want = teacher_forced(&model, &req.prompt, top);
            let got = &run.prompts[id];
            assert_eq!(got.len(), req.prompt.len() - 1, "{name}: {id}");
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.id, w.id, "{name}: {id} token {}", i + 1);
                assert!(
                    (g.logprob - w.logprob).abs() < 1e-5,
                    "{name}: {id} token {}: {} vs {}",
                    i + 1,
                    g.logprob,
                    w.logprob
                );
                assert_eq!(g.top.len(), top);
                for (a, b) in g.top.iter().zip(&w.top) {
                    assert!(
                        a.0 == b.0 && (a.1 - b.1).abs() < 1e-5,
                        "{name}: {a:?} vs {b:?}"
                    );
                }
            }
        }
        assert!(!run.prompts.contains_key(&first));
        if short {
            assert!(
                s.stats().preemptions > 0,
                "{name}: the pool was never short"
            );
        }
        assert_eq!(s.engine().pool_stats().held, 0, "{name}: blocks leaked");
        assert_eq!(s.engine().slots_in_use(), 0, "{name}: slots leaked");
    }
}

#[path = "batched/device.rs"]
mod device;

#[path = "batched/hybrid_prefix.rs"]
mod hybrid_prefix;
