//! Activation quantization for the int8 kernels.
//!
//! Scheme (like llama.cpp's q8_0 activations): blocks of 32 consecutive inputs, one f32 scale per
//! block, `d = max|x| / 127`, `q = round_half_even(x / d)` in [−127, 127]. A block of zeros has
//! d = 0. The per-element error is at most d/2, so for one output
//! `|y − y_exact| ≤ Σ_b (d_b / 2) · Σ_{i∈b} |w_i|` (plus f32 rounding): that is the bound the
//! parity tests check. Per-32 blocks rather than one scale per row keep an outlier channel (common
//! in LLM activations) from flattening the rest of the row; `docs/kernels.md` has the measurements.
//!
//! The int8 kernels multiply unsigned by signed bytes (`vpdpbusd`, `pmaddubsw`) and need the
//! per-block sums Σq to undo an offset: q8 weights are fed as `w + 128` (so Σ(w+128)q = Σwq + 128Σq)
//! and q4 nibbles as `q` (w = q − 8, so Σ(q−8)x = Σqx − 8Σx). `c[b] = offset · d[b] · Σq_b` is that
//! correction in output units, stored per block.
//!
//! Element order inside the quantized row depends on the weight codec and the kernel (see [`Order`]):
//! q4 groups keep element 2j in a low nibble and 2j+1 in a high one, and it is cheaper to permute
//! the activation once than to re-interleave nibbles for every row.

use crate::codec::GROUP;
use crate::cpu::Isa;
use crate::simd::{multiversion, Fma};

/// The order quantized inputs are stored in, within each block (or pair of blocks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Order {
    /// x[0], x[1], … unchanged (q8 codecs).
    Natural,
    /// Per 32-block: the 16 even elements, then the 16 odd ones (low nibbles, then high).
    EvenOdd,
    /// Per four 32-blocks (b0..b3): the 16 even elements of b0, b1, b2, b3, then their 16 odd
    /// elements — the order of 64 nibble bytes split into low and high halves (AVX-512 q4
    /// matvec). Rows are padded to 128 for this order.
    QuadEvenOdd,
}

/// Quantized activation rows: `n` rows of `kp` int8 values (cols rounded up to 64 or 128, zero padded).
pub(crate) struct QAct {
    pub kp: usize,
    /// Blocks per row (kp / 32).
    pub nb: usize,
    /// n × kp
    pub qs: Vec<i8>,
    /// n × nb block scales.
    pub d: Vec<f32>,
    /// n × nb: offset · d · Σq per block (see the module comment).
    pub c: Vec<f32>,
    /// n × nb: Σq per block.
    pub sum: Vec<i32>,
}

impl QAct {
    pub fn row(&self, t: usize) -> &[i8] {
        &self.qs[t * self.kp..(t + 1) * self.kp]
    }
}

/// Padded row length for `cols` inputs.
pub(crate) fn padded(cols: usize, order: Order) -> usize {
    let unit = if order == Order::QuadEvenOdd { 128 } else { 64 };
    cols.div_ceil(unit) * unit
}

/// Index in the permuted row of input `i` (i < kp).
#[inline]
fn dest(order: Order, i: usize) -> usize {
    let (b, j) = (i / GROUP, i % GROUP);
    match order {
        Order::Natural => i,
        Order::EvenOdd => b * GROUP + (j % 2) * 16 + j / 2,
        Order::QuadEvenOdd => (b / 4) * 128 + (j % 2) * 64 + (b % 4) * 16 + j / 2,
    }
}

/// Quantizes `n` rows of `cols` inputs. `offset` is the weight offset the kernel compensates
/// (128 for q8 codecs fed as w+128, 8 for q4 nibbles, 0 when unused).
pub(crate) fn quantize(
    isa: Isa,
    x: &[f32],
    n: usize,
    cols: usize,
    order: Order,
    offset: f32,
) -> QAct {
    let kp = padded(cols, order);
    let nb = kp / GROUP;
    let mut a = QAct {
        kp,
        nb,
        qs: vec![0; n * kp],
        d: vec![0.0; n * nb],
        c: vec![0.0; n * nb],
        sum: vec![0; n * nb],
    };
    // Each row is independent; rows are split over the pool only when there are many of them.
    let rows_per_task = 16usize;
    let tasks = n.div_ceil(rows_per_task);
    let qs = crate::pool::SendPtr(a.qs.as_mut_ptr());
    let d = crate::pool::SendPtr(a.d.as_mut_ptr());
    let c = crate::pool::SendPtr(a.c.as_mut_ptr());
    let s = crate::pool::SendPtr(a.sum.as_mut_ptr());
    crate::pool::for_each_task(tasks, |task| {
        for t in task * rows_per_task..((task + 1) * rows_per_task).min(n) {
            // SAFETY: row t of each buffer belongs to this task only.
            let (qs, d, c, s) = unsafe {
                (
                    qs.slice(t * kp, kp),
                    d.slice(t * nb, nb),
                    c.slice(t * nb, nb),
                    s.slice(t * nb, nb),
                )
            };
            let xr = &x[t * cols..(t + 1) * cols];
            #[cfg(target_arch = "x86_64")]
            if isa == Isa::Avx512 {
                // SAFETY: the CPU runs AVX-512 (isa is supported); slices sized by `quantize`.
                unsafe { quantize_row_avx512(xr, order, offset, qs, d, c, s) };
                continue;
            }
            quantize_row_with(isa, xr, order, offset, qs, d, c, s);
        }
    });
    a
}

