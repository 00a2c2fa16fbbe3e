//! The batched engine on a device: the fake backend on the CPU, CUDA on the GPU machine
//! (`device_batched_equals_alone`), through the same scheduler and checks as the CPU pool.

use super::*;
use cmf_gpu::llm::KvPrecision;
use cmf_llm::batch::{DeviceBatch, PoolSize};

/// A scheduler over the batched engine on `gpu`'s device (the fake backend on the CPU, CUDA on
/// the GPU machine): the pool of `blocks` blocks of `block_size` positions lives there.
fn device_scheduler<'m, 'a>(
    model: &'m Model<'a>,
    gpu: &cmf_gpu::facade::Gpu,
    blocks: usize,
    block_size: usize,
    cfg: SchedulerConfig,
) -> Scheduler<'m, 'a> {
    let dev = DeviceBatch::load(
        gpu,
        model,
        1024,
        cfg.step_tokens,
        block_size,
        PoolSize::Blocks(blocks),
        KvPrecision::Auto,
    )
    .unwrap();
    assert!(dev.blocks() >= blocks, "{dev:?}");
    let engine = BatchEngine::on_device(model, f32_pool(blocks, block_size), dev).unwrap();
    Scheduler::new(engine, cfg).unwrap()
}

/// The engine-level tests' pool: 16 blocks of 16 positions, f32.
const SMALL_POOL: BatchConfig = f32_pool(16, 16);

/// A batched engine on `gpu`'s device over [`SMALL_POOL`].
fn small_device_engine<'m, 'a>(
    gpu: &cmf_gpu::facade::Gpu,
    model: &'m Model<'a>,
) -> BatchEngine<'m, 'a> {
    let dev = DeviceBatch::load(
        gpu,
        model,
        1024,
        64,
        16,
        PoolSize::Blocks(16),
        KvPrecision::Auto,
    )
    .unwrap();
    BatchEngine::on_device(model, SMALL_POOL, dev).unwrap()
}

/// Adds each prompt to every engine (the same sequence id in each) with its whole length
/// reserved; the work of one step that prefills them all.
fn add_to_all(engines: &mut [&mut BatchEngine], prompts: &[Vec<u32>]) -> Vec<cmf_llm::batch::Work> {
    prompts
        .iter()
        .map(|p| {
            let ids: Vec<_> = engines
                .iter_mut()
                .map(|e| e.add(p.clone()).unwrap())
                .collect();
            assert!(ids.iter().all(|&id| id == ids[0]), "{ids:?}");
            for e in engines.iter_mut() {
                assert!(e.reserve(ids[0], p.len()));
            }
            cmf_llm::batch::Work {
                seq: ids[0],
                tokens: p.len(),
            }
        })
        .collect()
}

/// Whether every step ran on the device, or the contention guard gave it up on timing alone (a
/// loaded test machine can slow the fake's steps past its budget; the outputs are checked
/// either way).
fn stayed_on_device(s: &Scheduler, gpu: &cmf_gpu::facade::Gpu) -> bool {
    s.engine().is_device() || gpu.is_contended()
}

fn fake_gpu() -> cmf_gpu::facade::Gpu {
    use cmf_gpu::facade::{fake::FakeBackend, Gpu, GpuMode};
    Gpu::with_backend(
        GpuMode::Auto,
        std::sync::Arc::new(FakeBackend::new(1 << 32)),
    )
}

/// Sequences joining and leaving, prompts chunked beside decode rows, on each fixture family:
/// the device engine's outputs are each sequence's alone.
fn joining_and_leaving_on(
    gpu: &cmf_gpu::facade::Gpu,
    name: &str,
) -> (Vec<Request>, Run, Vec<RequestId>) {
    let f = fixture(name);
    let source = SafetensorsSource::new(&f.files);
    let model = Model::from_source(&source, f.config.clone(), "").unwrap();
    let cfg = SchedulerConfig {
        max_running: 4,
        step_tokens: 24,
    };
    let mut s = device_scheduler(&model, gpu, 64, 16, cfg);
    let first: Vec<Request> = [(1, 5, 12), (2, 37, 4), (3, 70, 9)]
        .map(|(seed, len, n)| greedy(prompt(seed, len), n))
        .into();
    let later: Vec<(usize, Request)> = [(3, 4, 50, 15), (5, 5, 1, 6), (9, 6, 33, 20)]
        .map(|(at, seed, len, n)| (at, greedy(prompt(seed, len), n)))
        .into();
    let (ids, run) = drive(&mut s, &first, &later, |_, _| {});
    assert!(
        stayed_on_device(&s, gpu),
        "{name}: the device stopped answering"
    );
    assert_eq!(s.engine().pool_stats().held, 0, "{name}: blocks leaked");
    (run.submitted.clone(), run, ids)
}

