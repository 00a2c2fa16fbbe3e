//! The DiT's attention kernels (every variant, and the FP8 one on its quantised inputs) against
//! an f64 reference.

use super::*;

/// f64 reference of the DiT's non-causal attention on f16-rounded inputs: q `[t, nh, hd]`,
/// k/v `[nh, t, hd]`; out `[t, nh · hd]`.
fn full_attention_reference(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    t: usize,
    nh: usize,
    hd: usize,
) -> Vec<f32> {
    let r16 = |x: f32| half::f16::from_f32(x).to_f64();
    let scale = 1.0 / (hd as f64).sqrt();
    let mut out = vec![0f32; t * nh * hd];
    let mut s = vec![0f64; t];
    for h in 0..nh {
        for i in 0..t {
            let qi = &q[(i * nh + h) * hd..][..hd];
            let mut mx = f64::NEG_INFINITY;
            for (j, sj) in s.iter_mut().enumerate() {
                let kj = &k[(h * t + j) * hd..][..hd];
                *sj = qi
                    .iter()
                    .zip(kj)
                    .map(|(&a, &b)| r16(a) * r16(b))
                    .sum::<f64>()
                    * scale;
                mx = mx.max(*sj);
            }
            let mut den = 0.0;
            for sj in s.iter_mut() {
                *sj = (*sj - mx).exp();
                den += *sj;
            }
            for d in 0..hd {
                let acc: f64 = (0..t).map(|j| s[j] * r16(v[(h * t + j) * hd + d])).sum();
                out[(i * nh + h) * hd + d] = (acc / den) as f32;
            }
        }
    }
    out
}

/// Random DiT attention inputs of `n` values each: q scaled by `spread` (how peaked the scores
/// get), k and v as the attention tests use them.
fn random_qkv(seed: u64, n: usize, spread: f32) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut rng = Rng::new(seed);
    let q = rng.vec(n, spread * 1.7);
    let k = rng.vec(n, 1.7);
    let v = rng.vec(n, 1.0);
    (q, k, v)
}

/// Both DiT attention kernels (`ws` on Hopper, `base` everywhere) against the f64 reference, on lengths
/// that leave partial query and key tiles, with flat and peaked score distributions; `+split`:
/// half of the tiles run as two halves of their keys, merged (the tail split; lengths of one key
/// tile split none).
/// Tolerance 1e-2: the kernels round q and the probabilities to f16 and write bf16 (2⁻⁹).
#[test]
fn dit_attention_variants_match_reference() {
    let Some(b) = backend() else { return };
    let (nh, hd) = (3usize, 128usize);
    // 176 and 352: whole key tiles of `ws` (no tail); 177: a one-key tail; 1100: 7 tiles,
    // each slot's barriers reused over several phases.
    for (t, spread) in [
        (77usize, 1.0f32),
        (176, 2.0),
        (177, 1.0),
        (300, 3.0),
        (352, 1.0),
        (1100, 1.0),
        (1100, 4.0),
    ] {
        let (q, k, v) = random_qkv(t as u64 * 31 + spread as u64, t * nh * hd, spread);
        let want = full_attention_reference(&q, &k, &v, t, nh, hd);
        for variant in ["base", "ws", "ws+split"] {
            let got =
                cmf_gpu::cuda::dit::attention_for_test(b.device(), variant, &q, &k, &v, t, nh)
                    .unwrap_or_else(|e| panic!("{variant}: {e:?}"));
            let err = rel_err(&got, &want);
            eprintln!("dit attention {variant:>5} t {t:>4} spread {spread}: rel err {err:.2e}");
            assert!(err < 1e-2, "{variant} t {t}: rel err {err}");
        }
    }
}

/// e4m3 rounding as the device's `cvt.rn.satfinite.e4m3x2.f32` does it: 3 mantissa bits,
/// nearest-even, subnormal steps of 2⁻⁹ below 2⁻⁶, saturating at ±448.
fn e4m3(x: f32) -> f32 {
    let a = x.abs();
    let e = if a < 2f32.powi(-6) {
        -6
    } else {
        a.log2().floor() as i32
    };
    let step = 2f32.powi(e - 3);
    ((a / step).round_ties_even() * step).min(448.0).copysign(x)
}

/// `x` (chunks of `n` values share a scale: their amax / 448) quantised to e4m3 and back.
fn e4m3_scaled(x: &[f32], n: usize) -> Vec<f32> {
    x.chunks(n)
        .flat_map(|c| {
            let amax = c.iter().fold(0f32, |m, v| m.max(v.abs()));
            let s = if amax > 0.0 { amax / 448.0 } else { 1.0 };
            let inv = 1.0 / s;
            c.iter()
                .map(move |&v| e4m3(v * inv) * s)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The FP8 DiT attention (`ws8`, attn_full_ws8) against the f64 reference on the values it
/// quantised: Q per row and head, K over all heads, V per head (of their f16 values), all rounded
/// to e4m3 here as the device rounds them. What is left is the probabilities' own e4m3 rounding
/// (3 mantissa bits, ~2.5 % RMS per probability, averaged by the sum over keys) and the bf16
/// output: bound 3e-2. `ws8q` writes e4m3 rows with one scale (the largest V maximum / 448),
/// read back with the scales it wrote: its own rounding adds ~3.6 % RMS (uniform in ±2⁻⁴),
/// bound 6e-2 (`+split`: half of the tiles as two merged halves of their keys, the same bounds).
/// A layout mistake (the Vᵀ key order, a scale, a row's scale) gives errors of
/// order one. Against the unquantised inputs the error is printed, not bounded (it grows with how
/// peaked the scores are; the image criterion of the FP8 path is PSNR against bf16, gpu_dit.rs).
#[test]
fn dit_fp8_attention_matches_reference_on_its_quantised_inputs() {
    let Some(b) = backend() else { return };
    if b.device().arch_specific().is_none() {
        gpu_skip::skip_unsupported("attn_full_ws8 needs sm_90a");
        return;
    }
    let (nh, hd) = (3usize, 128usize);
    for (t, spread) in [
        (77usize, 1.0f32),
        (128, 2.0),
        (300, 1.0),
        (1100, 1.0),
        (1100, 3.0),
    ] {
        let (q, k, v) = random_qkv(t as u64 * 37 + spread as u64, t * nh * hd, spread);
        let r16 = |x: &[f32]| -> Vec<f32> {
            x.iter().map(|&a| half::f16::from_f32(a).to_f32()).collect()
        };
        let (qq, kq, vq) = (
            e4m3_scaled(&q, hd),
            e4m3_scaled(&r16(&k), t * hd * nh),
            e4m3_scaled(&r16(&v), t * hd),
        );
        let want_q = full_attention_reference(&qq, &kq, &vq, t, nh, hd);
        let want = full_attention_reference(&q, &k, &v, t, nh, hd);
        for (variant, bound) in [
            ("ws8", 3e-2),
            ("ws8q", 6e-2),
            ("ws8+split", 3e-2),
            ("ws8q+split", 6e-2),
        ] {
            let got =
                cmf_gpu::cuda::dit::attention_for_test(b.device(), variant, &q, &k, &v, t, nh)
                    .unwrap_or_else(|e| panic!("{variant}: {e:?}"));
            let (eq, e) = (rel_err(&got, &want_q), rel_err(&got, &want));
            eprintln!(
                "dit attention {variant} t {t:>4} spread {spread}: rel err {eq:.2e} (quantised inputs), {e:.2e} (exact inputs)"
            );
            assert!(eq < bound, "{variant} t {t} spread {spread}: rel err {eq}");
        }
    }
}
