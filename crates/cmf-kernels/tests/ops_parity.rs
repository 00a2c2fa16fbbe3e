//! Row ops on every ISA path against the f64 references in `cmf_kernels::reference`.
//! Tolerance: |got − want| ≤ rel·|want| + abs·scale, with rel a few f32 ulps (2e-6 to 4e-6: the
//! ops do O(1) roundings per output plus an f32 sum whose relative error is ~1e-7 at these
//! lengths) and `scale` the output's RMS (so near-zero outputs are judged against their row).

mod common;

use cmf_kernels::{ops, reference, Isa, NormStyle, RopeStyle, RopeTable};
use common::Rng;

fn close(label: &str, got: &[f32], want: &[f32], rel: f32, abs: f32) {
    assert_eq!(got.len(), want.len());
    let rms = (want.iter().map(|v| v * v).sum::<f32>() / want.len().max(1) as f32).sqrt();
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let tol = rel * w.abs() + abs * rms + 1e-30;
        assert!(
            (g - w).abs() <= tol,
            "{label}: [{i}] got {g}, want {w} (tol {tol})"
        );
    }
}

#[test]
fn norms() {
    let mut rng = Rng(10);
    for isa in Isa::all_supported() {
        for d in [1usize, 7, 64, 128, 1000] {
            let x: Vec<f32> = (0..3 * d)
                .map(|i| rng.f32() * 3.0 + if i % 5 == 0 { 2.0 } else { 0.0 })
                .collect();
            let w = rng.vec(d, 1.5);
            let b = rng.vec(d, 0.5);
            for (style, one_plus) in [(NormStyle::Plain, false), (NormStyle::OnePlus, true)] {
                let mut want = vec![0f32; 3 * d];
                reference::rms_norm(&x, &w, 1e-6, one_plus, &mut want);
                let mut got = vec![0f32; 3 * d];
                ops::rms_norm_with(isa, &x, d, Some(&w), 1e-6, style, &mut got);
                close(
                    &format!("rms_norm {isa} {style:?} d={d}"),
                    &got,
                    &want,
                    4e-6,
                    1e-7,
                );
                let mut inplace = x.clone();
                ops::rms_norm_inplace_with(isa, &mut inplace, d, Some(&w), 1e-6, style);
                assert_eq!(inplace, got, "rms_norm_inplace {isa} equals rms_norm");
            }
            let mut want = vec![0f32; 3 * d];
            reference::layer_norm(&x, d, Some(&w), Some(&b), 1e-5, &mut want);
            let mut got = vec![0f32; 3 * d];
            ops::layer_norm_with(isa, &x, d, Some(&w), Some(&b), 1e-5, &mut got);
            close(&format!("layer_norm {isa} d={d}"), &got, &want, 4e-6, 1e-6);
            reference::layer_norm(&x, d, None, None, 1e-6, &mut want);
            ops::layer_norm_with(isa, &x, d, None, None, 1e-6, &mut got);
            close(
                &format!("layer_norm (no affine) {isa} d={d}"),
                &got,
                &want,
                4e-6,
                1e-6,
            );
        }
    }
}

#[test]
fn group_norm_with_and_without_silu() {
    let mut rng = Rng(11);
    for isa in Isa::all_supported() {
        for (c, hw, g) in [
            (4usize, 1usize, 2usize),
            (32, 49, 32),
            (64, 300, 32),
            (12, 17, 3),
        ] {
            let x: Vec<f32> = (0..c * hw)
                .map(|i| rng.f32() * 2.0 + (i / hw) as f32 * 0.1)
                .collect();
            let w = rng.vec(c, 1.0);
            let b = rng.vec(c, 0.3);
            let mut want = vec![0f32; c * hw];
            reference::group_norm(&x, c, hw, g, &w, &b, 1e-6, &mut want);
            let mut got = vec![0f32; c * hw];
            ops::group_norm_with(isa, &x, c, hw, g, &w, &b, 1e-6, false, &mut got);
            // x·(γ·rstd) + (β − mean·γ·rstd), the fused form torch uses too, rounds at the scale of
            // |x|·γ·rstd: here channel means reach ~10× the group's spread, hence abs 4e-6.
            close(
                &format!("group_norm {isa} c={c} hw={hw}"),
                &got,
                &want,
                4e-6,
                4e-6,
            );
            let want_silu: Vec<f32> = want.iter().map(|v| reference::silu(*v)).collect();
            ops::group_norm_with(isa, &x, c, hw, g, &w, &b, 1e-6, true, &mut got);
            close(
                &format!("group_norm+silu {isa} c={c} hw={hw}"),
                &got,
                &want_silu,
                6e-6,
                4e-6,
            );
        }
    }
}