#[test]
fn fake_device_joining_and_leaving_equals_alone() {
    for name in FIXTURES {
        // A device of its own per fixture: a guard tripped by a loaded machine stays tripped.
        let gpu = fake_gpu();
        let f = fixture(name);
        let source = SafetensorsSource::new(&f.files);
        let model = Model::from_source(&source, f.config.clone(), "").unwrap();
        let (reqs, run, ids) = joining_and_leaving_on(&gpu, name);
        assert_same(&model, name, &reqs, &ids, &run);
    }
}

/// Mixture-of-experts models in the device batch (routing and grouped expert GEMMs per step):
/// each sequence's outputs are its alone.
#[test]
fn fake_device_moe_joining_and_leaving_equals_alone() {
    for name in MOE_FIXTURES {
        let gpu = fake_gpu();
        let f = fixture(name);
        let source = SafetensorsSource::new(&f.files);
        let model = Model::from_source(&source, f.config.clone(), "").unwrap();
        let (reqs, run, ids) = joining_and_leaving_on(&gpu, name);
        assert_same(&model, name, &reqs, &ids, &run);
    }
}

/// Requests sharing a prefix on the device pool: the later ones read its cached blocks there.
#[test]
fn fake_device_shared_prefix_is_reused() {
    let gpu = fake_gpu();
    let f = fixture("llama-tiny");
    let source = SafetensorsSource::new(&f.files);
    let model = Model::from_source(&source, f.config.clone(), "").unwrap();
    let mut s = device_scheduler(&model, &gpu, 64, 16, SchedulerConfig::default());
    check_shared_prefix(&model, &mut s);
    assert!(stayed_on_device(&s, &gpu));
}

/// The device refuses a step in the middle of the run (an injected refusal): the engine moves
/// to the CPU, recomputes what the device held, and every output is still its alone.
#[test]
fn fake_device_refusal_moves_to_the_cpu_mid_run() {
    let gpu = fake_gpu();
    let f = fixture("qwen3-tiny");
    let source = SafetensorsSource::new(&f.files);
    let model = Model::from_source(&source, f.config.clone(), "").unwrap();
    let cfg = SchedulerConfig {
        max_running: 4,
        step_tokens: 24,
    };
    let mut s = device_scheduler(&model, &gpu, 64, 16, cfg);
    // The load and the pool took two calls; refuse from the seventh step on.
    gpu.inject_refusal_after(8);
    let reqs: Vec<Request> = (0..4)
        .map(|i| greedy(prompt(20 + i, 10 + 9 * i as usize), 12))
        .collect();
    let (ids, run) = drive(&mut s, &reqs, &[], |_, _| {});
    assert!(!s.engine().is_device(), "the injected refusal never came");
    assert_same(&model, "qwen3-tiny", &reqs, &ids, &run);
    assert_eq!(s.engine().pool_stats().held, 0);
}

/// The device's greedy steps (one arg-max id per sequence back) agree with the logits' arg-max.
#[test]
fn fake_device_greedy_steps_match_logits() {
    let gpu = fake_gpu();
    let f = fixture("mistral-tiny");
    let source = SafetensorsSource::new(&f.files);
    let model = Model::from_source(&source, f.config.clone(), "").unwrap();
    let mut a = small_device_engine(&gpu, &model);
    let mut b = small_device_engine(&gpu, &model);
    let prompts: Vec<Vec<u32>> = [3usize, 20, 9]
        .into_iter()
        .enumerate()
        .map(|(i, len)| prompt(40 + i as u32, len))
        .collect();
    let work = add_to_all(&mut [&mut a, &mut b], &prompts);
    let ids = a.step_greedy(&work).unwrap();
    let v = model.config.vocab_size;
    let want: Vec<u32> = b
        .step(&work)
        .unwrap()
        .chunks(v)
        .map(cmf_llm::sampling::argmax)
        .collect();
    assert_eq!(ids, want);
}

