//! Facade policy against the fake backend (runs on CI: no GPU needed).

use super::fake::FakeBackend;
use super::*;
use crate::llm::reference::{self, RefCache};
use crate::llm::synth::{qwen3_spec, SynthModel, SynthOptions};
use cmf_format::Dtype;

/// Tests that need no pause_gpu guard alive (pause is process-wide) take this lock, and so do
/// tests that create one.
fn lock() -> std::sync::MutexGuard<'static, ()> {
    guards::TEST_PAUSE_LOCK
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

fn tiny() -> SynthModel {
    SynthModel::new(
        qwen3_spec(64, 128, 3, 4, 2, 16, 97),
        Dtype::F32,
        SynthOptions::QWEN3,
        11,
    )
}

fn fake_gpu(total: u64) -> Gpu {
    Gpu::with_backend(GpuMode::Auto, Arc::new(FakeBackend::new(total)))
}

/// Greedy generation the way a caller does it: device first, CPU path on refusal (after which
/// the CPU rebuilds its cache from the token history and keeps the rest of the run).
fn generate(gpu: &Gpu, m: &SynthModel, prompt: &[u32], steps: usize) -> (Vec<u32>, usize) {
    let model = m.model();
    let mut dev = gpu.load_llm(&model, &LlmOptions::default(), None).ok();
    let mut tokens = prompt.to_vec();
    let mut cpu: Option<RefCache> = None;
    let mut refusals = 0;
    let mut logits = vec![0f32; model.spec.vocab];
    let mut next = match dev
        .as_mut()
        .map(|d| d.prefill(prompt, 0, Logits::Last, &mut logits))
    {
        Some(Ok(())) => reference::argmax(&logits),
        _ => {
            dev = None;
            let mut c = RefCache::new(model.spec.num_layers);
            let mut l = Vec::new();
            for (p, &t) in prompt.iter().enumerate() {
                l = reference::forward_token(&model, t, p, &mut c);
            }
            cpu = Some(c);
            reference::argmax(&l)
        }
    };
    for _ in 0..steps {
        tokens.push(next);
        let pos = tokens.len() - 1;
        if let Some(d) = dev.as_mut() {
            let mut out = DecodeOutput {
                token: 0xDEAD,
                logits: vec![],
            };
            match d.decode(next, pos, &Sampler::Greedy, false, &mut out) {
                Ok(()) => {
                    next = out.token;
                    continue;
                }
                Err(r) => {
                    // Honest refusal: the output struct is exactly as passed in.
                    assert_eq!(
                        out,
                        DecodeOutput {
                            token: 0xDEAD,
                            logits: vec![]
                        },
                        "{r}"
                    );
                    refusals += 1;
                    dev = None;
                }
            }
        }
        let c = cpu.get_or_insert_with(|| {
            let mut c = RefCache::new(model.spec.num_layers);
            for (p, &t) in tokens[..pos].iter().enumerate() {
                reference::forward_token(&model, t, p, &mut c);
            }
            c
        });
        next = reference::argmax(&reference::forward_token(&model, next, pos, c));
    }
    (tokens, refusals)
}

#[test]
fn cpu_only_refuses_everything() {
    let g = Gpu::cpu_only();
    assert!(!g.is_active());
    assert_eq!(g.device_count(), 0);
    let m = tiny();
    let r = g
        .load_llm(&m.model(), &LlmOptions::default(), None)
        .unwrap_err();
    assert_eq!(r.reason, RefusalReason::NoBackend);
}

#[test]
fn off_mode_opens_without_device() {
    let g = Gpu::open(GpuMode::Off).unwrap();
    assert!(!g.is_active());
}

#[test]
fn auto_mode_never_fails() {
    // On CI (no libcuda) this falls back silently; on a GPU machine it opens the device.
    let g = Gpu::open(GpuMode::Auto).unwrap();
    if !g.is_active() {
        let e = Gpu::open(GpuMode::Cuda).unwrap_err();
        assert!(e.to_string().contains("--gpu cuda"), "{e}");
    }
}

#[test]
fn forced_refusal_mid_run_matches_cpu() {
    let _g = lock();
    let m = tiny();
    let cpu_only = generate(&Gpu::cpu_only(), &m, &[1, 5, 9], 8);
    let gpu = fake_gpu(1 << 30);
    let all_device = generate(&gpu, &m, &[1, 5, 9], 8);
    assert_eq!(all_device.1, 0);
    // load + prefill + 3 decodes succeed, the 4th decode refuses.
    gpu.inject_refusal_after(5);
    let mixed = generate(&gpu, &m, &[1, 5, 9], 8);
    assert_eq!(mixed.1, 1, "exactly one refusal expected");
    assert_eq!(cpu_only.0, all_device.0);
    assert_eq!(cpu_only.0, mixed.0);
    gpu.inject_refusal_after(u64::MAX);
}

