//! Portable kernels: plain Rust, written so the compiler can vectorize the inner loops (independent
//! accumulators, fixed-size blocks). Same arithmetic as the SIMD paths: int8 block dots with i32
//! sums for the quantized codecs, f32 for the float ones.

use crate::act::QAct;
use crate::codec::{Q4, Q8};
use crate::Weight;

use super::FloatW;

/// Σ a[i]·b[i] with 8 independent partial sums (vectorizable; the order differs from a serial sum).
#[inline]
pub(crate) fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for j in 0..8 {
            acc[j] += x[j] * y[j];
        }
    }
    let mut s = 0f32;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        s += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + s
}

/// Σ of 32 int8 products.
#[inline]
fn dot_i8_32(w: &[u8], x: &[i8]) -> i32 {
    let mut s = 0i32;
    for j in 0..32 {
        s += (w[j] as i8 as i32) * (x[j] as i32);
    }
    s
}

/// Σ_j lo_j·x[j] + hi_j·x[16+j] over one q4 group against an `EvenOdd` input block.
#[inline]
fn dot_q4_32(nib: &[u8], x: &[i8]) -> i32 {
    let mut s = 0i32;
    for j in 0..16 {
        s += (nib[j] & 15) as i32 * x[j] as i32 + (nib[j] >> 4) as i32 * x[16 + j] as i32;
    }
    s
}

pub(crate) fn float_matvec(w: &FloatW, x: &[f32], r0: usize, y: &mut [f32]) {
    let mut row = vec![0f32; w.cols];
    for (i, yr) in y.iter_mut().enumerate() {
        w.decode_row(r0 + i, &mut row);
        *yr = dot_f32(&row, x);
    }
}

/// One q8 row against one quantized input row: Σ_b d_b·I_b (before the row scale).
#[inline]
fn q8_row_dot(w: &[u8], a: &QAct, t: usize, tail: &mut [u8]) -> f32 {
    let xq = a.row(t);
    let d = &a.d[t * a.nb..(t + 1) * a.nb];
    let full = w.len() / 32;
    let mut acc = 0f32;
    for b in 0..full {
        acc += d[b] * dot_i8_32(&w[b * 32..b * 32 + 32], &xq[b * 32..b * 32 + 32]) as f32;
    }
    if !w.len().is_multiple_of(32) {
        tail.fill(0);
        tail[..w.len() % 32].copy_from_slice(&w[full * 32..]);
        acc += d[full] * dot_i8_32(tail, &xq[full * 32..full * 32 + 32]) as f32;
    }
    acc
}

pub(crate) fn q8_matvec(q: &Q8, a: &QAct, t: usize, r0: usize, y: &mut [f32]) {
    let mut tail = [0u8; 32];
    for (i, yr) in y.iter_mut().enumerate() {
        let r = r0 + i;
        *yr = q.scale(r) * q8_row_dot(q.row(r), a, t, &mut tail);
    }
}

/// Weight rows `r0..r0 + nr` against every quantized input row of `a` (n of them):
/// `Y[t, r0 + i]` at `y + t·ldy + i`. Each row is applied to all inputs while it is in L1; the
/// per-input arithmetic is [`q8_matvec`]'s.
///
/// # Safety
/// `y` must be writable at `t·ldy + i` for every t < n and i < nr.
pub(crate) unsafe fn q8_matmul_rows(
    q: &Q8,
    a: &QAct,
    n: usize,
    r0: usize,
    nr: usize,
    y: *mut f32,
    ldy: usize,
) {
    let mut tail = [0u8; 32];
    for i in 0..nr {
        let r = r0 + i;
        let (row, s) = (q.row(r), q.scale(r));
        for t in 0..n {
            *y.add(t * ldy + i) = s * q8_row_dot(row, a, t, &mut tail);
        }
    }
}

/// One q4 row (given its group scales) against one `EvenOdd` input row.
#[inline]
fn q4_row_dot(q: &Q4, r: usize, scales: &[f32], a: &QAct, t: usize) -> f32 {
    let xq = a.row(t);
    let (d, c) = (
        &a.d[t * a.nb..(t + 1) * a.nb],
        &a.c[t * a.nb..(t + 1) * a.nb],
    );
    let mut acc = 0f32;
    for g in 0..q.gpr {
        let i = dot_q4_32(q.nibbles(r, g), &xq[g * 32..g * 32 + 32]);
        acc += scales[g] * (d[g] * i as f32 - c[g]);
    }
    acc
}

pub(crate) fn q4_matvec(q: &Q4, a: &QAct, t: usize, r0: usize, y: &mut [f32]) {
    let mut scales = vec![0f32; q.gpr];
    for (i, yr) in y.iter_mut().enumerate() {
        q.row_scales(r0 + i, &mut scales);
        *yr = q4_row_dot(q, r0 + i, &scales, a, t);
    }
}

pub(crate) fn decode_rows_matvec(w: &Weight, x: &[f32], r0: usize, y: &mut [f32]) {
    let mut row = vec![0f32; w.cols];
    for (i, yr) in y.iter_mut().enumerate() {
        crate::reference::decode_row(w, r0 + i, &mut row);
        *yr = dot_f32(&row, x);
    }
}
