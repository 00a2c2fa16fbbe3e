//! The batched step against the CPU reference: the paged attention kernel alone (ragged rows,
//! shuffled blocks, GQA, a sliding window, f16 and f32 pools) and whole steps of staggered
//! sequences (prompt chunks beside decode rows, a shared prefix), as logits and arg-max ids.

use super::*;
use cmf_gpu::llm::batch::{paged_attention_reference, q8_gemm_reference, w8_bf16_gemm_reference};
use cmf_gpu::llm::batch_check::staggered_run;

#[test]
fn paged_attention_matches_reference() {
    let Some(b) = backend() else { return };
    let dev = b.device().clone();
    eprintln!(
        "{:>4} {:>3} {:>4} {:>6} {:>10} {:>10}",
        "hd", "gqa", "f32", "window", "kernel", "rel err"
    );
    for &(nh, nkv, d, kv_f32, window) in &[
        (8, 2, 128, false, 0),
        (8, 2, 128, true, 0),
        (4, 4, 64, true, 7),
        (16, 2, 64, false, 0),
        (4, 2, 16, true, 0),
        (8, 1, 256, false, 40),
    ] {
        let bs = 16;
        let lens = [1usize, 37, 200, 16, 75];
        let total: usize = lens.iter().map(|n| n.div_ceil(bs)).sum::<usize>() + 3;
        let s_pool = total * bs;
        let mut rng = Rng::new(d as u64 + nh as u64);
        let round = |v: Vec<f32>| -> Vec<f32> {
            if kv_f32 {
                v
            } else {
                v.into_iter()
                    .map(|x| half::f16::from_f32(x).to_f32())
                    .collect()
            }
        };
        let kp = round(rng.vec(nkv * s_pool * d, 1.0));
        let vp = round(rng.vec(nkv * s_pool * d, 1.0));
        let mut perm: Vec<u32> = (0..total as u32).collect();
        for i in (1..perm.len()).rev() {
            perm.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
        }
        let mut tables: Vec<Vec<u32>> = Vec::new();
        let mut next = 0;
        for &n in &lens {
            tables.push(perm[next..next + n.div_ceil(bs)].to_vec());
            next += n.div_ceil(bs);
        }
        // Each sequence's last rows: up to 20 (a prompt chunk) or 1 (decode).
        let (mut row_pos, mut row_seq) = (Vec::new(), Vec::new());
        for (s, &n) in lens.iter().enumerate() {
            let rows = if s % 2 == 0 { 1 } else { 20.min(n) };
            for p in n - rows..n {
                row_pos.push(p);
                row_seq.push(s);
            }
        }
        let q = rng.vec(row_pos.len() * nh * d, 1.0);
        let tabs: Vec<&[u32]> = tables.iter().map(|t| t.as_slice()).collect();
        let scale = 1.0 / (d as f32).sqrt();
        let mut want = vec![0f32; q.len()];
        paged_attention_reference(
            &q,
            &kp,
            &vp,
            (nh, nkv, d),
            scale,
            window,
            &row_pos,
            &row_seq,
            &tabs,
            bs,
            &mut want,
        );
        // The rounds kernel; the split one with one run, a few, and more runs than some rows
        // have tiles (empty runs).
        use cmf_gpu::cuda::llm::PagedKernel;
        for kernel in [
            PagedKernel::Rounds,
            PagedKernel::Split(1),
            PagedKernel::Split(3),
            PagedKernel::Split(32),
        ] {
            let got = cmf_gpu::cuda::llm::paged_attention_probe(
                &dev,
                (nh, nkv, d),
                kv_f32,
                &q,
                &kp,
                &vp,
                scale,
                window,
                &row_pos,
                &row_seq,
                &tabs,
                bs,
                kernel,
            )
            .unwrap();
            let e = rel_err(&got, &want);
            eprintln!(
                "{d:>4} {:>3} {kv_f32:>4} {window:>6} {kernel:>10?} {e:>10.2e}",
                nh / nkv
            );
            assert!(
                e < 1e-5,
                "hd {d} gqa {} f32 {kv_f32} {kernel:?}: {e}",
                nh / nkv
            );
        }
    }
}