#[test]
fn refused_prefill_leaves_logits_untouched() {
    let _g = lock();
    let m = tiny();
    let gpu = fake_gpu(1 << 30);
    let mut dev = gpu
        .load_llm(&m.model(), &LlmOptions::default(), None)
        .unwrap();
    let mut logits = vec![f32::NAN; m.spec.vocab];
    let _scope = cpu_scope();
    let r = dev
        .prefill(&[1, 2], 0, Logits::Last, &mut logits)
        .unwrap_err();
    assert_eq!(r.reason, RefusalReason::CpuScope);
    assert!(logits.iter().all(|v| v.is_nan()));
}

#[test]
fn pause_refuses_on_every_thread() {
    let _g = lock();
    let m = tiny();
    let gpu = fake_gpu(1 << 30);
    let mut dev = gpu
        .load_llm(&m.model(), &LlmOptions::default(), None)
        .unwrap();
    let p = pause_gpu();
    let mut out = DecodeOutput::default();
    assert_eq!(
        dev.decode(1, 0, &Sampler::Greedy, false, &mut out)
            .unwrap_err()
            .reason,
        RefusalReason::Paused
    );
    drop(p);
    dev.decode(1, 0, &Sampler::Greedy, false, &mut out).unwrap();
}

#[test]
fn over_budget_model_is_split_and_hybrid_matches_cpu() {
    let _g = lock();
    let m = tiny();
    let model = m.model();
    // Budget for about two of three layers (fake footprint: weights + f32 KV for 4096 positions).
    let fp = FakeBackend::new(0)
        .llm_footprint(&model, &LlmOptions::default())
        .unwrap();
    let two = fp.layer_bytes[0] * 2 + fp.layer_bytes[0] / 2;
    let total = ((two + (512 << 20)) as f64 / 0.9) as u64 + 16;
    let gpu = fake_gpu(total);
    assert!(gpu.vram_budget() >= two && gpu.vram_budget() < fp.layer_bytes[0] * 3);
    let mut dev = gpu.load_llm(&model, &LlmOptions::default(), None).unwrap();
    assert_eq!(dev.placement().on_device, vec![true, true, false]);
    assert!(!dev.placement().is_whole_model());
    // Whole-token entry points refuse; the hybrid path (device layers, CPU rest) matches CPU.
    let mut out = DecodeOutput::default();
    assert!(dev.decode(1, 0, &Sampler::Greedy, false, &mut out).is_err());
    let mut cache = RefCache::new(3);
    let mut hybrid_cache = RefCache::new(3);
    for (pos, tok) in [3u32, 7, 11].into_iter().enumerate() {
        let want = reference::forward_token(&model, tok, pos, &mut cache);
        let mut x = reference::embed(&model, tok);
        for (on_dev, range) in dev.placement().segments() {
            if on_dev {
                dev.forward_layers(range, &mut x, 1, pos).unwrap();
            } else {
                for l in range {
                    reference::layer(&model, l, &mut x, pos, &mut hybrid_cache);
                }
            }
        }
        assert_eq!(reference::head(&model, &x), want);
    }
}

#[test]
fn explicit_layers_and_nothing_fits() {
    let _g = lock();
    let m = tiny();
    let gpu = fake_gpu(1 << 40);
    let set = LayerSet::parse("1-2", "--gpu-layers").unwrap();
    let dev = gpu
        .load_llm(&m.model(), &LlmOptions::default(), Some(&set))
        .unwrap();
    assert_eq!(dev.placement().on_device, vec![false, true, true]);
    let small = fake_gpu(1 << 20);
    let r = small
        .load_llm(&m.model(), &LlmOptions::default(), None)
        .unwrap_err();
    assert!(matches!(r.reason, RefusalReason::OutOfMemory { .. }), "{r}");
}

#[test]
fn upload_counter_is_flat_in_steady_state() {
    let _g = lock();
    let m = tiny();
    let gpu = fake_gpu(1 << 30);
    let mut dev = gpu
        .load_llm(&m.model(), &LlmOptions::default(), None)
        .unwrap();
    let after_load = gpu.bytes_uploaded();
    assert!(after_load >= m.weight_bytes());
    let mut out = DecodeOutput::default();
    for pos in 0..4 {
        dev.decode(3, pos, &Sampler::Greedy, false, &mut out)
            .unwrap();
    }
    assert_eq!(gpu.bytes_uploaded(), after_load);
}

/// A fake GPU and the handle its tests inject faults through.
fn faulty_gpu(total: u64) -> (Gpu, Arc<fake::FakeFaults>) {
    let b = FakeBackend::new(total);
    let faults = b.faults.clone();
    (Gpu::with_backend(GpuMode::Auto, Arc::new(b)), faults)
}