/// Sampled requests of every kind the device draws (seeds, temperatures, top-k / top-p / min-p,
/// repetition / presence / frequency penalties, a greedy one with penalties) joining and leaving
/// beside a plain greedy one, and later a top-k past the device's candidates (its steps bring the
/// logits back): on `gpu`, each request's tokens are its alone with the host sampler. Returns how
/// many steps the device drew.
fn sampled_requests_on(gpu: &cmf_gpu::facade::Gpu, name: &str) -> u64 {
    let f = fixture(name);
    let source = SafetensorsSource::new(&f.files);
    let model = Model::from_source(&source, f.config.clone(), "").unwrap();
    let cfg = SchedulerConfig {
        max_running: 6,
        step_tokens: 24,
    };
    let mut s = device_scheduler(&model, gpu, 96, 16, cfg);
    let sampled = |seed: u32, len: usize, n: usize, sampling: SamplingParams| Request {
        sampling: SamplingParams {
            seed: seed as u64 * 7919,
            ..sampling
        },
        ..greedy(prompt(seed, len), n)
    };
    let base = SamplingParams {
        temperature: 0.9,
        ..SamplingParams::default()
    };
    let first = vec![
        sampled(1, 9, 14, base),
        sampled(
            2,
            30,
            10,
            SamplingParams {
                temperature: 1.3,
                top_k: 20,
                top_p: 0.9,
                ..base
            },
        ),
        sampled(
            3,
            5,
            16,
            SamplingParams {
                temperature: 0.7,
                top_p: 0.8,
                min_p: 0.05,
                repeat_penalty: 1.3,
                presence_penalty: 0.4,
                frequency_penalty: 0.2,
                penalty_last_n: 12,
                ..base
            },
        ),
        greedy(prompt(4, 12), 12),
    ];
    let later = vec![
        (
            2,
            sampled(
                5,
                17,
                12,
                SamplingParams {
                    temperature: 0.0,
                    repeat_penalty: 1.5,
                    frequency_penalty: 0.3,
                    ..SamplingParams::default()
                },
            ),
        ),
        (
            3,
            sampled(
                6,
                3,
                11,
                SamplingParams {
                    temperature: 2.0,
                    min_p: 0.1,
                    top_k: 64,
                    ..base
                },
            ),
        ),
        (12, sampled(7, 8, 6, SamplingParams { top_k: 65, ..base })),
    ];
    let (ids, run) = drive(&mut s, &first, &later, |_, _| {});
    assert!(
        stayed_on_device(&s, gpu),
        "{name}: the device stopped answering"
    );
    assert_same(&model, name, &run.submitted, &ids, &run);
    assert_eq!(s.engine().pool_stats().held, 0, "{name}: blocks leaked");
    s.engine().device_sampled_steps()
}

#[test]
fn fake_device_sampled_requests_equal_alone() {
    for name in ["llama-tiny", "qwen3-tiny"] {
        let gpu = fake_gpu();
        let drawn = sampled_requests_on(&gpu, name);
        assert!(
            drawn > 5 || gpu.is_contended(),
            "{name}: the device drew {drawn} steps"
        );
    }
}

/// The device refuses a sampled step mid-run: the engine moves to the CPU, whose host sampler
/// draws the same tokens, and every seeded request still equals its alone.
#[test]
fn fake_device_refusal_of_a_sampled_step_moves_to_the_cpu() {
    let gpu = fake_gpu();
    let f = fixture("llama-tiny");
    let source = SafetensorsSource::new(&f.files);
    let model = Model::from_source(&source, f.config.clone(), "").unwrap();
    let cfg = SchedulerConfig {
        max_running: 4,
        step_tokens: 24,
    };
    let mut s = device_scheduler(&model, &gpu, 64, 16, cfg);
    gpu.inject_refusal_after(8);
    let reqs: Vec<Request> = (0..4)
        .map(|i| Request {
            sampling: SamplingParams {
                temperature: 0.8 + 0.2 * i as f32,
                top_p: 0.9,
                repeat_penalty: 1.2,
                seed: 100 + i as u64,
                ..SamplingParams::default()
            },
            ..greedy(prompt(30 + i, 6 + 5 * i as usize), 12)
        })
        .collect();
    let (ids, run) = drive(&mut s, &reqs, &[], |_, _| {});
    assert!(!s.engine().is_device(), "the injected refusal never came");
    assert!(s.engine().device_sampled_steps() > 0);
    assert_same(&model, "llama-tiny", &reqs, &ids, &run);
}

