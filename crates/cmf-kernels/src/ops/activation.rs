//! Softmax and the gated/ungated activations, vectorizable (`math::exp`, not libm).

use super::math;
use crate::cpu::Isa;
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

// Element-wise activations: a multiversioned kernel per chunk, split over the pool outside it
// (a closure that runs on another thread is compiled on its own, without the caller's target
// features, so the split must wrap the multiversioned call, not sit inside it).

#[inline(always)]
fn silu_chunk_body<F: Fma>(x: &mut [f32]) {
    x.iter_mut().for_each(|v| *v *= math::sigmoid(*v));
}
multiversion!(fn silu_chunk / silu_chunk_with = silu_chunk_body; (x: &mut [f32]));

/// x·sigmoid(x), in place.
pub fn silu(x: &mut [f32]) {
    silu_with(crate::cpu::active(), x)
}

#[doc(hidden)]
pub fn silu_with(isa: Isa, x: &mut [f32]) {
    super::par_chunks(x, PAR, |c| silu_chunk_with(isa, c));
}

#[inline(always)]
fn swiglu_chunk_body<F: Fma>(a: &[f32], b: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(a).zip(b) {
        *o = g * math::sigmoid(g) * u;
    }
}
multiversion!(fn swiglu_chunk / swiglu_chunk_with = swiglu_chunk_body; (a: &[f32], b: &[f32], out: &mut [f32]));

/// out = silu(a)·b (the SwiGLU gate: a = gate projection, b = up projection).
pub fn swiglu(a: &[f32], b: &[f32], out: &mut [f32]) {
    swiglu_with(crate::cpu::active(), a, b, out)
}

#[doc(hidden)]
pub fn swiglu_with(isa: Isa, a: &[f32], b: &[f32], out: &mut [f32]) {
    assert!(
        a.len() == b.len() && a.len() == out.len(),
        "swiglu: lengths differ"
    );
    let op = SendPtr(out.as_mut_ptr());
    super::par_ranges(a.len(), PAR, |s, e| {
        // SAFETY: each range is owned by one task.
        let out = unsafe { op.slice(s, e - s) };
        swiglu_chunk_with(isa, &a[s..e], &b[s..e], out)
    });
}

#[inline(always)]
fn swiglu_inplace_chunk_body<F: Fma>(a: &mut [f32], b: &[f32]) {
    for (g, &u) in a.iter_mut().zip(b) {
        *g = *g * math::sigmoid(*g) * u;
    }
}
multiversion!(fn swiglu_inplace_chunk / swiglu_inplace_chunk_with = swiglu_inplace_chunk_body; (a: &mut [f32], b: &[f32]));

/// a = silu(a)·b, in place.
pub fn swiglu_inplace(a: &mut [f32], b: &[f32]) {
    swiglu_inplace_with(crate::cpu::active(), a, b)
}

#[doc(hidden)]
pub fn swiglu_inplace_with(isa: Isa, a: &mut [f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "swiglu_inplace: lengths differ");
    let ap = SendPtr(a.as_mut_ptr());
    super::par_ranges(a.len(), PAR, |s, e| {
        // SAFETY: each range is owned by one task.
        let a = unsafe { ap.slice(s, e - s) };
        swiglu_inplace_chunk_with(isa, a, &b[s..e])
    });
}

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
fn gelu_erf_chunk_body<F: Fma>(x: &mut [f32]) {
    x.iter_mut().for_each(|v| *v = gelu_erf_scalar(*v));
}
multiversion!(fn gelu_erf_chunk / gelu_erf_chunk_with = gelu_erf_chunk_body; (x: &mut [f32]));

/// GELU, exact form x·Φ(x) (PyTorch `gelu(approximate="none")`), in place.
pub fn gelu_erf(x: &mut [f32]) {
    gelu_erf_with(crate::cpu::active(), x)
}

#[doc(hidden)]
pub fn gelu_erf_with(isa: Isa, x: &mut [f32]) {
    super::par_chunks(x, PAR, |c| gelu_erf_chunk_with(isa, c));
}

#[inline(always)]
fn gelu_tanh_chunk_body<F: Fma>(x: &mut [f32]) {
    // 0.5·x·(1 + tanh(u)) = x·sigmoid(2u), which has no cancellation for negative x.
    const K: f32 = 0.797_884_6; // √(2/π)
    x.iter_mut()
        .for_each(|v| *v *= math::sigmoid(2.0 * K * (*v + 0.044715 * *v * *v * *v)));
}
multiversion!(fn gelu_tanh_chunk / gelu_tanh_chunk_with = gelu_tanh_chunk_body; (x: &mut [f32]));

/// GELU, tanh approximation (PyTorch `gelu(approximate="tanh")`), in place.
pub fn gelu_tanh(x: &mut [f32]) {
    gelu_tanh_with(crate::cpu::active(), x)
}

#[doc(hidden)]
pub fn gelu_tanh_with(isa: Isa, x: &mut [f32]) {
    super::par_chunks(x, PAR, |c| gelu_tanh_chunk_with(isa, c));
}