/// The device has less memory than it reported free (another process took it): the upload's
/// allocation failure becomes a smaller placement, and with no room for one layer a refusal;
/// layers the user placed are not moved.
#[test]
fn allocation_failure_at_load_gives_a_smaller_placement_or_a_refusal() {
    let _g = lock();
    let m = tiny();
    let model = m.model();
    let fp = FakeBackend::new(0)
        .llm_footprint(&model, &LlmOptions::default())
        .unwrap();
    let (gpu, faults) = faulty_gpu(1 << 40);
    faults.alloc_limit.store(
        fp.layer_bytes[0] * 2 + fp.layer_bytes[0] / 2,
        Ordering::Relaxed,
    );
    let dev = gpu.load_llm(&model, &LlmOptions::default(), None).unwrap();
    let on = dev.placement().device_layer_count();
    assert!((1..=2).contains(&on), "{:?}", dev.placement());
    assert!(!dev.placement().is_whole_model());

    let set = LayerSet::parse("0-2", "--gpu-layers").unwrap();
    let r = gpu
        .load_llm(&model, &LlmOptions::default(), Some(&set))
        .unwrap_err();
    assert!(r.reason.is_out_of_memory(), "{r}");

    faults
        .alloc_limit
        .store(fp.layer_bytes[0] / 2, Ordering::Relaxed);
    let r = gpu
        .load_llm(&model, &LlmOptions::default(), None)
        .unwrap_err();
    assert!(r.reason.is_out_of_memory(), "{r}");
    // The caller's CPU path then gives what a CPU-only run gives.
    assert_eq!(
        generate(&gpu, &m, &[1, 5, 9], 6),
        generate(&Gpu::cpu_only(), &m, &[1, 5, 9], 6)
    );
}

/// An allocation that fails while running is a refusal with its outputs untouched, and the
/// caller's CPU path gives the same tokens.
#[test]
fn allocation_failure_while_running_is_a_refusal() {
    let _g = lock();
    let m = tiny();
    let (gpu, faults) = faulty_gpu(1 << 30);
    let mut dev = gpu
        .load_llm(&m.model(), &LlmOptions::default(), None)
        .unwrap();
    faults.fail_next_alloc.store(true, Ordering::Relaxed);
    let mut out = DecodeOutput {
        token: 0xDEAD,
        logits: vec![],
    };
    let r = dev
        .decode(1, 0, &Sampler::Greedy, true, &mut out)
        .unwrap_err();
    assert!(r.reason.is_out_of_memory(), "{r}");
    assert_eq!((out.token, out.logits.len()), (0xDEAD, 0));
    dev.decode(1, 0, &Sampler::Greedy, false, &mut out).unwrap();

    let cpu_only = generate(&Gpu::cpu_only(), &m, &[1, 5, 9], 6);
    faults.fail_next_alloc.store(true, Ordering::Relaxed);
    let fell_back = generate(&gpu, &m, &[1, 5, 9], 6);
    assert_eq!(fell_back.0, cpu_only.0);
}

/// Three device operations in a row over their time budget send the rest of the process to the
/// CPU: every entry point and every later load refuse as contended.
#[test]
fn contention_guard_moves_the_rest_to_the_cpu() {
    let _g = lock();
    let m = tiny();
    let (gpu, faults) = faulty_gpu(1 << 30);
    let mut dev = gpu
        .load_llm(&m.model(), &LlmOptions::default(), None)
        .unwrap();
    let mut out = DecodeOutput::default();
    for pos in 0..6 {
        dev.decode(1, pos, &Sampler::Greedy, false, &mut out)
            .unwrap();
    }
    let slow = CONTENTION_FLOOR * 2;
    faults
        .delay_us
        .store(slow.as_micros() as u64, Ordering::Relaxed);
    for pos in 6..6 + CONTENTION_STRIKES as usize {
        assert!(!gpu.is_contended());
        dev.decode(1, pos, &Sampler::Greedy, false, &mut out)
            .unwrap();
    }
    assert!(gpu.is_contended());
    faults.delay_us.store(0, Ordering::Relaxed);
    let r = dev
        .decode(1, 9, &Sampler::Greedy, false, &mut out)
        .unwrap_err();
    assert_eq!(r.reason, RefusalReason::Contended);
    let r = gpu
        .load_llm(&m.model(), &LlmOptions::default(), None)
        .unwrap_err();
    assert_eq!(r.reason, RefusalReason::Contended);
    assert_eq!(
        gpu.check("llm.decode").unwrap_err().reason,
        RefusalReason::Contended
    );
}

