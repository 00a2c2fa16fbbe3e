//! Prefix reuse on the hybrid (Qwen3-Next) fixtures with the state cache on: a later request
//! resumes from a recurrent-state checkpoint at the end of its cached blocks and gets what it
//! gets alone; a tiny state budget and a short pool, with cancellations and preemptions, never
//! hand out a stale checkpoint and leak nothing.

use super::*;
use cmf_llm::batch::{SeqId, Work};
use cmf_test_support::rng::Rng;

/// A scheduler whose engine keeps `state_bytes` of recurrent-state checkpoints.
pub(super) fn scheduler_with_states<'m, 'a>(
    model: &'m Model<'a>,
    blocks: usize,
    block_size: usize,
    cfg: SchedulerConfig,
    state_bytes: usize,
) -> Scheduler<'m, 'a> {
    let mut engine = BatchEngine::new(model, f32_pool(blocks, block_size)).unwrap();
    engine.set_state_cache(state_bytes);
    assert!(engine.reuses_prefixes());
    Scheduler::new(engine, cfg).unwrap()
}

fn joined(parts: &[&[u32]]) -> Vec<u32> {
    parts.concat()
}

/// Computes `id`'s pending tokens in items that end at each checkpoint, as the scheduler plans
/// them; returns the item sizes and the last item's logits.
fn run_to_end(e: &mut BatchEngine, id: SeqId) -> (Vec<usize>, Vec<f32>) {
    let (mut chunks, mut logits) = (Vec::new(), Vec::new());
    while e.pending(id) > 0 {
        let n = e.pending(id).min(e.until_checkpoint(id));
        assert!(e.reserve(id, n));
        logits = e.step(&[Work { seq: id, tokens: n }]).unwrap().to_vec();
        chunks.push(n);
        e.check().unwrap();
    }
    (chunks, logits)
}

/// The state a checkpoint restores is the state the prefix computes: a second prompt sharing a
/// 120-token system prompt resumes at its last shared block boundary (112) and its logits are
/// bit for bit those of the same prompt computed from scratch in the same items (f32 KV).
#[test]
fn hybrid_resumed_logits_equal_a_fresh_computation() {
    for name in HYBRID_FIXTURES {
        let f = fixture(name);
        let source = SafetensorsSource::new(&f.files);
        let model = Model::from_source(&source, f.config.clone(), "").unwrap();
        let cfg = f32_pool(64, 16);
        let system = prompt(99, 120);
        let second = joined(&[&system, &prompt(2, 9)]);

        let mut cached = BatchEngine::new(&model, cfg).unwrap();
        cached.set_state_cache(1 << 20);
        let first = cached.add(joined(&[&system, &prompt(1, 5)])).unwrap();
        assert_eq!(cached.reuse_prefix(first), 0);
        let (first_chunks, _) = run_to_end(&mut cached, first);
        cached.remove(first);
        let id = cached.add(second.clone()).unwrap();
        assert_eq!(cached.reuse_prefix(id), 112, "{name}");
        let (chunks, got) = run_to_end(&mut cached, id);
        assert_eq!(cached.state_cache_stats().restored, 1, "{name}");
        cached.remove(id);
        cached.check().unwrap();
        assert_eq!(cached.slots_in_use(), 0);

        // From scratch: the first request's items up to 112, then the second's.
        let mut fresh = BatchEngine::new(&model, cfg).unwrap();
        let id = fresh.add(second).unwrap();
        let mut done = 0;
        let mut want = Vec::new();
        for n in first_chunks
            .iter()
            .scan(0, |at, &n| {
                *at += n;
                Some((*at, n))
            })
            .take_while(|&(at, _)| at <= 112)
            .map(|(_, n)| n)
            .chain(chunks)
        {
            assert!(fresh.reserve(id, n));
            want = fresh.step(&[Work { seq: id, tokens: n }]).unwrap().to_vec();
            done += n;
        }
        assert_eq!(done, 129);
        assert!(
            got.iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{name}: resumed logits differ from the fresh ones"
        );
    }
}

