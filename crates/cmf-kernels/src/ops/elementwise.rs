//! Element-wise helpers (in place on the first argument). Large arrays are split over the pool.

use crate::pool::SendPtr;
use crate::simd::{multiversion, Fma};

const PAR: usize = 1 << 16;

#[inline(always)]
fn add_chunk_body<F: Fma>(a: &mut [f32], b: &[f32]) {
    a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
}
multiversion!(fn add_chunk / add_chunk_with = add_chunk_body; (a: &mut [f32], b: &[f32]));

/// a += b
pub fn add(a: &mut [f32], b: &[f32]) {
    add_with(crate::cpu::active(), a, b)
}

#[doc(hidden)]
pub fn add_with(isa: crate::cpu::Isa, a: &mut [f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "add: lengths differ");
    let ap = SendPtr(a.as_mut_ptr());
    super::par_ranges(a.len(), PAR, |s, e| {
        // SAFETY: each range is owned by one task.
        add_chunk_with(isa, unsafe { ap.slice(s, e - s) }, &b[s..e])
    });
}

#[inline(always)]
fn add_scaled_body<F: Fma>(a: &mut [f32], b: &[f32], s: f32) {
    assert_eq!(a.len(), b.len(), "add_scaled: lengths differ");
    a.iter_mut()
        .zip(b)
        .for_each(|(x, y)| *x = F::fma(*y, s, *x));
}
multiversion!(
    /// a += s·b
    pub fn add_scaled / add_scaled_with = add_scaled_body; (a: &mut [f32], b: &[f32], s: f32));

#[inline(always)]
fn mul_body<F: Fma>(a: &mut [f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "mul: lengths differ");
    a.iter_mut().zip(b).for_each(|(x, y)| *x *= y);
}
multiversion!(
    /// a *= b (element-wise)
    pub fn mul / mul_with = mul_body; (a: &mut [f32], b: &[f32]));

#[inline(always)]
fn scale_body<F: Fma>(a: &mut [f32], s: f32) {
    a.iter_mut().for_each(|x| *x *= s);
}
multiversion!(
    /// a *= s
    pub fn scale / scale_with = scale_body; (a: &mut [f32], s: f32));

#[inline(always)]
fn add_rows_body<F: Fma>(x: &mut [f32], b: &[f32]) {
    assert!(
        !b.is_empty() && x.len().is_multiple_of(b.len()),
        "add_rows: {} is not a multiple of {}",
        x.len(),
        b.len()
    );
    for row in x.chunks_mut(b.len()) {
        row.iter_mut().zip(b).for_each(|(v, c)| *v += c);
    }
}
multiversion!(
    /// Each row of `x` (rows of b.len()) += b — e.g. a bias after a matmul.
    pub fn add_rows / add_rows_with = add_rows_body; (x: &mut [f32], b: &[f32]));
