//! AVX2 + FMA + F16C kernels: the matvecs and the q8 kernel for a few input rows (the packed GEMM
//! is in `gemm.rs`).
//!
//! Int8 products use `pmaddubsw` (u8 × s8 → pairs summed to i16, saturating) then `pmaddwd` by 1:
//! - q8: the sign trick, |w| (≤ 128, unsigned) × sign(w)·x (|x| ≤ 127): a pair is at most
//!   2·128·127 = 32512, below the i16 limit, so nothing saturates.
//! - q4: nibbles q ∈ 0..15 × x: at most 2·15·127; the −8 offset is corrected per group in f32.
//!
//! One 32-byte vector is exactly one 32-block, so the block scale is a broadcast. Rows are read
//! one at a time (consecutive rows are consecutive memory: one sequential stream).

#![allow(clippy::needless_range_loop)] // register tiles read clearest with explicit indices

use std::arch::x86_64::*;

use crate::act::QAct;
use crate::codec::{Q4, Q8};
use cmf_format::Dtype;

use super::FloatW;

#[inline(always)]
unsafe fn hsum8(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

#[inline(always)]
unsafe fn load8(dtype: Dtype, p: *const u8) -> __m256 {
    match dtype {
        Dtype::F32 => _mm256_loadu_ps(p as *const f32),
        Dtype::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
        _ => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
            _mm_loadu_si128(p as *const __m128i),
        ))),
    }
}

/// Float rows · x, one row at a time (one sequential stream from memory), two accumulators.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn float_matvec(w: &FloatW, x: &[f32], r0: usize, y: &mut [f32]) {
    let cols = w.cols;
    let esz = if w.dtype == Dtype::F32 { 4 } else { 2 };
    let full = cols / 8;
    let xp = x.as_ptr();
    let mut tail_row = vec![0f32; cols];
    for (i, yr) in y.iter_mut().enumerate() {
        let row = w.data.as_ptr().add((r0 + i) * cols * esz);
        let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut c = 0;
        while c + 2 <= full {
            a0 = _mm256_fmadd_ps(
                load8(w.dtype, row.add(c * 8 * esz)),
                _mm256_loadu_ps(xp.add(c * 8)),
                a0,
            );
            a1 = _mm256_fmadd_ps(
                load8(w.dtype, row.add((c + 1) * 8 * esz)),
                _mm256_loadu_ps(xp.add((c + 1) * 8)),
                a1,
            );
            c += 2;
        }
        if c < full {
            a0 = _mm256_fmadd_ps(
                load8(w.dtype, row.add(c * 8 * esz)),
                _mm256_loadu_ps(xp.add(c * 8)),
                a0,
            );
        }
        let mut s = hsum8(_mm256_add_ps(a0, a1));
        if full * 8 < cols {
            w.decode_row(r0 + i, &mut tail_row);
            for c in full * 8..cols {
                s = tail_row[c].mul_add(x[c], s);
            }
        }
        *yr = s;
    }
}

/// Σ over one 32-block of w·x as 8 i32 lanes (sign trick, see the module comment).
#[inline(always)]
unsafe fn dot_block_q8(w: __m256i, x: __m256i) -> __m256i {
    let p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
    _mm256_madd_epi16(p, _mm256_set1_epi16(1))
}

/// q8 rows · quantized input row `t`, one row at a time (one sequential stream), two accumulators.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q8_matvec(q: &Q8, a: &QAct, t: usize, r0: usize, y: &mut [f32]) {
    let cols = q.cols;
    let xq = a.qs.as_ptr().add(t * a.kp);
    let ad = &a.d[t * a.nb..(t + 1) * a.nb];
    let full = cols / 32;
    let mut tail = [0u8; 32];
    for (i, yr) in y.iter_mut().enumerate() {
        let row = q.row(r0 + i);
        let rp = row.as_ptr();
        let mut acc = [_mm256_setzero_ps(); 2];
        for b in 0..full {
            let s = dot_block_q8(
                _mm256_loadu_si256(rp.add(b * 32) as *const __m256i),
                _mm256_loadu_si256(xq.add(b * 32) as *const __m256i),
            );
            acc[b % 2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(ad[b]), acc[b % 2]);
        }
        if full * 32 < cols {
            tail.fill(0);
            tail[..cols - full * 32].copy_from_slice(&row[full * 32..]);
            let s = dot_block_q8(
                _mm256_loadu_si256(tail.as_ptr() as *const __m256i),
                _mm256_loadu_si256(xq.add(full * 32) as *const __m256i),
            );
            acc[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(ad[full]), acc[0]);
        }
        *yr = q.scale(r0 + i) * hsum8(_mm256_add_ps(acc[0], acc[1]));
    }
}

/// Input rows one weight row is applied to at a time by [`q8_matmul_rows`] (two accumulators
/// each: 8 of the 16 vector registers).
const Q8_TILE: usize = 4;

