//! Hand-written inner loops of the decode schedule for AVX-512 and AVX2 (LLVM does not keep the
//! portable versions' accumulator arrays in registers). Called only from instances compiled with
//! those features (`Fma::AVX512` / `Fma::X86_SIMD`).
#![allow(clippy::needless_range_loop)] // register tiles read clearest with explicit indices

use std::arch::x86_64::*;

/// out[j] = q · k[j·stride .. +hd] for j < out.len(), four keys per pass (four FMA chains).
///
/// # Safety
/// AVX-512F/DQ present; `k` holds out.len() rows of hd floats at `stride`; q.len() ≥ hd.
#[inline(always)]
pub(super) unsafe fn scores_avx512(
    q: &[f32],
    k: *const f32,
    stride: usize,
    hd: usize,
    out: &mut [f32],
) {
    let n = out.len();
    let full = hd / 16;
    let tm: __mmask16 = ((1u32 << (hd % 16)) - 1) as u16;
    let qp = q.as_ptr();
    let mut j = 0;
    while j < n {
        let keys = (n - j).min(4);
        let mut acc = [_mm512_setzero_ps(); 4];
        let rp: [*const f32; 4] = std::array::from_fn(|i| k.add((j + i.min(keys - 1)) * stride));
        for c in 0..full {
            let qv = _mm512_loadu_ps(qp.add(16 * c));
            for i in 0..4 {
                acc[i] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(rp[i].add(16 * c)), acc[i]);
            }
        }
        if tm != 0 {
            let qv = _mm512_maskz_loadu_ps(tm, qp.add(16 * full));
            for i in 0..4 {
                acc[i] =
                    _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(tm, rp[i].add(16 * full)), acc[i]);
            }
        }
        for i in 0..keys {
            out[j + i] = _mm512_reduce_add_ps(acc[i]);
        }
        j += keys;
    }
}

/// o[d0..d0 + 16·V] += Σ_j p[j]·v[j·stride + d0 ..], V registers (the last one masked by `last`).
#[inline(always)]
unsafe fn add_pv_pass<const V: usize>(
    op: *mut f32,
    p: &[f32],
    v: *const f32,
    stride: usize,
    last: __mmask16,
) {
    let m = |i: usize| if i + 1 == V { last } else { 0xFFFF };
    let mut acc = [_mm512_setzero_ps(); V];
    for i in 0..V {
        acc[i] = _mm512_maskz_loadu_ps(m(i), op.add(16 * i));
    }
    for (j, &pj) in p.iter().enumerate() {
        let pv = _mm512_set1_ps(pj);
        let row = v.add(j * stride);
        for i in 0..V {
            acc[i] = _mm512_fmadd_ps(pv, _mm512_maskz_loadu_ps(m(i), row.add(16 * i)), acc[i]);
        }
    }
    for i in 0..V {
        _mm512_mask_storeu_ps(op.add(16 * i), m(i), acc[i]);
    }
}

/// o[..hd] += Σ_j p[j]·v[j·stride .. +hd]: up to 128 outputs in eight registers per pass.
///
/// # Safety
/// AVX-512F present; `v` holds p.len() rows of hd floats at `stride`; o.len() ≥ hd.
#[inline(always)]
pub(super) unsafe fn add_pv_avx512(
    o: &mut [f32],
    p: &[f32],
    v: *const f32,
    stride: usize,
    hd: usize,
) {
    let op = o.as_mut_ptr();
    let mut d0 = 0;
    while d0 < hd {
        let w = (hd - d0).min(128);
        let last: __mmask16 = if w.is_multiple_of(16) {
            0xFFFF
        } else {
            ((1u32 << (w % 16)) - 1) as u16
        };
        let (o, vv) = (op.add(d0), v.add(d0));
        match w.div_ceil(16) {
            8 => add_pv_pass::<8>(o, p, vv, stride, last),
            7 => add_pv_pass::<7>(o, p, vv, stride, last),
            6 => add_pv_pass::<6>(o, p, vv, stride, last),
            5 => add_pv_pass::<5>(o, p, vv, stride, last),
            4 => add_pv_pass::<4>(o, p, vv, stride, last),
            3 => add_pv_pass::<3>(o, p, vv, stride, last),
            2 => add_pv_pass::<2>(o, p, vv, stride, last),
            _ => add_pv_pass::<1>(o, p, vv, stride, last),
        }
        d0 += w;
    }
}

#[inline(always)]
unsafe fn hsum8(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// [`scores_avx512`] with AVX2 (8 lanes; the hd % 8 tail in scalar).
///
/// # Safety
/// AVX2 and FMA present; as [`scores_avx512`].
#[inline(always)]
pub(super) unsafe fn scores_avx2(
    q: &[f32],
    k: *const f32,
    stride: usize,
    hd: usize,
    out: &mut [f32],
) {
    let n = out.len();
    let full = hd / 8;
    let qp = q.as_ptr();
    let mut j = 0;
    while j < n {
        let keys = (n - j).min(4);
        let mut acc = [_mm256_setzero_ps(); 4];
        let rp: [*const f32; 4] = std::array::from_fn(|i| k.add((j + i.min(keys - 1)) * stride));
        for c in 0..full {
            let qv = _mm256_loadu_ps(qp.add(8 * c));
            for i in 0..4 {
                acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rp[i].add(8 * c)), acc[i]);
            }
        }
        for i in 0..keys {
            let mut s = hsum8(acc[i]);
            for d in 8 * full..hd {
                s += *qp.add(d) * *rp[i].add(d);
            }
            out[j + i] = s;
        }
        j += keys;
    }
}

/// [`add_pv_avx512`] with AVX2: up to 64 outputs in eight registers per pass.
///
/// # Safety
/// AVX2 and FMA present; as [`add_pv_avx512`].
#[inline(always)]
pub(super) unsafe fn add_pv_avx2(
    o: &mut [f32],
    p: &[f32],
    v: *const f32,
    stride: usize,
    hd: usize,
) {
    let op = o.as_mut_ptr();
    let mut d0 = 0;
    while d0 + 8 <= hd {
        let vecs = ((hd - d0) / 8).min(8);
        let mut acc = [_mm256_setzero_ps(); 8];
        for i in 0..8 {
            if i < vecs {
                acc[i] = _mm256_loadu_ps(op.add(d0 + 8 * i));
            }
        }
        for (j, &pj) in p.iter().enumerate() {
            let pv = _mm256_set1_ps(pj);
            let row = v.add(j * stride + d0);
            for i in 0..8 {
                if i < vecs {
                    acc[i] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(row.add(8 * i)), acc[i]);
                }
            }
        }
        for i in 0..8 {
            if i < vecs {
                _mm256_storeu_ps(op.add(d0 + 8 * i), acc[i]);
            }
        }
        d0 += 8 * vecs;
    }
    for d in d0..hd {
        *op.add(d) = p.iter().enumerate().fold(*op.add(d), |a, (j, &pj)| {
            pj.mul_add(*v.add(j * stride + d), a)
        });
    }
}
