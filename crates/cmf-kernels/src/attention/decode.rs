//! Few-query schedule (decode). Tasks are (kv head, key range): each keeps the softmax state of
//! its rows (query tokens × the heads sharing the kv head) over its keys; the partial states are
//! merged with the usual rescaling: m = max m_s, l = Σ l_s·e^(m_s − m), O = Σ O_s·e^(m_s − m).
//! K/V rows are read once per task and widened 64 at a time into L1-sized buffers.

use super::{exp_sum, mask_block, max_lanes, widen, AttnParams, Kv, KvLayout, KvSlice, RowState};
use crate::cpu::Isa;
use crate::ops::math;
use crate::pool::{self, SendPtr};
use crate::simd::{multiversion, Fma};

const BK: usize = 64;
/// Fewest keys worth a task of their own.
const MIN_KEYS_PER_TASK: usize = 256;

pub(crate) fn run(
    isa: Isa,
    q: &[f32],
    kv: &Kv,
    p: &AttnParams,
    key_mask: Option<&[bool]>,
    out: &mut [f32],
    nq: usize,
) {
    let (hd, len) = (p.head_dim, kv.len);
    let rows = nq * (p.n_heads / p.n_kv_heads);
    let threads = pool::num_threads();
    let splits = (4 * threads)
        .div_ceil(p.n_kv_heads)
        .min(len.div_ceil(MIN_KEYS_PER_TASK))
        .max(1);
    // Per task: rows × (m, l, O[hd]).
    let slot = rows * (hd + 2);
    let mut partial = vec![0f32; p.n_kv_heads * splits * slot];
    let pp = SendPtr(partial.as_mut_ptr());
    pool::for_each_task(p.n_kv_heads * splits, |i| {
        let (h, s) = (i / splits, i % splits);
        let (k0, k1) = (len * s / splits, len * (s + 1) / splits);
        // SAFETY: slot i belongs to task i.
        task_with(isa, q, *kv, p, key_mask, nq, h, k0, k1, unsafe {
            pp.slice(i * slot, slot)
        })
    });
    let group = p.n_heads / p.n_kv_heads;
    for h in 0..p.n_kv_heads {
        for r in 0..rows {
            let at = |s: usize| (h * splits + s) * slot + r * (hd + 2);
            let m = (0..splits)
                .map(|s| partial[at(s)])
                .fold(f32::NEG_INFINITY, f32::max);
            let (t, g) = (r / group, r % group);
            let dst = &mut out[(t * p.n_heads + h * group + g) * hd..][..hd];
            dst.fill(0.0);
            if m == f32::NEG_INFINITY {
                continue;
            }
            let mut l = 0f32;
            for s in 0..splits {
                let w = math::exp(partial[at(s)] - m);
                l += partial[at(s) + 1] * w;
                dst.iter_mut()
                    .zip(&partial[at(s) + 2..at(s) + 2 + hd])
                    .for_each(|(d, v)| *d += v * w);
            }
            let inv = 1.0 / l;
            dst.iter_mut().for_each(|d| *d *= inv);
        }
    }
}

#[inline(always)]
fn dot<F: Fma>(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let mut ca = a.chunks_exact(16);
    let mut cb = b.chunks_exact(16);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for j in 0..16 {
            acc[j] = F::fma(x[j], y[j], acc[j]);
        }
    }
    let mut s = 0f32;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        s = F::fma(*x, *y, s);
    }
    acc.iter().sum::<f32>() + s
}

/// Rows `at + j·stride` (j < n) of a K/V slice as f32: the slice itself for f32 (returned with
/// its stride), else widened into `buf` (stride hd).
#[inline(always)]
fn rows_f32<'a, F: Fma>(
    src: KvSlice<'a>,
    at: usize,
    n: usize,
    stride: usize,
    hd: usize,
    buf: &'a mut [f32],
) -> (&'a [f32], usize) {
    match src {
        KvSlice::F32(s) => (&s[at..], stride),
        _ => {
            for j in 0..n {
                widen::<F>(src, at + j * stride, &mut buf[j * hd..(j + 1) * hd]);
            }
            (&buf[..], hd)
        }
    }
}

