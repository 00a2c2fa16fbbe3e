//! RMSNorm, LayerNorm, GroupNorm. Sums use 16 independent f32 partial sums (vectorized), which
//! keeps the relative error of a sum near 1e-7 at these row lengths; GroupNorm, whose groups can
//! hold millions of values, adds the per-chunk f32 sums in f64.

use crate::pool::SendPtr;
use crate::simd::{multiversion, Fma};

/// How the RMSNorm weight applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormStyle {
    /// x̂·w (Llama, Qwen, Mistral; `norm_style: "qwen"`).
    Plain,
    /// x̂·(1 + w) (Gemma; `norm_style: "gemma"`).
    OnePlus,
}

#[inline(always)]
fn sum_sq<F: Fma>(x: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let mut it = x.chunks_exact(16);
    for c in &mut it {
        for j in 0..16 {
            acc[j] = F::fma(c[j], c[j], acc[j]);
        }
    }
    let tail: f32 = it.remainder().iter().map(|v| v * v).sum();
    acc.iter().sum::<f32>() + tail
}

#[inline(always)]
fn sum(x: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let mut it = x.chunks_exact(16);
    for c in &mut it {
        for j in 0..16 {
            acc[j] += c[j];
        }
    }
    acc.iter().sum::<f32>() + it.remainder().iter().sum::<f32>()
}

#[inline(always)]
fn sum_sq_dev<F: Fma>(x: &[f32], mean: f32) -> f32 {
    let mut acc = [0f32; 16];
    let mut it = x.chunks_exact(16);
    for c in &mut it {
        for j in 0..16 {
            let v = c[j] - mean;
            acc[j] = F::fma(v, v, acc[j]);
        }
    }
    acc.iter().sum::<f32>()
        + it.remainder()
            .iter()
            .map(|v| (v - mean) * (v - mean))
            .sum::<f32>()
}

#[inline(always)]
fn rms_apply<F: Fma>(src: &[f32], dst: &mut [f32], w: Option<&[f32]>, eps: f32, style: NormStyle) {
    let d = src.len();
    let inv = 1.0 / (sum_sq::<F>(src) / d as f32 + eps).sqrt();
    match (w, style) {
        (None, _) => dst.iter_mut().zip(src).for_each(|(o, x)| *o = x * inv),
        (Some(w), NormStyle::Plain) => {
            dst.iter_mut()
                .zip(src)
                .zip(w)
                .for_each(|((o, x), g)| *o = x * inv * g);
        }
        (Some(w), NormStyle::OnePlus) => {
            dst.iter_mut()
                .zip(src)
                .zip(w)
                .for_each(|((o, x), g)| *o = x * inv * (1.0 + g));
        }
    }
}

fn check_rows(name: &str, len: usize, d: usize, w: Option<&[f32]>) {
    assert!(
        d > 0 && len.is_multiple_of(d),
        "{name}: {len} values are not rows of {d}"
    );
    if let Some(w) = w {
        assert_eq!(
            w.len(),
            d,
            "{name}: weight has {} values for rows of {d}",
            w.len()
        );
    }
}

#[inline(always)]
fn rms_norm_body<F: Fma>(
    x: &[f32],
    d: usize,
    w: Option<&[f32]>,
    eps: f32,
    style: NormStyle,
    out: &mut [f32],
) {
    check_rows("rms_norm", x.len(), d, w);
    assert_eq!(x.len(), out.len(), "rms_norm: output length differs");
    for (xr, or) in x.chunks(d).zip(out.chunks_mut(d)) {
        rms_apply::<F>(xr, or, w, eps, style);
    }
}
multiversion!(
    /// RMSNorm over rows of `d`: x / sqrt(mean(x²) + eps), times w (or 1 + w, or nothing).
    /// Matches transformers' `LlamaRMSNorm` / `Qwen3RMSNorm` (`Plain`) and `GemmaRMSNorm` (`OnePlus`).
    pub fn rms_norm / rms_norm_with = rms_norm_body;
    (x: &[f32], d: usize, w: Option<&[f32]>, eps: f32, style: NormStyle, out: &mut [f32]));

#[inline(always)]
fn rms_norm_inplace_body<F: Fma>(
    x: &mut [f32],
    d: usize,
    w: Option<&[f32]>,
    eps: f32,
    style: NormStyle,
) {
    check_rows("rms_norm_inplace", x.len(), d, w);
    let mut tmp = vec![0f32; d];
    for r in x.chunks_mut(d) {
        tmp.copy_from_slice(r);
        rms_apply::<F>(&tmp, r, w, eps, style);
    }
}
multiversion!(
    /// `rms_norm` in place (e.g. Qwen3's per-head q/k norm over rows of head_dim).
    pub fn rms_norm_inplace / rms_norm_inplace_with = rms_norm_inplace_body;
    (x: &mut [f32], d: usize, w: Option<&[f32]>, eps: f32, style: NormStyle));