/// (d, 1/d) of a block from its max |x|. A zero block has d = 0. A block holding NaN or ±∞ gets
/// d = NaN and zero codes, so the outputs it touches come out NaN instead of silently finite.
#[inline(always)]
fn block_scale(amax: f32) -> (f32, f32) {
    if amax > 0.0 && amax.is_finite() {
        (amax / 127.0, 127.0 / amax)
    } else if amax == 0.0 {
        (0.0, 0.0)
    } else {
        (f32::NAN, 0.0)
    }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn quantize_row_body<F: Fma>(
    x: &[f32],
    order: Order,
    offset: f32,
    qs: &mut [i8],
    d: &mut [f32],
    c: &mut [f32],
    s: &mut [i32],
) {
    // Fixed 32-wide loops with lane-wise max and sums, so the body vectorizes (including the
    // rounding: `round_ties_even` is one instruction where SSE4.1/AVX exist).
    let nb = d.len();
    for b in 0..nb {
        let mut xb = [0f32; GROUP];
        let lo = (b * GROUP).min(x.len());
        let hi = ((b + 1) * GROUP).min(x.len());
        xb[..hi - lo].copy_from_slice(&x[lo..hi]);
        let mut m = [0f32; GROUP];
        for j in 0..GROUP {
            let a = xb[j].abs();
            m[j] = if a > m[j] { a } else { m[j] };
        }
        let mut amax = m.iter().fold(0f32, |acc, &v| if v > acc { v } else { acc });
        if xb.iter().fold(false, |bad, v| bad | !v.is_finite()) {
            amax = f32::NAN;
        }
        let (db, inv) = block_scale(amax);
        let mut q = [0i32; GROUP];
        for j in 0..GROUP {
            // |x·inv| ≤ 127 up to rounding, so the clamp only guards that rounding.
            q[j] = (xb[j] * inv).round_ties_even().clamp(-127.0, 127.0) as i32;
        }
        let sum: i32 = q.iter().sum();
        if order == Order::Natural {
            for (o, v) in qs[b * GROUP..(b + 1) * GROUP].iter_mut().zip(&q) {
                *o = *v as i8;
            }
        } else {
            for (j, v) in q.iter().enumerate() {
                qs[dest(order, b * GROUP + j)] = *v as i8;
            }
        }
        d[b] = db;
        s[b] = sum;
        c[b] = offset * db * sum as f32;
    }
}
multiversion!(fn quantize_row / quantize_row_with = quantize_row_body;
    (x: &[f32], order: Order, offset: f32, qs: &mut [i8], d: &mut [f32], c: &mut [f32], s: &mut [i32]));

/// `quantize_row` with AVX-512: 32 inputs per step, the even/odd split done with two-register
/// permutes, bytes written with saturating narrowing stores. Same results as the portable body
/// (`vcvtps2dq` rounds half to even, like `round_ties_even`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx2")]
#[allow(clippy::too_many_arguments)]
unsafe fn quantize_row_avx512(
    x: &[f32],
    order: Order,
    offset: f32,
    qs: &mut [i8],
    d: &mut [f32],
    c: &mut [f32],
    s: &mut [i32],
) {
    use std::arch::x86_64::*;
    let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    let absmask = _mm512_set1_epi32(0x7FFF_FFFF);
    let out = qs.as_mut_ptr();
    for b in 0..d.len() {
        let lo = (b * GROUP).min(x.len());
        let n = ((b + 1) * GROUP).min(x.len()) - lo;
        let m0 = if n >= 16 {
            0xFFFF
        } else {
            ((1u32 << n) - 1) as u16
        };
        let m1 = if n >= 32 {
            0xFFFF
        } else if n <= 16 {
            0
        } else {
            ((1u32 << (n - 16)) - 1) as u16
        };
        let v0 = _mm512_maskz_loadu_ps(m0, x.as_ptr().add(lo));
        let v1 = _mm512_maskz_loadu_ps(m1, x.as_ptr().wrapping_add(lo + 16));
        let a = _mm512_max_ps(
            _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v0), absmask)),
            _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v1), absmask)),
        );
        // NaN and ±∞ (fpclass 0x99) make the whole block's scale NaN.
        let bad = _mm512_fpclass_ps_mask::<0x99>(v0) | _mm512_fpclass_ps_mask::<0x99>(v1);
        let amax = if bad != 0 {
            f32::NAN
        } else {
            _mm512_reduce_max_ps(a)
        };
        let (db, inv) = block_scale(amax);
        let (q0, q1) = if inv > 0.0 {
            let iv = _mm512_set1_ps(inv);
            (
                _mm512_cvtps_epi32(_mm512_mul_ps(v0, iv)),
                _mm512_cvtps_epi32(_mm512_mul_ps(v1, iv)),
            )
        } else {
            (_mm512_setzero_si512(), _mm512_setzero_si512())
        };
        let sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        match order {
            Order::Natural => {
                _mm_storeu_si128(
                    out.add(b * GROUP) as *mut __m128i,
                    _mm512_cvtsepi32_epi8(q0),
                );
                _mm_storeu_si128(
                    out.add(b * GROUP + 16) as *mut __m128i,
                    _mm512_cvtsepi32_epi8(q1),
                );
            }
            Order::EvenOdd | Order::QuadEvenOdd => {
                let (pe, po) = if order == Order::EvenOdd {
                    (b * GROUP, b * GROUP + 16)
                } else {
                    (
                        (b / 4) * 128 + (b % 4) * 16,
                        (b / 4) * 128 + 64 + (b % 4) * 16,
                    )
                };
                let qe = _mm512_permutex2var_epi32(q0, even, q1);
                let qo = _mm512_permutex2var_epi32(q0, odd, q1);
                _mm_storeu_si128(out.add(pe) as *mut __m128i, _mm512_cvtsepi32_epi8(qe));
                _mm_storeu_si128(out.add(po) as *mut __m128i, _mm512_cvtsepi32_epi8(qo));
            }
        }
        d[b] = db;
        s[b] = sum;
        c[b] = offset * db * sum as f32;
    }
}

