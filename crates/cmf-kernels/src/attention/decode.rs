//! Few-query schedule (decode). Tasks are (kv head, key range): each keeps the softmax state of
//! its rows (query tokens × the heads sharing the kv head) over its keys; the partial states are
//! merged with the usual rescaling: m = max m_s, l = Σ l_s·e^(m_s − m), O = Σ O_s·e^(m_s − m).
//! K/V rows are read once per task and widened 64 at a time into L1-sized buffers.

use super::{exp_sum, mask_block, max_lanes, widen, AttnParams, Kv, RowState};
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

/// o[hd] += Σ_j p[j]·v[j, hd], 32 output values at a time held in registers across the keys.
#[inline(always)]
fn add_pv<F: Fma>(o: &mut [f32], p: &[f32], v: &[f32], hd: usize) {
    let mut d0 = 0;
    while d0 + 32 <= hd {
        let mut acc: [f32; 32] = o[d0..d0 + 32].try_into().unwrap();
        for (j, &pj) in p.iter().enumerate() {
            let vr: &[f32; 32] = v[j * hd + d0..j * hd + d0 + 32].try_into().unwrap();
            for l in 0..32 {
                acc[l] = F::fma(pj, vr[l], acc[l]);
            }
        }
        o[d0..d0 + 32].copy_from_slice(&acc);
        d0 += 32;
    }
    for d in d0..hd {
        o[d] = p
            .iter()
            .enumerate()
            .fold(o[d], |a, (j, &pj)| F::fma(pj, v[j * hd + d], a));
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
    let mut kb = vec![0f32; BK * hd];
    let mut vb = vec![0f32; BK * hd];
    let mut s = vec![0f32; rows * BK];
    let lo = range.iter().map(|r| r.0).min().unwrap_or(k0);
    let hi = range.iter().map(|r| r.1).max().unwrap_or(k0);
    let mut j0 = lo;
    while j0 < hi {
        let n = (hi - j0).min(BK);
        let stride = p.n_kv_heads * hd;
        for j in 0..n {
            widen(
                kv.k,
                (j0 + j) * stride + h * hd,
                &mut kb[j * hd..(j + 1) * hd],
            );
            widen(
                kv.v,
                (j0 + j) * stride + h * hd,
                &mut vb[j * hd..(j + 1) * hd],
            );
        }
        for r in 0..rows {
            let (rlo, rhi) = range[r];
            let srow = &mut s[r * BK..r * BK + n];
            let qr = &qs[r * hd..(r + 1) * hd];
            for (j, v) in srow.iter_mut().enumerate() {
                *v = dot::<F>(qr, &kb[j * hd..(j + 1) * hd]);
            }
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
            add_pv::<F>(orow, srow, &vb, hd);
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