/// Through the scheduler: a second request sharing a 120-token system prompt takes its 7 full
/// blocks and the checkpoint at their end; a conversation resent in full (the first prompt, its
/// answer, a new turn) resumes at the last block boundary the first request generated past.
/// Tokens equal each request alone, log-probabilities within 1e-4 (the prompt is computed in
/// other chunks than alone, so the rounding differs; the test above checks the state itself).
#[test]
fn hybrid_shared_prefix_and_conversation_resume() {
    for name in HYBRID_FIXTURES {
        let f = fixture(name);
        let source = SafetensorsSource::new(&f.files);
        let model = Model::from_source(&source, f.config.clone(), "").unwrap();
        let mut s = scheduler_with_states(&model, 64, 16, SchedulerConfig::default(), 1 << 20);
        let system = prompt(99, 120);
        let with_logprobs = |prompt: Vec<u32>| Request {
            logprobs: Some(3),
            ..greedy(prompt, 8)
        };
        let first = with_logprobs(joined(&[&system, &prompt(1, 5)]));
        let (ids, run) = drive(&mut s, std::slice::from_ref(&first), &[], |_, _| {});
        assert_close(&model, name, &first, &ids, &run);
        let answer = run.outputs[&ids[0]].clone();
        assert_eq!(answer.len(), 8);
        assert_eq!(s.stats().prefix_tokens_reused, 0);

        let rows = s.engine().rows_computed().prompt;
        let second = with_logprobs(joined(&[&system, &prompt(2, 9)]));
        let (ids, run) = drive(&mut s, std::slice::from_ref(&second), &[], |_, _| {});
        assert_close(&model, name, &second, &ids, &run);
        assert_eq!(
            s.stats().prefix_tokens_reused,
            112,
            "{name}: {:?}",
            s.stats()
        );
        assert_eq!(s.engine().rows_computed().prompt - rows, 129 - 112);

        // The first request computed 125 + 7 tokens (its last answer token is not fed back):
        // a checkpoint at 128 and blocks up to there.
        let rows = s.engine().rows_computed().prompt;
        let third = with_logprobs(joined(&[&first.prompt, &answer, &prompt(5, 10)]));
        let (ids, run) = drive(&mut s, std::slice::from_ref(&third), &[], |_, _| {});
        assert_close(&model, name, &third, &ids, &run);
        assert_eq!(
            s.stats().prefix_tokens_reused,
            112 + 128,
            "{name}: {:?}",
            s.stats()
        );
        assert_eq!(s.engine().rows_computed().prompt - rows, 143 - 128);
        assert_eq!(s.engine().pool_stats().held, 0);
        assert_eq!(s.engine().slots_in_use(), 0);
    }
}

/// `run`'s answer to `req` (its only request) is the request alone: the same tokens, each
/// log-probability within 1e-4.
fn assert_close(model: &Model, name: &str, req: &Request, ids: &[RequestId], run: &Run) {
    let want = alone_processed(model, req, 0, Vec::new());
    let got = &run.choices[&(ids[0], 0)];
    let tokens = |v: &[Sampled]| v.iter().map(|e| e.0).collect::<Vec<_>>();
    assert_eq!(tokens(got), tokens(&want), "{name}");
    for (g, w) in got.iter().zip(&want) {
        let (g, w) = (g.1.as_ref().unwrap(), w.1.as_ref().unwrap());
        assert!(
            (g.logprob - w.logprob).abs() < 1e-4,
            "{name}: {g:?} vs {w:?}"
        );
    }
}