/// The engine's sampled steps: on the (fake) device and on the CPU, each output is the host
/// sampler's draw from the logits a plain step returns, with each sequence's window and position.
#[test]
fn fake_device_sampled_steps_match_the_host_sampler() {
    let gpu = fake_gpu();
    let f = fixture("mistral-tiny");
    let source = SafetensorsSource::new(&f.files);
    let model = Model::from_source(&source, f.config.clone(), "").unwrap();
    let mut dev = small_device_engine(&gpu, &model);
    let mut cpu = BatchEngine::new(&model, SMALL_POOL).unwrap();
    let mut plain = small_device_engine(&gpu, &model);
    let specs = [
        SamplingParams {
            temperature: 1.5,
            seed: 3,
            ..SamplingParams::default()
        },
        SamplingParams {
            temperature: 0.8,
            top_k: 5,
            repeat_penalty: 2.0,
            presence_penalty: 1.0,
            seed: 4,
            ..SamplingParams::default()
        },
        SamplingParams {
            temperature: 1.0,
            top_p: 0.7,
            frequency_penalty: 0.5,
            penalty_last_n: 4,
            seed: 5,
            ..SamplingParams::default()
        },
    ];
    // Repeated ids, so the penalties change the logits.
    let prompts: Vec<Vec<u32>> = [3usize, 20, 9]
        .into_iter()
        .enumerate()
        .map(|(i, len)| prompt(40 + i as u32, len).iter().map(|t| t % 7).collect())
        .collect();
    let work = add_to_all(&mut [&mut dev, &mut cpu, &mut plain], &prompts);
    // A sampler count that does not match the outputs is an error, and nothing runs.
    assert!(dev.step_sampled(&work, &specs[..2]).is_err());
    let got = dev.step_sampled(&work, &specs).unwrap();
    assert_eq!(dev.device_sampled_steps(), 1);
    assert_eq!(cpu.step_sampled(&work, &specs).unwrap(), got);
    let v = model.config.vocab_size;
    let logits = plain.step(&work).unwrap().to_vec();
    let want: Vec<u32> = logits
        .chunks(v)
        .zip(&specs)
        .zip(&prompts)
        .map(|((row, spec), p)| Sampler::new(*spec).sample(&mut row.to_vec(), p))
        .collect();
    assert_eq!(got, want);
}

/// On the GPU machine: sampled requests drawn by the CUDA batched sampler, token for token
/// against each request alone with the host sampler on the CPU (f32 fixtures: the logits agree
/// to ~1e-6, so a draw differs only if it lands within that of a boundary).
#[test]
fn device_batched_sampled_equals_alone() {
    let g = cmf_gpu::facade::Gpu::open(cmf_gpu::facade::GpuMode::Auto).expect("auto never fails");
    if !g.is_active() {
        gpu_skip::skip_no_device("no CUDA device (`CMF_LOG=debug` says why)");
        return;
    }
    for name in ["llama-tiny", "mistral-tiny"] {
        let drawn = sampled_requests_on(&g, name);
        eprintln!("{name}: {drawn} steps drawn on the device");
        assert!(drawn > 5, "{name}: the device drew {drawn} steps");
    }
}

/// On the GPU machine: the CUDA batched engine against each sequence alone on the CPU. The f32
/// fixtures run f32 throughout (f32 pool, SGEMM) and must match token for token; qwen3-tiny
/// (bf16 weights: f16 pool, bf16 GEMM operands) reports its token match rate.
#[test]
fn device_batched_equals_alone() {
    let g = cmf_gpu::facade::Gpu::open(cmf_gpu::facade::GpuMode::Auto).expect("auto never fails");
    if !g.is_active() {
        gpu_skip::skip_no_device("no CUDA device (`CMF_LOG=debug` says why)");
        return;
    }
    for name in FIXTURES {
        let f = fixture(name);
        let source = SafetensorsSource::new(&f.files);
        let model = Model::from_source(&source, f.config.clone(), "").unwrap();
        let (reqs, run, ids) = joining_and_leaving_on(&g, name);
        if name == "qwen3-tiny" {
            let (mut same, mut total) = (0, 0);
            for (r, id) in reqs.iter().zip(&ids) {
                let want = alone(&model, r);
                let got = run.outputs.get(id).cloned().unwrap_or_default();
                total += want.len();
                same += want.iter().zip(&got).take_while(|(a, b)| a == b).count();
            }
            eprintln!("{name}: {same}/{total} tokens match before the first difference");
        } else {
            assert_same(&model, name, &reqs, &ids, &run);
        }
    }
}

