//! Many-query schedule (prefill, joint attention). Per kv head: Kᵀ `[hdp, lenp]` and V
//! `[lenp, hdp]` widened to f32 once (hdp = head_dim rounded up to 32, lenp = len rounded up to
//! 64, zero padded), then blocks of query rows (tokens × the heads sharing this kv head) run in
//! parallel. Per 64-key block: S = Q·Kᵀ, mask, online softmax (running max m and sum l per row,
//! O rescaled by e^(m_old − m_new)), O += P·V; both products on [`crate::sgemm`].

use super::{exp_sum, mask_block, max_lanes, widen, AttnParams, Kv, RowState};
use crate::cpu::Isa;
use crate::ops::math;
use crate::pool::{self, SendPtr};
use crate::sgemm::sgemm;
use crate::simd::{multiversion, Fma};

/// Rows (query tokens × group) per kv head from which this schedule is used.
pub(crate) const MIN_ROWS: usize = 16;
/// Keys per block.
const BK: usize = 64;
/// Query rows per task (a multiple of 4).
const ROWS: usize = 64;

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
    let group = p.n_heads / p.n_kv_heads;
    let hdp = hd.div_ceil(32) * 32;
    let lenp = len.div_ceil(BK).max(1) * BK;
    let mut kt = vec![0f32; hdp * lenp];
    let mut vb = vec![0f32; lenp * hdp];
    let tokens_per_task = (ROWS / group).max(1);
    let tasks = nq.div_ceil(tokens_per_task);
    let op = SendPtr(out.as_mut_ptr());
    for h in 0..p.n_kv_heads {
        let (ktp, vbp) = (SendPtr(kt.as_mut_ptr()), SendPtr(vb.as_mut_ptr()));
        let chunks = len.div_ceil(256);
        pool::for_each_task(chunks, |c| {
            let (j0, j1) = (c * 256, ((c + 1) * 256).min(len));
            prepare_with(isa, *kv, p, h, j0, j1, lenp, hdp, ktp, vbp)
        });
        pool::for_each_task(tasks, |i| {
            let (t0, t1) = (i * tokens_per_task, ((i + 1) * tokens_per_task).min(nq));
            block_with(
                isa, isa, q, &kt, &vb, p, key_mask, len, lenp, hdp, h, t0, t1, op,
            )
        });
    }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn prepare_body<F: Fma>(
    kv: Kv,
    p: &AttnParams,
    h: usize,
    j0: usize,
    j1: usize,
    lenp: usize,
    hdp: usize,
    kt: SendPtr<f32>,
    vb: SendPtr<f32>,
) {
    let hd = p.head_dim;
    let mut tmp = vec![0f32; hd];
    for j in j0..j1 {
        let at = kv.at(j, h, p.n_kv_heads, hd);
        widen::<F>(kv.k, at, &mut tmp);
        for (d, v) in tmp.iter().enumerate() {
            // SAFETY: column j of Kᵀ and row j of V belong to this task (keys j0..j1).
            unsafe { *kt.ptr().add(d * lenp + j) = *v };
        }
        widen::<F>(kv.v, at, unsafe { vb.slice(j * hdp, hd) });
    }
}
multiversion!(fn prepare / prepare_with = prepare_body;
    (kv: Kv, p: &AttnParams, h: usize, j0: usize, j1: usize, lenp: usize, hdp: usize, kt: SendPtr<f32>, vb: SendPtr<f32>));

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn block_body<F: Fma>(
    isa: Isa,
    q: &[f32],
    kt: &[f32],
    vb: &[f32],
    p: &AttnParams,
    key_mask: Option<&[bool]>,
    len: usize,
    lenp: usize,
    hdp: usize,
    h: usize,
    t0: usize,
    t1: usize,
    out: SendPtr<f32>,
) {
    let (hd, group) = (p.head_dim, p.n_heads / p.n_kv_heads);
    let rows = (t1 - t0) * group;
    let rp = rows;
    // Q rows of this block, pre-scaled, zero padded: row r = (token t0 + r / group, head h·group + r % group).
    let mut qs = vec![0f32; rp * hdp];
    let mut range = vec![(0usize, 0usize); rp];
    for r in 0..rows {
        let (t, g) = (t0 + r / group, r % group);
        let src = &q[(t * p.n_heads + h * group + g) * hd..][..hd];
        qs[r * hdp..r * hdp + hd]
            .iter_mut()
            .zip(src)
            .for_each(|(o, v)| *o = v * p.scale);
        range[r] = p.key_range(p.q_pos0 + t, len);
    }
    let lo = range[..rows].iter().map(|r| r.0).min().unwrap_or(0);
    let hi = range[..rows].iter().map(|r| r.1).max().unwrap_or(0);
    let mut s = vec![0f32; rp * BK];
    let mut o = vec![0f32; rp * hdp];
    let mut st = vec![RowState::EMPTY; rp];
    let mut kb0 = lo / BK * BK;
    while kb0 < hi {
        // S = Q·Kᵀ for keys kb0..kb0+64.
        // SAFETY: qs is rp × hdp, kt is hdp × lenp with kb0 + 64 ≤ lenp, s is rp × 64.
        unsafe {
            sgemm(
                isa,
                rp,
                BK,
                hdp,
                qs.as_ptr(),
                hdp,
                kt.as_ptr().add(kb0),
                lenp,
                s.as_mut_ptr(),
                BK,
                false,
            )
        };
        // Mask and online softmax, row by row; P overwrites S.
        for r in 0..rp {
            let srow = &mut s[r * BK..(r + 1) * BK];
            let (rlo, rhi) = if r < rows { range[r] } else { (0, 0) };
            mask_block(srow, kb0, rlo, rhi, key_mask);
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
            if corr != 1.0 {
                o[r * hdp..(r + 1) * hdp]
                    .iter_mut()
                    .for_each(|v| *v *= corr);
            }
        }
        // O += P·V.
        // SAFETY: s is rp × 64, vb is lenp × hdp with kb0 + 64 ≤ lenp, o is rp × hdp.
        unsafe {
            sgemm(
                isa,
                rp,
                hdp,
                BK,
                s.as_ptr(),
                BK,
                vb.as_ptr().add(kb0 * hdp),
                hdp,
                o.as_mut_ptr(),
                hdp,
                true,
            )
        };
        kb0 += BK;
    }
    for r in 0..rows {
        let (t, g) = (t0 + r / group, r % group);
        let inv = if st[r].l > 0.0 { 1.0 / st[r].l } else { 0.0 };
        // SAFETY: output rows of tokens t0..t1 for the heads of kv head h belong to this task.
        let dst = unsafe { out.slice((t * p.n_heads + h * group + g) * hd, hd) };
        dst.iter_mut()
            .zip(&o[r * hdp..r * hdp + hd])
            .for_each(|(d, v)| *d = v * inv);
    }
}
multiversion!(fn block / block_with = block_body;
    (isa_mk: Isa, q: &[f32], kt: &[f32], vb: &[f32], p: &AttnParams, key_mask: Option<&[bool]>, len: usize, lenp: usize, hdp: usize, h: usize, t0: usize, t1: usize, out: SendPtr<f32>));