#[test]
fn q8_gemm_matches_reference() {
    let Some(b) = backend() else { return };
    let dev = b.device().clone();
    eprintln!(
        "{:>5} {:>5} {:>4} {:>5} {:>10} {:>10}",
        "n", "k", "t", "bf16", "rel err", "vs f32"
    );
    // Rows past a block's 16/32/64, chunks of 256/512 cut short, input tiles of 64 cut short.
    for &(n, k, t) in &[
        (100, 32, 1),
        (64, 544, 5),
        (257, 4096, 16),
        (48, 1056, 17),
        (130, 768, 48),
        (96, 2048, 64),
        (200, 352, 65),
        (33, 640, 130),
        (1024, 4096, 64),
        (300, 12288, 128),
    ] {
        // s8 inputs in blocks of 32, then bf16 inputs (K split over blocks on the last shapes).
        for bf16_inputs in [false, true] {
            let mut rng = Rng::new((n * k + t) as u64);
            let w: Vec<i8> = (0..n * k)
                .map(|_| ((rng.next_u64() % 255) as i32 - 127) as i8)
                .collect();
            let scales: Vec<half::f16> = (0..n)
                .map(|i| half::f16::from_f32(0.001 + 0.0001 * (i % 7) as f32))
                .collect();
            let mut x = rng.vec(t * k, 1.0);
            // An outlier channel: block-wise input scales keep its neighbours' precision.
            for r in 0..t {
                x[r * k + 3] = 40.0;
            }
            let want = if bf16_inputs {
                w8_bf16_gemm_reference(&w, &scales, k, &x)
            } else {
                q8_gemm_reference(&w, &scales, k, &x)
            };
            // Written into columns 5.. of wider rows, on top of a residual (accumulate).
            let (ldc, col0) = (n + 9, 5);
            let resid = rng.vec(t * ldc, 1.0);
            let mut got = resid.clone();
            cmf_gpu::cuda::llm::q8_gemm_probe(
                &dev,
                (&w, &scales),
                k,
                &x,
                &mut got,
                (ldc, col0, true),
                bf16_inputs,
            )
            .unwrap();
            let mut sums = vec![0f32; t * n];
            for r in 0..t {
                for c in 0..ldc {
                    let g = got[r * ldc + c] - resid[r * ldc + c];
                    if c < col0 || c >= col0 + n {
                        assert_eq!(g, 0.0, "column {c} outside the output changed");
                    } else {
                        sums[r * n + c - col0] = g;
                    }
                }
            }
            let e = rel_err(&sums, &want);
            // The unquantised product, for scale: block-wise s8 inputs stay within a few 1e-3.
            let mut exact = vec![0f32; t * n];
            for r in 0..t {
                for c in 0..n {
                    exact[r * n + c] = (0..k)
                        .map(|i| x[r * k + i] * w[c * k + i] as f32)
                        .sum::<f32>()
                        * scales[c].to_f32();
                }
            }
            let ef = rel_err(&sums, &exact);
            eprintln!("{n:>5} {k:>5} {t:>4} {bf16_inputs:>5} {e:>10.2e} {ef:>10.2e}");
            assert!(e < 1e-5, "n {n} k {k} t {t}: {e}");
            assert!(ef < 2e-2, "n {n} k {k} t {t}: {ef} against f32");
        }
    }
}

#[test]
fn batched_step_matches_reference() {
    let Some(b) = backend() else { return };
    eprintln!(
        "{:<6} {:>3} {:>8} {:>6} {:>10} {:>8} {:>7}",
        "codec", "hd", "kernels", "greedy", "rel err", "argmax≠", "outputs"
    );
    for &(dtype, hd, bias, tol) in &[
        (Dtype::F32, 64, false, 1e-4),
        (Dtype::F32, 128, true, 1e-4),
        (Dtype::F32, 16, false, 1e-4),
        (Dtype::Bf16, 128, false, 6e-2),
        (Dtype::Q8Row, 128, false, 6e-2),
    ] {
        let mut spec = qwen3_spec(256, 512, 3, 8, 2, hd, 300);
        spec.sliding_window[1] = Some(24);
        let opts = if bias {
            SynthOptions {
                qkv_bias: true,
                ..SynthOptions::QWEN3
            }
        } else {
            SynthOptions::QWEN3
        };
        let m = SynthModel::new(spec, dtype, opts, 21);
        let model = m.model();
        let kernels = [BatchKernels::Verified, BatchKernels::Next];
        for (greedy, kernels) in [false, true]
            .into_iter()
            .flat_map(|g| kernels.map(|k| (g, k)))
        {
            let opts = LlmOptions {
                batch_kernels: kernels,
                ..LlmOptions::default()
            };
            let mut dev = load(&b, &model, &opts);
            let r = staggered_run(&mut dev, &model, greedy, 4).unwrap();
            eprintln!(
                "{:<6} {hd:>3} {:>8} {greedy:>6} {:>10.2e} {:>8} {:>7}",
                format!("{dtype:?}"),
                format!("{kernels:?}"),
                r.max_rel_err,
                r.argmax_mismatches,
                r.outputs
            );
            assert_eq!(r.outputs, 16);
            assert!(r.max_rel_err < tol, "{dtype:?} hd {hd}: {r:?}");
            if !dtype.is_quantized() && dtype != Dtype::Bf16 {
                assert_eq!(r.argmax_mismatches, 0, "{dtype:?} hd {hd}: {r:?}");
            }
        }
    }
}