/// On the GPU machine: MoE fixtures (f32) in the CUDA batched engine, token for token against
/// each sequence alone on the CPU.
#[test]
fn device_batched_moe_equals_alone() {
    let g = cmf_gpu::facade::Gpu::open(cmf_gpu::facade::GpuMode::Auto).expect("auto never fails");
    if !g.is_active() {
        gpu_skip::skip_no_device("no CUDA device (`CMF_LOG=debug` says why)");
        return;
    }
    for name in MOE_FIXTURES {
        let f = fixture(name);
        let source = SafetensorsSource::new(&f.files);
        let model = Model::from_source(&source, f.config.clone(), "").unwrap();
        let (reqs, run, ids) = joining_and_leaving_on(&g, name);
        assert_same(&model, name, &reqs, &ids, &run);
    }
}

/// llama-batched-bench's table on the device: one upload, one pool for the largest B, every row.
#[test]
fn fake_device_bench_runs_every_row() {
    use cmf_llm::batch::bench::{run, BatchedBenchConfig};
    let gpu = fake_gpu();
    let f = fixture("llama-tiny");
    let source = SafetensorsSource::new(&f.files);
    let model = Model::from_source(&source, f.config.clone(), "").unwrap();
    let cfg = BatchedBenchConfig {
        prompt_tokens: 9,
        gen_tokens: 3,
        parallel: vec![1, 3],
        kv_dtype: KvDtype::F32,
    };
    let rows = run(&model, &cfg, Some(&gpu), &mut |_| {}).unwrap();
    let got: Vec<(usize, usize)> = rows.iter().map(|r| (r.b, r.n_kv)).collect();
    assert_eq!(got, [(1, 12), (3, 36)]);
    // One model upload for the whole table.
    assert_eq!(gpu.bytes_uploaded(), {
        let g = fake_gpu();
        cmf_llm::batch::DeviceBatch::load(
            &g,
            &model,
            13,
            512,
            16,
            PoolSize::Blocks(1),
            KvPrecision::Auto,
        )
        .unwrap();
        g.bytes_uploaded()
    });
}

/// `n` choices on the device's pool (the fake backend): a fork recomputes its parent's partly
/// filled tail block there instead of copying it, and every choice equals the request alone;
/// beside them a request with a logit bias and logprobs.
#[test]
fn fake_device_choices_equal_alone() {
    let f = fixture("llama-tiny");
    let source = SafetensorsSource::new(&f.files);
    let model = Model::from_source(&source, f.config.clone(), "").unwrap();
    let seeded = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        seed: 5,
        ..SamplingParams::default()
    };
    // A prompt ending inside a block (37) and one filling its last block (32).
    for len in [37, 32] {
        let gpu = fake_gpu();
        let cfg = SchedulerConfig {
            max_running: 4,
            step_tokens: 64,
        };
        let mut s = device_scheduler(&model, &gpu, 64, 16, cfg);
        let cases: Vec<(Request, MakeProcessors)> = vec![
            (
                Request {
                    prompt: prompt(7, len),
                    max_tokens: 9,
                    sampling: seeded,
                    n: 3,
                    logprobs: Some(2),
                    ..Request::default()
                },
                no_processors,
            ),
            (
                Request {
                    logprobs: Some(1),
                    ..greedy(prompt(8, 20), 6)
                },
                biased,
            ),
        ];
        let mut ids = vec![s.submit_with(cases[0].0.clone(), Vec::new()).unwrap()];
        let run = drive_with(&mut s, 0, &cases[1], &mut ids);
        assert_choices(&model, "llama-tiny", &cases, &ids, &run);
        assert!(stayed_on_device(&s, &gpu), "the device stopped answering");
        assert_eq!(s.engine().pool_stats().held, 0, "blocks leaked");
    }
}

/// The device step returns last rows only: a request for its prompt's log-probabilities is
/// refused at submission (the server runs it on the CPU), and nothing is queued.
#[test]
fn fake_device_refuses_prompt_logprobs() {
    let f = fixture("llama-tiny");
    let source = SafetensorsSource::new(&f.files);
    let model = Model::from_source(&source, f.config.clone(), "").unwrap();
    let gpu = fake_gpu();
    let mut s = device_scheduler(&model, &gpu, 16, 16, SchedulerConfig::default());
    let req = Request {
        prompt_logprobs: Some(1),
        ..greedy(prompt(1, 10), 4)
    };
    let e = s.submit(req).unwrap_err().to_string();
    assert!(e.contains("prompt's log-probabilities"), "{e}");
    assert!(s.is_idle());
}
