//! Softmax and the gated/ungated activations, vectorizable (`math::exp`, not libm).

use super::math;
use crate::pool::SendPtr;
use crate::simd::{multiversion, Fma};

const PAR: usize = 1 << 15;

/// Softmax of one row in place: max, exp(x − max), normalize. A row of all −∞ gives NaN (0/0),
/// as torch does; callers mask so that every row keeps at least one finite entry.
#[inline(always)]
pub(crate) fn softmax_row(r: &mut [f32]) {
    let m = r.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
    let mut s = 0f32;
    for v in r.iter_mut() {
        *v = math::exp(*v - m);
        s += *v;
    }
    let inv = 1.0 / s;
    r.iter_mut().for_each(|v| *v *= inv);
}

#[inline(always)]
fn softmax_body<F: Fma>(x: &mut [f32], d: usize) {
    assert!(
        d > 0 && x.len().is_multiple_of(d),
        "softmax: {} is not a multiple of the row length {d}",
        x.len()
    );
    x.chunks_mut(d).for_each(softmax_row);
}
multiversion!(
    /// Softmax over rows of `d`, in place.
    pub fn softmax / softmax_with = softmax_body; (x: &mut [f32], d: usize));

#[inline(always)]
fn map_par(x: &mut [f32], f: impl Fn(f32) -> f32 + Sync + Send + Copy) {
    let xp = SendPtr(x.as_mut_ptr());
    super::par_ranges(x.len(), PAR, |s, e| {
        // SAFETY: each range is owned by one task.
        let x = unsafe { xp.slice(s, e - s) };
        x.iter_mut().for_each(|v| *v = f(*v));
    });
}

#[inline(always)]
fn silu_body<F: Fma>(x: &mut [f32]) {
    map_par(x, |v| v * math::sigmoid(v));
}
multiversion!(
    /// x·sigmoid(x), in place.
    pub fn silu / silu_with = silu_body; (x: &mut [f32]));

#[inline(always)]
fn swiglu_body<F: Fma>(a: &[f32], b: &[f32], out: &mut [f32]) {
    assert!(
        a.len() == b.len() && a.len() == out.len(),
        "swiglu: lengths differ"
    );
    let op = SendPtr(out.as_mut_ptr());
    super::par_ranges(a.len(), PAR, |s, e| {
        // SAFETY: each range is owned by one task.
        let out = unsafe { op.slice(s, e - s) };
        for ((o, &g), &u) in out.iter_mut().zip(&a[s..e]).zip(&b[s..e]) {
            *o = g * math::sigmoid(g) * u;
        }
    });
}
multiversion!(
    /// out = silu(a)·b (the SwiGLU gate: a = gate projection, b = up projection).
    pub fn swiglu / swiglu_with = swiglu_body; (a: &[f32], b: &[f32], out: &mut [f32]));

#[inline(always)]
fn swiglu_inplace_body<F: Fma>(a: &mut [f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "swiglu_inplace: lengths differ");
    let ap = SendPtr(a.as_mut_ptr());
    super::par_ranges(a.len(), PAR, |s, e| {
        // SAFETY: each range is owned by one task.
        let a = unsafe { ap.slice(s, e - s) };
        for (g, &u) in a.iter_mut().zip(&b[s..e]) {
            *g = *g * math::sigmoid(*g) * u;
        }
    });
}
multiversion!(
    /// a = silu(a)·b, in place.
    pub fn swiglu_inplace / swiglu_inplace_with = swiglu_inplace_body; (a: &mut [f32], b: &[f32]));

/// GELU (erf form), accurate to ~3e-7 relative over the whole range (see `math::erfc_pos`).
#[inline(always)]
pub(crate) fn gelu_erf_scalar(x: f32) -> f32 {
    let z = x.abs() * std::f32::consts::FRAC_1_SQRT_2;
    let e = math::erfc_pos(z);
    // x ≥ 0: x·(1 − erfc/2); x < 0: x·erfc/2 (no cancellation either way).
    if x >= 0.0 {
        x * (1.0 - 0.5 * e)
    } else {
        0.5 * x * e
    }
}

#[inline(always)]
fn gelu_erf_body<F: Fma>(x: &mut [f32]) {
    map_par(x, gelu_erf_scalar);
}
multiversion!(
    /// GELU, exact form x·Φ(x) (PyTorch `gelu(approximate="none")`), in place.
    pub fn gelu_erf / gelu_erf_with = gelu_erf_body; (x: &mut [f32]));

#[inline(always)]
fn gelu_tanh_body<F: Fma>(x: &mut [f32]) {
    // 0.5·x·(1 + tanh(u)) = x·sigmoid(2u), which has no cancellation for negative x.
    const K: f32 = 0.797_884_6; // √(2/π)
    map_par(x, |v| {
        v * math::sigmoid(2.0 * K * (v + 0.044715 * v * v * v))
    });
}
multiversion!(
    /// GELU, tanh approximation (PyTorch `gelu(approximate="tanh")`), in place.
    pub fn gelu_tanh / gelu_tanh_with = gelu_tanh_body; (x: &mut [f32]));