/// Per-lane tables for the AVX-512 matvec kernels, whose 16 i32 lanes each sum 4 consecutive
/// bytes of a 64-byte chunk of the (permuted) row: `dl[l]` is the scale of the block lane `l`
/// belongs to, `cl[l]` is `offset · d · Σq` over the inputs the lane sums.
///
/// `Natural` (q8): lane l of chunk c covers inputs 64c + 4l .. +4.
/// `QuadEvenOdd` (q4): the kernel adds the even-element and odd-element products of a group
/// before converting, so lane l of quad c covers positions 128c + 4l .. +4 and 128c + 64 + 4l .. +4,
/// both in group 4c + l/4; the tables have 16 entries per 128 inputs.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) struct LaneTables {
    pub dl: Vec<f32>,
    pub cl: Vec<f32>,
}

pub(crate) fn lane_tables(a: &QAct, t: usize, order: Order, offset: f32) -> LaneTables {
    let row = a.row(t);
    let d = &a.d[t * a.nb..(t + 1) * a.nb];
    let lane_sum = |p: usize| -> i32 { row[p..p + 4].iter().map(|&q| q as i32).sum() };
    let (mut dl, mut cl) = (Vec::new(), Vec::new());
    match order {
        Order::QuadEvenOdd => {
            for c in 0..a.kp / 128 {
                for l in 0..16 {
                    let db = d[4 * c + l / 4];
                    dl.push(db);
                    cl.push(
                        offset
                            * db
                            * (lane_sum(128 * c + 4 * l) + lane_sum(128 * c + 64 + 4 * l)) as f32,
                    );
                }
            }
        }
        _ => {
            assert_eq!(
                order,
                Order::Natural,
                "lane tables exist for Natural and QuadEvenOdd rows"
            );
            for l in 0..a.kp / 4 {
                let db = d[l / 8];
                dl.push(db);
                cl.push(offset * db * lane_sum(4 * l) as f32);
            }
        }
    }
    LaneTables { dl, cl }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orders_are_permutations_within_blocks() {
        for nb in [4usize, 8, 12] {
            for order in [Order::Natural, Order::EvenOdd, Order::QuadEvenOdd] {
                let mut seen = vec![false; nb * GROUP];
                for i in 0..nb * GROUP {
                    let p = dest(order, i);
                    assert!(!seen[p], "{order:?} nb {nb}: {i} collides");
                    seen[p] = true;
                    // A permuted position stays inside its own padding unit.
                    assert_eq!(p / 128, i / 128);
                }
            }
        }
    }

    #[test]
    fn quantization_error_within_half_step() {
        let x: Vec<f32> = (0..100)
            .map(|i| ((i * 37 % 17) as f32 - 8.0) * 0.31 + if i == 40 { 50.0 } else { 0.0 })
            .collect();
        let a = quantize(Isa::Portable, &x, 1, 100, Order::Natural, 0.0);
        assert_eq!(a.kp, 128);
        for (i, v) in x.iter().enumerate() {
            let d = a.d[i / 32];
            let back = a.qs[i] as f32 * d;
            assert!((back - v).abs() <= d * 0.5 + 1e-6, "{i}: {v} vs {back}");
        }
        assert!(a.qs[100..].iter().all(|&q| q == 0));
        assert!(a.d[3] > 0.0);
    }
}