/// A panic inside the backend is a refusal, not the end of the process; the device is not used
/// again and the caller's CPU path gives the same tokens.
#[test]
fn a_backend_panic_is_a_refusal_and_retires_the_device() {
    let _g = lock();
    let m = tiny();
    let (gpu, faults) = faulty_gpu(1 << 30);
    let cpu_only = generate(&Gpu::cpu_only(), &m, &[1, 5, 9], 6);
    faults.panic_next.store(true, Ordering::Relaxed);
    let fell_back = generate(&gpu, &m, &[1, 5, 9], 6);
    assert_eq!(fell_back.0, cpu_only.0);
    let r = gpu
        .load_llm(&m.model(), &LlmOptions::default(), None)
        .unwrap_err();
    assert!(matches!(r.reason, RefusalReason::Device(_)), "{r}");
}

/// The fake's batched step is the reference forward over the positions each block table holds:
/// staggered joins, prompt chunks beside decode rows, a shared prefix and shuffled blocks all
/// give each sequence what it would get alone, as logits and as device arg-max ids.
#[test]
fn fake_batched_step_matches_the_reference() {
    let m = SynthModel::new(
        qwen3_spec(64, 128, 2, 4, 2, 16, 97),
        Dtype::F32,
        SynthOptions::QWEN3,
        5,
    );
    let model = m.model();
    let b = FakeBackend::new(1 << 30);
    for greedy in [false, true] {
        let mut dev = b
            .load_llm(&model, &LlmOptions::default(), &Placement::all(2))
            .unwrap();
        let r = crate::llm::batch_check::staggered_run(dev.as_mut(), &model, greedy, 9).unwrap();
        assert_eq!(r.outputs, 16, "{r:?}");
        assert_eq!(r.argmax_mismatches, 0, "{r:?}");
        assert!(r.max_rel_err < 1e-6, "{r:?}");
    }
}

/// Batched steps are refused before the pool exists and when a table names a block outside it;
/// through the facade a refusal is an error like any other entry point's.
#[test]
fn batched_step_refusals_name_the_fault() {
    use crate::llm::batch::{BatchOut, BatchSeq};
    let _l = lock();
    let m = tiny();
    let gpu = fake_gpu(1 << 30);
    let mut llm = gpu
        .load_llm(&m.model(), &LlmOptions::default(), None)
        .unwrap();
    let v = m.model().spec.vocab;
    let mut logits = vec![0f32; v];
    let seq = |blocks: &'static [u32]| BatchSeq {
        tokens: &[1, 2, 3],
        start: 0,
        blocks,
        want: true,
    };
    let e = llm
        .batch_step(&[seq(&[0])], BatchOut::Logits(&mut logits))
        .unwrap_err();
    assert!(e.to_string().contains("kv_pool"), "{e}");
    let shape = llm.kv_pool(1 << 20, 16).unwrap();
    assert!(shape.blocks > 0);
    let far: &'static [u32] = Box::leak(vec![shape.blocks as u32].into_boxed_slice());
    let e = llm
        .batch_step(&[seq(far)], BatchOut::Logits(&mut logits))
        .unwrap_err();
    assert!(e.to_string().contains("outside the pool"), "{e}");
    let e = llm
        .batch_step(&[seq(&[0])], BatchOut::Logits(&mut logits[..1]))
        .unwrap_err();
    assert!(e.to_string().contains("output of 1 values"), "{e}");
    llm.batch_step(&[seq(&[0])], BatchOut::Logits(&mut logits))
        .unwrap();
    // Sampled outputs: one sampler per output, each within the device's limits; then the
    // fake's draw is the host sampler's from the step's logits.
    use crate::llm::batch::RowSampling;
    use crate::llm::sample::SampleSpec;
    let row = |spec: SampleSpec| RowSampling {
        spec,
        pos: 2,
        window: &[1, 2, 3],
    };
    let sampled = SampleSpec {
        temperature: 0.8,
        seed: 9,
        ..SampleSpec::default()
    };
    let mut ids = [0u32; 1];
    for (rows, why) in [
        (vec![], "0 samplers for 1 outputs"),
        (
            vec![row(SampleSpec {
                top_k: 65,
                ..sampled
            })],
            "top-k 65",
        ),
        (
            vec![row(SampleSpec {
                top_p: 0.0,
                ..sampled
            })],
            "top_p",
        ),
        (
            vec![row(SampleSpec {
                penalty_last_n: 2,
                ..sampled
            })],
            "penalty window of 3 ids",
        ),
    ] {
        let e = llm
            .batch_step(
                &[seq(&[0])],
                BatchOut::Sampled {
                    rows: &rows,
                    ids: &mut ids,
                },
            )
            .unwrap_err();
        assert!(e.to_string().contains(why), "{e}");
    }
    let rows = [row(sampled)];
    llm.batch_step(
        &[seq(&[0])],
        BatchOut::Sampled {
            rows: &rows,
            ids: &mut ids,
        },
    )
    .unwrap();
    assert_eq!(ids[0], rows[0].sample_host(&mut logits.clone()));
}