#[test]
fn softmax_and_activations() {
    let mut rng = Rng(12);
    let x: Vec<f32> = (0..999)
        .map(|i| rng.f32() * if i % 7 == 0 { 40.0 } else { 6.0 })
        .collect();
    for isa in Isa::all_supported() {
        for d in [1usize, 3, 333] {
            let mut want = vec![0f32; 999];
            reference::softmax(&x, d, &mut want);
            let mut got = x.clone();
            ops::softmax_with(isa, &mut got, d);
            close(&format!("softmax {isa} d={d}"), &got, &want, 2e-6, 1e-9);
        }
        let mut got = x.clone();
        ops::silu_with(isa, &mut got);
        close(
            &format!("silu {isa}"),
            &got,
            &x.iter().map(|v| reference::silu(*v)).collect::<Vec<_>>(),
            2e-6,
            0.0,
        );
        let mut got = x.clone();
        ops::gelu_erf_with(isa, &mut got);
        close(
            &format!("gelu_erf {isa}"),
            &got,
            &x.iter()
                .map(|v| reference::gelu_erf(*v))
                .collect::<Vec<_>>(),
            2e-6,
            1e-7,
        );
        let mut got = x.clone();
        ops::gelu_tanh_with(isa, &mut got);
        close(
            &format!("gelu_tanh {isa}"),
            &got,
            &x.iter()
                .map(|v| reference::gelu_tanh(*v))
                .collect::<Vec<_>>(),
            2e-6,
            1e-9,
        );
        let up = rng.vec(999, 2.0);
        let want: Vec<f32> = x
            .iter()
            .zip(&up)
            .map(|(a, b)| reference::silu(*a) * b)
            .collect();
        let mut got = vec![0f32; 999];
        ops::swiglu_with(isa, &x, &up, &mut got);
        close(&format!("swiglu {isa}"), &got, &want, 3e-6, 0.0);
        let mut inplace = x.clone();
        ops::swiglu_inplace_with(isa, &mut inplace, &up);
        assert_eq!(inplace, got);
    }
}

#[test]
fn elementwise() {
    let mut rng = Rng(13);
    let a = rng.vec(300_000, 1.0);
    let b = rng.vec(300_000, 1.0);
    for isa in Isa::all_supported() {
        let mut x = a.clone();
        ops::add_with(isa, &mut x, &b);
        assert!(x
            .iter()
            .zip(a.iter().zip(&b))
            .all(|(v, (p, q))| *v == p + q));
        let mut x = a.clone();
        ops::add_scaled_with(isa, &mut x, &b, 0.5);
        assert!(x
            .iter()
            .zip(a.iter().zip(&b))
            .all(|(v, (p, q))| (*v - (p + 0.5 * q)).abs() <= 1e-7));
        let mut x = a.clone();
        ops::mul_with(isa, &mut x, &b);
        assert!(x
            .iter()
            .zip(a.iter().zip(&b))
            .all(|(v, (p, q))| *v == p * q));
        let mut x = a.clone();
        ops::scale_with(isa, &mut x, 3.0);
        assert!(x.iter().zip(&a).all(|(v, p)| *v == p * 3.0));
        let mut x = a[..12].to_vec();
        ops::add_rows_with(isa, &mut x, &b[..4]);
        assert!(x.iter().enumerate().all(|(i, v)| *v == a[i] + b[i % 4]));
    }
}

#[test]
fn rope_both_styles_with_partial_rotary() {
    let mut rng = Rng(14);
    let (heads, head_dim, tokens) = (3usize, 16usize, 5usize);
    for (rot, style) in [
        (16usize, RopeStyle::RotateHalf),
        (8, RopeStyle::RotateHalf),
        (16, RopeStyle::Interleaved),
        (12, RopeStyle::Interleaved),
    ] {
        let half = rot / 2;
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| 10000f32.powf(-((2 * i) as f32) / rot as f32))
            .collect();
        let positions: Vec<f32> = (0..tokens + 3).map(|p| (p * 37) as f32).collect();
        let table = RopeTable::new(&positions, &inv_freq, 1.0);
        let x = rng.vec(tokens * heads * head_dim, 2.0);
        for isa in Isa::all_supported() {
            let mut got = x.clone();
            ops::rope_with(isa, &mut got, tokens, head_dim, style, &table, 3);
            let mut want = x.clone();
            for t in 0..tokens {
                let angles: Vec<f64> = inv_freq
                    .iter()
                    .map(|f| (positions[3 + t] * f) as f64)
                    .collect();
                reference::rope(
                    &mut want[t * heads * head_dim..(t + 1) * heads * head_dim],
                    head_dim,
                    &angles,
                    style == RopeStyle::Interleaved,
                );
            }
            close(
                &format!("rope {isa} {style:?} rot={rot}"),
                &got,
                &want,
                2e-6,
                1e-6,
            );
            // Dims past the rotated ones are untouched.
            for t in 0..tokens * heads {
                assert_eq!(
                    got[t * head_dim + rot..(t + 1) * head_dim],
                    x[t * head_dim + rot..(t + 1) * head_dim]
                );
            }
        }
    }
}