/// Random workloads over a few shared prompts: requests joining at random steps, some
/// cancelled, a pool short enough to preempt and evict, a state budget of three checkpoints.
/// Every answer equals the request alone (a cancelled one: a prefix of it), the bookkeeping
/// holds after every step, and nothing is held at the end.
#[test]
fn hybrid_checkpoints_under_pressure_never_go_stale() {
    let f = fixture("qwen3next-tiny");
    let source = SafetensorsSource::new(&f.files);
    let model = Model::from_source(&source, f.config.clone(), "").unwrap();
    let mut alone_cache: HashMap<Vec<u32>, Vec<u32>> = HashMap::new();
    let (mut reused, mut dropped, mut preempted) = (0, 0, 0);
    for seed in 0..6u64 {
        let mut rng = Rng(seed * 7919 + 1);
        let cfg = SchedulerConfig {
            max_running: 3,
            step_tokens: 8 + rng.below(40) as usize,
        };
        let probe = BatchEngine::new(&model, f32_pool(1, 4)).unwrap();
        let budget = 3 * (probe.slot_bytes() + 512);
        let mut s = scheduler_with_states(&model, 40, 4, cfg, budget);
        let bases: Vec<Vec<u32>> = (0..3)
            .map(|b| prompt(50 + b + seed as u32 * 3, 60))
            .collect();
        let mut later = Vec::new();
        for i in 0..9u32 {
            let base = &bases[rng.below(3) as usize];
            let cut = 8 + rng.below(52) as usize;
            let tail = prompt(1000 + i + 17 * seed as u32, rng.below(6) as usize);
            let at = rng.below(30) as usize;
            let req = greedy(joined(&[&base[..cut], &tail]), 1 + rng.below(12) as usize);
            later.push((at, req));
        }
        later.sort_by_key(|(at, _)| *at);
        let cancel_at: Vec<(usize, RequestId)> = (0..2)
            .map(|_| (rng.below(40) as usize, rng.below(9)))
            .collect();
        let mut cancelled = Vec::new();
        let (ids, run) = drive(&mut s, &[], &later, |step, s| {
            for &(at, id) in &cancel_at {
                if at == step && s.cancel(id) {
                    cancelled.push(id);
                }
            }
        });
        for (req, id) in run.submitted.iter().zip(&ids) {
            let want = alone_cache
                .entry(req.prompt.clone())
                .or_insert_with(|| alone(&model, &greedy(req.prompt.clone(), 12)));
            let want = &want[..req.max_tokens];
            let got = run.outputs.get(id).cloned().unwrap_or_default();
            if cancelled.contains(id) {
                assert!(want.starts_with(&got), "seed {seed}: cancelled {id}");
            } else {
                assert_eq!(got, want, "seed {seed}: request {id}");
            }
        }
        let e = s.engine();
        e.check().unwrap();
        assert_eq!(e.pool_stats().held, 0, "seed {seed}: blocks leaked");
        assert_eq!(e.slots_in_use(), 0, "seed {seed}: slots leaked");
        let st = e.state_cache_stats();
        assert!(st.bytes <= budget, "{st:?}");
        reused += s.stats().prefix_tokens_reused;
        dropped += st.dropped;
        preempted += s.stats().preemptions;
    }
    // The workloads did exercise what they are meant to.
    assert!(reused > 0, "no prefix was ever reused");
    assert!(dropped > 0, "no checkpoint was ever dropped");
    assert!(preempted > 0, "no sequence was ever preempted");
}

/// Preemption with the state cache on: the preempted sequence gives its slot back (storing the
/// checkpoint of the last boundary it generated past), is recomputed from whatever its cached
/// blocks and checkpoints still cover, and every output is unchanged.
#[test]
fn hybrid_preemption_with_checkpoints_keeps_outputs() {
    for name in HYBRID_FIXTURES {
        check_preemption(name, 1 << 20);
    }
}

/// Where a prompt parts from a cached one between checkpoints, the request resumes from the
/// checkpoint before and checkpoints the parting point, so the next request sharing that prefix
/// resumes exactly there (blocks of 8; a 150-token system prompt, 40-token questions: the
/// first prompt's checkpoints are at 184, 176, 168, 152 and 120, the shared blocks end at 144).
#[test]
fn hybrid_parting_point_is_checkpointed_for_the_next_request() {
    let f = fixture("qwen3next-dense-tiny");
    let source = SafetensorsSource::new(&f.files);
    let model = Model::from_source(&source, f.config.clone(), "").unwrap();
    let mut s = scheduler_with_states(&model, 96, 8, SchedulerConfig::default(), 1 << 20);
    let system = prompt(77, 150);
    let mut reused = Vec::new();
    for seed in 1..4 {
        let req = greedy(joined(&[&system, &prompt(seed, 40)]), 4);
        let before = s.stats().prefix_tokens_reused;
        let (ids, run) = drive(&mut s, std::slice::from_ref(&req), &[], |_, _| {});
        assert_same(&model, "qwen3next-dense-tiny", &[req], &ids, &run);
        reused.push(s.stats().prefix_tokens_reused - before);
    }
    assert_eq!(reused, [0, 120, 144]);
    assert_eq!(s.engine().pool_stats().held, 0);
    assert_eq!(s.engine().slots_in_use(), 0);
}
