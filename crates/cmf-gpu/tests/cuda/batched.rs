//! The batched step against the CPU reference: the paged attention kernel alone (ragged rows,
//! shuffled blocks, GQA, a sliding window, f16 and f32 pools) and whole steps of staggered
//! sequences (prompt chunks beside decode rows, a shared prefix), as logits and arg-max ids.

use super::*;
use cmf_gpu::llm::batch::{paged_attention_reference, q8_gemm_reference};
use cmf_gpu::llm::batch_check::staggered_run;

fn load(b: &CudaBackend, model: &LlmModel, opts: &LlmOptions) -> CudaLlm {
    b.load_cuda_llm(model, opts, &Placement::all(model.spec.num_layers))
        .unwrap()
}

#[test]
fn paged_attention_matches_reference() {
    let Some(b) = backend() else { return };
    let dev = b.device().clone();
    eprintln!(
        "{:>4} {:>3} {:>4} {:>6} {:>10}",
        "hd", "gqa", "f32", "window", "rel err"
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
        )
        .unwrap();
        let e = rel_err(&got, &want);
        eprintln!("{d:>4} {:>3} {kv_f32:>4} {window:>6} {e:>10.2e}", nh / nkv);
        assert!(e < 1e-5, "hd {d} gqa {} f32 {kv_f32}: {e}", nh / nkv);
    }
}

#[test]
fn q8_gemm_matches_reference() {
    let Some(b) = backend() else { return };
    let dev = b.device().clone();
    eprintln!(
        "{:<7} {:>5} {:>5} {:>4} {:>10} {:>10}",
        "kernel", "n", "k", "t", "rel err", "vs f32"
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
    ] {
        for variant in cmf_gpu::cuda::llm::Q8Variant::ALL {
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
            let want = q8_gemm_reference(&w, &scales, k, &x);
            // Written into columns 5.. of wider rows, on top of a residual (accumulate).
            let (ldc, col0) = (n + 9, 5);
            let resid = rng.vec(t * ldc, 1.0);
            let mut got = resid.clone();
            cmf_gpu::cuda::llm::q8_gemm_probe(
                &dev,
                variant,
                (&w, &scales),
                k,
                &x,
                &mut got,
                (ldc, col0, true),
            )
            .unwrap();
            let mut sums = vec![0f32; t * n];
            for r in 0..t {
                for c in 0..ldc {
                    let g = got[r * ldc + c] - resid[r * ldc + c];
                    if c < col0 || c >= col0 + n {
                        assert_eq!(g, 0.0, "{variant:?}: column {c} outside the output changed");
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
            eprintln!(
                "{:<7} {n:>5} {k:>5} {t:>4} {e:>10.2e} {ef:>10.2e}",
                format!("{variant:?}")
            );
            assert!(e < 1e-5, "{variant:?} n {n} k {k} t {t}: {e}");
            assert!(ef < 2e-2, "{variant:?} n {n} k {k} t {t}: {ef} against f32");
        }
    }
}

#[test]
fn batched_step_matches_reference() {
    let Some(b) = backend() else { return };
    eprintln!(
        "{:<6} {:>3} {:>6} {:>10} {:>8} {:>7}",
        "codec", "hd", "greedy", "rel err", "argmax≠", "outputs"
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
        for greedy in [false, true] {
            let mut dev = load(&b, &model, &LlmOptions::default());
            let r = staggered_run(&mut dev, &model, greedy, 4).unwrap();
            eprintln!(
                "{:<6} {hd:>3} {greedy:>6} {:>10.2e} {:>8} {:>7}",
                format!("{dtype:?}"),
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