/// The batched rows' sampler (`CudaLlm::sample_rows`, sample.cu's `*_rows` kernels) over 8 rows
/// of random logits, each row with its own spec (greedy, top-k merge, top-p radix, min-p,
/// penalties over its own window, seeds, positions), on a 32,003 and a 151,936 vocabulary:
/// every row's id is the host sampler's (`llm::sample::sample`) for the same draw, and each row
/// without penalties draws exactly what the single-sequence device sampler (`sample_logits`,
/// the same device functions) draws from that row alone. As there, the device's `expf` may
/// round a weight on a cut or draw boundary differently from the host: at most 1 % of the
/// host comparisons may differ.
#[test]
fn batched_sampler_matches_the_host_and_the_single_sequence_sampler() {
    use cmf_gpu::llm::batch::RowSampling;
    use cmf_gpu::llm::sample::SampleSpec;
    let Some(b) = backend() else { return };
    let spec = |temperature: f32, top_k: usize, top_p: f32, min_p: f32| SampleSpec {
        temperature,
        top_k,
        top_p,
        min_p,
        ..SampleSpec::default()
    };
    let penalised = |s: SampleSpec, n: usize| SampleSpec {
        repeat_penalty: 1.4,
        presence_penalty: 0.3,
        frequency_penalty: 0.2,
        penalty_last_n: n,
        ..s
    };
    let specs = [
        spec(0.7, 0, 0.9, 0.0),
        spec(1.0, 40, 0.8, 0.01),
        spec(0.0, 0, 1.0, 0.0),
        spec(1.5, 0, 1.0, 0.05),
        penalised(spec(0.9, 0, 0.95, 0.0), 64),
        penalised(spec(1.2, 64, 1.0, 0.0), 300),
        penalised(spec(0.0, 0, 1.0, 0.0), 16),
        spec(4.0, 0, 0.3, 0.0),
    ];
    let (mut runs, mut differ, mut alone_runs) = (0usize, Vec::new(), 0usize);
    for (v, seed) in [(32_003usize, 11u64), (151_936, 12)] {
        let m = sampler_model(v, seed);
        let mut dev = load(&b, &m.model(), &context(512));
        let mut rng = Rng::new(seed);
        let mut seen = std::collections::HashSet::new();
        for round in 0..6u64 {
            // Peaked rows (a model's shape) and flat ones (top-p's cut far past the 64 best).
            let logits: Vec<f32> = (0..specs.len())
                .flat_map(|r| {
                    let scale = if r % 2 == 0 { 4.0 } else { 0.05 };
                    (0..v).map(|_| scale * rng.uniform()).collect::<Vec<_>>()
                })
                .collect();
            // Windows of recent ids with repeats, among the row's best tokens now and then.
            let windows: Vec<Vec<u32>> = specs
                .iter()
                .map(|s| {
                    (0..s.penalty_last_n.min(300))
                        .map(|_| (rng.next_u64() % 97) as u32 * (v as u32 / 97))
                        .collect()
                })
                .collect();
            let rows: Vec<RowSampling> = specs
                .iter()
                .zip(&windows)
                .enumerate()
                .map(|(r, (s, w))| RowSampling {
                    spec: SampleSpec {
                        seed: seed * 1000 + round * 10 + r as u64,
                        ..*s
                    },
                    pos: 17 * round + 3 * r as u64,
                    window: w,
                })
                .collect();
            let got = dev.sample_rows(&logits, &rows).unwrap();
            for (r, row) in rows.iter().enumerate() {
                let l = &logits[r * v..(r + 1) * v];
                let want = row.sample_host(&mut l.to_vec());
                runs += 1;
                seen.insert(got[r]);
                if got[r] != want {
                    differ.push((v, r, round, got[r], want));
                }
                if !row.spec.has_penalties() {
                    let single = dev
                        .sample_logits(l, 0, row.pos as usize, &row.spec)
                        .unwrap();
                    assert_eq!(
                        got[r], single,
                        "v {v} row {r} round {round}: batched and single-sequence device draws"
                    );
                    alone_runs += 1;
                }
            }
            // The penalties edit the call's own copy of the logits: a second call draws the same.
            assert_eq!(dev.sample_rows(&logits, &rows).unwrap(), got);
        }
        assert!(seen.len() > 20, "v {v}: draws are not spread: {seen:?}");
    }
    eprintln!(
        "batched sampler: {} of {runs} draws differ from the host's ({alone_runs} equal to the \
         single-sequence device sampler): {differ:?}",
        differ.len()
    );
    assert!(differ.len() * 100 <= runs.max(100), "{differ:?}");
}