/// Software prefetch of `n` rows of `hd` elements, `stride` apart, starting at element `at`.
#[inline(always)]
fn prefetch_rows(src: KvSlice, at: usize, n: usize, stride: usize, hd: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let (base, esz) = match src {
            KvSlice::F32(s) => (s.as_ptr() as *const i8, 4),
            KvSlice::F16(s) | KvSlice::Bf16(s) => (s.as_ptr() as *const i8, 2),
        };
        for j in 0..n {
            let row = (at + j * stride) * esz;
            for off in (0..hd * esz).step_by(64) {
                // SAFETY: prefetch never faults; the address is inside the slice (row < len).
                unsafe { _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(row + off)) };
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (src, at, n, stride, hd);
}

/// o[hd] += Σ_j p[j]·v[j·stride .. +hd] (portable).
#[inline(always)]
fn add_pv<F: Fma>(o: &mut [f32], p: &[f32], v: &[f32], stride: usize, hd: usize) {
    for (j, &pj) in p.iter().enumerate() {
        for (a, b) in o[..hd].iter_mut().zip(&v[j * stride..j * stride + hd]) {
            *a = F::fma(pj, *b, *a);
        }
    }
}

/// Scores of one query row against `n` key rows `stride` apart (portable).
#[inline(always)]
fn scores<F: Fma>(q: &[f32], k: &[f32], stride: usize, hd: usize, out: &mut [f32]) {
    for (j, o) in out.iter_mut().enumerate() {
        *o = dot::<F>(q, &k[j * stride..j * stride + hd]);
    }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn task_body<F: Fma>(
    q: &[f32],
    kv: Kv,
    p: &AttnParams,
    key_mask: Option<&[bool]>,
    nq: usize,
    h: usize,
    k0: usize,
    k1: usize,
    slot: &mut [f32],
) {
    let (hd, group) = (p.head_dim, p.n_heads / p.n_kv_heads);
    let rows = nq * group;
    let mut qs = vec![0f32; rows * hd];
    let mut range = vec![(0usize, 0usize); rows];
    for r in 0..rows {
        let (t, g) = (r / group, r % group);
        qs[r * hd..(r + 1) * hd]
            .iter_mut()
            .zip(&q[(t * p.n_heads + h * group + g) * hd..][..hd])
            .for_each(|(o, v)| *o = v * p.scale);
        let (lo, hi) = p.key_range(p.q_pos0 + t, kv.len);
        range[r] = (lo.max(k0), hi.min(k1));
    }
    let mut st = vec![RowState::EMPTY; rows];
    let mut o = vec![0f32; rows * hd];
    let mut s = vec![0f32; rows * BK];
    let lo = range.iter().map(|r| r.0).min().unwrap_or(k0);
    let hi = range.iter().map(|r| r.1).max().unwrap_or(k0);
    // Widened K and V blocks (16-bit caches only; f32 is read in place).
    let scratch = if matches!(kv.k, KvSlice::F32(_)) {
        0
    } else {
        2 * BK * hd
    };
    let mut guard = crate::pool::Scratch::new(scratch);
    let (kb, vb) = guard.get().split_at_mut(scratch / 2);
    let stride = kv.token_stride(p.n_kv_heads, hd);
    let mut j0 = lo;
    while j0 < hi {
        let n = (hi - j0).min(BK);
        // Token-major rows are 2-4 KiB apart, which the hardware prefetcher does not follow: ask
        // for the next block's rows now. (Head-major caches are sequential streams.)
        if j0 + n < hi && kv.layout == KvLayout::TokenMajor {
            let m = (hi - j0 - n).min(BK);
            prefetch_rows(kv.k, kv.at(j0 + n, h, p.n_kv_heads, hd), m, stride, hd);
            prefetch_rows(kv.v, kv.at(j0 + n, h, p.n_kv_heads, hd), m, stride, hd);
        }
        // K and V rows of this block: f32 caches are read in place (row stride `stride`), the
        // 16-bit ones widened into contiguous buffers (row stride hd).
        let (kp, kst) = rows_f32::<F>(kv.k, kv.at(j0, h, p.n_kv_heads, hd), n, stride, hd, kb);
        let (vp, vst) = rows_f32::<F>(kv.v, kv.at(j0, h, p.n_kv_heads, hd), n, stride, hd, vb);
        let (kb_rows, vb_rows) = (&kp[..(n - 1) * kst + hd], &vp[..(n - 1) * vst + hd]);
        for r in 0..rows {
            let (rlo, rhi) = range[r];
            let srow = &mut s[r * BK..r * BK + n];
            let qr = &qs[r * hd..(r + 1) * hd];
            #[cfg(target_arch = "x86_64")]
            if F::X86_SIMD {
                // SAFETY: this instance runs with AVX2 (or AVX-512); kb_rows holds n rows at kst.
                unsafe {
                    if F::AVX512 {
                        super::x86::scores_avx512(qr, kb_rows.as_ptr(), kst, hd, srow)
                    } else {
                        super::x86::scores_avx2(qr, kb_rows.as_ptr(), kst, hd, srow)
                    }
                }
            } else {
                scores::<F>(qr, kb_rows, kst, hd, srow);
            }
            #[cfg(not(target_arch = "x86_64"))]
            scores::<F>(qr, kb_rows, kst, hd, srow);
            mask_block(srow, j0, rlo, rhi, key_mask);
            let mx = max_lanes(srow);
            if mx == f32::NEG_INFINITY {
                srow.fill(0.0);
                continue;
            }
            let m_new = st[r].m.max(mx);
            let corr = math::exp(st[r].m - m_new);
            let sum = exp_sum(srow, m_new);
            st[r] = RowState {
                m: m_new,
                l: st[r].l * corr + sum,
            };
            let orow = &mut o[r * hd..(r + 1) * hd];
            if corr != 1.0 {
                orow.iter_mut().for_each(|v| *v *= corr);
            }
            #[cfg(target_arch = "x86_64")]
            if F::X86_SIMD {
                // SAFETY: as above; vb_rows holds n rows at vst.
                unsafe {
                    if F::AVX512 {
                        super::x86::add_pv_avx512(orow, srow, vb_rows.as_ptr(), vst, hd)
                    } else {
                        super::x86::add_pv_avx2(orow, srow, vb_rows.as_ptr(), vst, hd)
                    }
                }
            } else {
                add_pv::<F>(orow, srow, vb_rows, vst, hd);
            }
            #[cfg(not(target_arch = "x86_64"))]
            add_pv::<F>(orow, srow, vb_rows, vst, hd);
        }
        j0 += n;
    }
    for r in 0..rows {
        let dst = &mut slot[r * (hd + 2)..(r + 1) * (hd + 2)];
        dst[0] = st[r].m;
        dst[1] = st[r].l;
        dst[2..].copy_from_slice(&o[r * hd..(r + 1) * hd]);
    }
}
multiversion!(fn task / task_with = task_body;
    (q: &[f32], kv: Kv, p: &AttnParams, key_mask: Option<&[bool]>, nq: usize, h: usize, k0: usize, k1: usize, slot: &mut [f32]));