/// One q8 row against `T` quantized input rows (`xq[t]`, block scales `ad[t]`): each 32-byte
/// block of the row is loaded once (and its |w| taken once) for every input. Each input keeps
/// [`q8_matvec`]'s two accumulators in the same order, so every dot is bit-identical to it.
#[inline(always)]
unsafe fn q8_row_tile<const T: usize>(
    row: &[u8],
    xq: &[*const i8; T],
    ad: &[*const f32; T],
) -> [f32; T] {
    let cols = row.len();
    let full = cols / 32;
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); 2]; T];
    let mut tail = [0u8; 32];
    let rp = row.as_ptr();
    for b in 0..full + usize::from(full * 32 < cols) {
        let w = if b < full {
            _mm256_loadu_si256(rp.add(b * 32) as *const __m256i)
        } else {
            tail[..cols - full * 32].copy_from_slice(&row[full * 32..]);
            _mm256_loadu_si256(tail.as_ptr() as *const __m256i)
        };
        // The matvec puts the tail block in the first accumulator.
        let slot = if b < full { b % 2 } else { 0 };
        let wabs = _mm256_abs_epi8(w);
        for t in 0..T {
            let x = _mm256_loadu_si256(xq[t].add(b * 32) as *const __m256i);
            let s = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(x, w)), ones);
            acc[t][slot] = _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(s),
                _mm256_set1_ps(*ad[t].add(b)),
                acc[t][slot],
            );
        }
    }
    let mut out = [0f32; T];
    for t in 0..T {
        out[t] = hsum8(_mm256_add_ps(acc[t][0], acc[t][1]));
    }
    out
}

/// Weight rows `r0..r0 + nr` against every quantized input row of `a`: `Y[t, r0 + i]` at
/// `y + t·ldy + i`, each row read once for up to [`Q8_TILE`] inputs; bit-identical to
/// [`q8_matvec`] per input.
///
/// # Safety
/// The CPU must have AVX2/FMA; `y` must be writable at `t·ldy + i` for every input t and i < nr.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q8_matmul_rows(
    q: &Q8,
    a: &QAct,
    n: usize,
    r0: usize,
    nr: usize,
    y: *mut f32,
    ldy: usize,
) {
    let xq: Vec<*const i8> = (0..n).map(|t| a.qs.as_ptr().add(t * a.kp)).collect();
    let ad: Vec<*const f32> = (0..n).map(|t| a.d.as_ptr().add(t * a.nb)).collect();
    for i in 0..nr {
        let r = r0 + i;
        let row = q.row(r);
        let s = q.scale(r);
        let mut t0 = 0;
        while t0 < n {
            let k = (n - t0).min(Q8_TILE);
            let (x, d) = (&xq[t0..t0 + k], &ad[t0..t0 + k]);
            macro_rules! tile {
                ($T:literal) => {{
                    let dots = q8_row_tile::<$T>(
                        row,
                        x.try_into().expect("tile width"),
                        d.try_into().expect("tile width"),
                    );
                    for (j, dot) in dots.iter().enumerate() {
                        *y.add((t0 + j) * ldy + i) = s * dot;
                    }
                }};
            }
            match k {
                4 => tile!(4),
                3 => tile!(3),
                2 => tile!(2),
                _ => tile!(1),
            }
            t0 += k;
        }
    }
}

/// One q4 group as 32 unsigned bytes in `EvenOdd` order: [16 low nibbles | 16 high nibbles].
#[inline(always)]
unsafe fn q4_group(p: *const u8) -> __m256i {
    let v = _mm_loadu_si128(p as *const __m128i);
    let m = _mm_set1_epi8(0x0F);
    let lo = _mm_and_si128(v, m);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), m);
    _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(lo), hi)
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q4_matvec(q: &Q4, a: &QAct, t: usize, r0: usize, y: &mut [f32]) {
    let gpr = q.gpr;
    let stride = q.stride();
    let xq = a.qs.as_ptr().add(t * a.kp);
    let (ad, ac) = (
        &a.d[t * a.nb..(t + 1) * a.nb],
        &a.c[t * a.nb..(t + 1) * a.nb],
    );
    let ones = _mm256_set1_epi16(1);
    let mut scales = vec![0f32; gpr];
    for (i, yr) in y.iter_mut().enumerate() {
        let r = r0 + i;
        q.row_scales(r, &mut scales);
        let row = q.data.as_ptr().add(q.row_offset(r));
        let mut acc0 = _mm256_setzero_ps();
        let mut acc1 = _mm256_setzero_ps();
        let mut corr = 0f32;
        let mut g = 0;
        while g < gpr {
            let s0 = _mm256_madd_epi16(
                _mm256_maddubs_epi16(
                    q4_group(row.add(g * stride)),
                    _mm256_loadu_si256(xq.add(g * 32) as *const __m256i),
                ),
                ones,
            );
            acc0 = _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(s0),
                _mm256_set1_ps(scales[g] * ad[g]),
                acc0,
            );
            corr += scales[g] * ac[g];
            if g + 1 < gpr {
                let g1 = g + 1;
                let s1 = _mm256_madd_epi16(
                    _mm256_maddubs_epi16(
                        q4_group(row.add(g1 * stride)),
                        _mm256_loadu_si256(xq.add(g1 * 32) as *const __m256i),
                    ),
                    ones,
                );
                acc1 = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(s1),
                    _mm256_set1_ps(scales[g1] * ad[g1]),
                    acc1,
                );
                corr += scales[g1] * ac[g1];
            }
            g += 2;
        }
        *yr = hsum8(_mm256_add_ps(acc0, acc1)) - corr;
    }
}