#[inline(always)]
fn layer_norm_row<F: Fma>(
    src: &[f32],
    dst: &mut [f32],
    w: Option<&[f32]>,
    b: Option<&[f32]>,
    eps: f32,
) {
    let d = src.len() as f32;
    let mean = sum(src) / d;
    let inv = 1.0 / (sum_sq_dev::<F>(src, mean) / d + eps).sqrt();
    dst.iter_mut()
        .zip(src)
        .for_each(|(o, x)| *o = (x - mean) * inv);
    if let Some(w) = w {
        dst.iter_mut().zip(w).for_each(|(o, g)| *o *= g);
    }
    if let Some(b) = b {
        dst.iter_mut().zip(b).for_each(|(o, c)| *o += c);
    }
}

#[inline(always)]
fn layer_norm_body<F: Fma>(
    x: &[f32],
    d: usize,
    w: Option<&[f32]>,
    b: Option<&[f32]>,
    eps: f32,
    out: &mut [f32],
) {
    check_rows("layer_norm", x.len(), d, w);
    check_rows("layer_norm", x.len(), d, b);
    assert_eq!(x.len(), out.len(), "layer_norm: output length differs");
    for (xr, or) in x.chunks(d).zip(out.chunks_mut(d)) {
        layer_norm_row::<F>(xr, or, w, b, eps);
    }
}
multiversion!(
    /// LayerNorm over rows of `d` (two-pass mean and variance, biased variance like torch), with
    /// optional affine weight and bias.
    pub fn layer_norm / layer_norm_with = layer_norm_body;
    (x: &[f32], d: usize, w: Option<&[f32]>, b: Option<&[f32]>, eps: f32, out: &mut [f32]));

/// Mean and 1/sqrt(var + eps) of a (possibly huge) group, f32 chunk sums added in f64.
#[inline(always)]
fn group_stats<F: Fma>(xs: &[f32], eps: f32) -> (f32, f32) {
    let n = xs.len() as f64;
    let mean = (xs.chunks(4096).map(|c| sum(c) as f64).sum::<f64>() / n) as f32;
    let var = xs
        .chunks(4096)
        .map(|c| sum_sq_dev::<F>(c, mean) as f64)
        .sum::<f64>()
        / n;
    (mean, (1.0 / (var + eps as f64).sqrt()) as f32)
}

/// One group of GroupNorm: `x`/`out` hold its `w.len()` channels of `hw` values each.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn group_norm_group_body<F: Fma>(
    x: &[f32],
    hw: usize,
    w: &[f32],
    b: &[f32],
    eps: f32,
    silu: bool,
    out: &mut [f32],
) {
    let (mean, inv) = group_stats::<F>(x, eps);
    for c in 0..w.len() {
        let (a, s) = (inv * w[c], b[c] - mean * inv * w[c]);
        let (src, dst) = (&x[c * hw..(c + 1) * hw], &mut out[c * hw..(c + 1) * hw]);
        if silu {
            dst.iter_mut().zip(src).for_each(|(o, v)| {
                let t = F::fma(*v, a, s);
                *o = t * super::math::sigmoid(t)
            });
        } else {
            dst.iter_mut()
                .zip(src)
                .for_each(|(o, v)| *o = F::fma(*v, a, s));
        }
    }
}
multiversion!(fn group_norm_group / group_norm_group_with = group_norm_group_body;
    (x: &[f32], hw: usize, w: &[f32], b: &[f32], eps: f32, silu: bool, out: &mut [f32]));

/// GroupNorm of one NCHW sample `x[channels, hw]` (torch `GroupNorm`, per-channel affine),
/// optionally followed by SiLU (the Flux VAE always pairs them). Groups run on the pool.
#[allow(clippy::too_many_arguments)]
pub fn group_norm(
    x: &[f32],
    channels: usize,
    hw: usize,
    groups: usize,
    w: &[f32],
    b: &[f32],
    eps: f32,
    silu: bool,
    out: &mut [f32],
) {
    group_norm_with(
        crate::cpu::active(),
        x,
        channels,
        hw,
        groups,
        w,
        b,
        eps,
        silu,
        out,
    )
}

#[doc(hidden)]
#[allow(clippy::too_many_arguments)]
pub fn group_norm_with(
    isa: crate::cpu::Isa,
    x: &[f32],
    channels: usize,
    hw: usize,
    groups: usize,
    w: &[f32],
    b: &[f32],
    eps: f32,
    silu: bool,
    out: &mut [f32],
) {
    assert!(
        groups > 0 && channels.is_multiple_of(groups),
        "group_norm: {channels} channels in {groups} groups"
    );
    assert!(
        x.len() == channels * hw && out.len() == x.len(),
        "group_norm: x and out must hold channels·hw values"
    );
    assert!(
        w.len() == channels && b.len() == channels,
        "group_norm: weight and bias need one value per channel"
    );
    let cpg = channels / groups;
    let op = SendPtr(out.as_mut_ptr());
    crate::pool::for_each_task(groups, |g| {
        let (c0, c1) = (g * cpg, (g + 1) * cpg);
        // SAFETY: group g's channels belong to this task only.
        let o = unsafe { op.slice(c0 * hw, cpg * hw) };
        group_norm_group_with(
            isa,
            &x[c0 * hw..c1 * hw],
            hw,
            &w[c0..c1],
            &b[c0..c1],
            eps,
            silu,
            o,
        )
    });
}
