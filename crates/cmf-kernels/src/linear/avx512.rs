//! AVX-512 (F/BW/VL/DQ + VNNI) matvec kernels. Matmul lives in `pack.rs`.
//!
//! The int8 products use `vpdpbusd` (u8 × s8, four products summed per i32 lane):
//! - q8: weights enter as `w ^ 0x80 = w + 128` (unsigned), the input as s8; the extra
//!   `128·Σ_b d_b·Σq_b` is the same for every row and is subtracted once at the end.
//! - q4: nibbles are already unsigned (q ∈ 0..15); the input is stored in `PairEvenOdd` order so
//!   the two 16-byte nibble runs of a group pair line up with it after a shift and a mask.

use std::arch::x86_64::*;

use crate::act::{LaneTables, QAct};
use crate::codec::{Q4Kind, Q4, Q8};
use cmf_format::Dtype;

use super::FloatW;

/// Loads 16 weights of a float codec as f32 (`mask` selects the valid lanes; the rest read 0).
#[inline(always)]
unsafe fn load16(dtype: Dtype, p: *const u8, mask: __mmask16) -> __m512 {
    match dtype {
        Dtype::F32 => _mm512_maskz_loadu_ps(mask, p as *const f32),
        Dtype::F16 => _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p as *const i16)),
        _ => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
            _mm256_maskz_loadu_epi16(mask, p as *const i16),
        ))),
    }
}

/// y[i] = row(r0+i) · x for float weights, four rows at a time.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx2")]
pub(crate) unsafe fn float_matvec(w: &FloatW, x: &[f32], r0: usize, y: &mut [f32]) {
    let cols = w.cols;
    let esz = if w.dtype == Dtype::F32 { 4 } else { 2 };
    let base = w.data.as_ptr();
    let full = cols / 16;
    let tail = cols % 16;
    let tmask: __mmask16 = ((1u32 << tail) - 1) as __mmask16;
    let mut i = 0;
    while i < y.len() {
        let nr = (y.len() - i).min(4);
        let mut acc = [_mm512_setzero_ps(); 4];
        let rp: [*const u8; 4] =
            std::array::from_fn(|k| base.add((r0 + i + k.min(nr - 1)) * cols * esz));
        for c in 0..full {
            let xv = _mm512_loadu_ps(x.as_ptr().add(c * 16));
            for k in 0..4 {
                let wv = load16(w.dtype, rp[k].add(c * 16 * esz), 0xFFFF);
                acc[k] = _mm512_fmadd_ps(wv, xv, acc[k]);
            }
        }
        if tail != 0 {
            let xv = _mm512_maskz_loadu_ps(tmask, x.as_ptr().add(full * 16));
            for k in 0..4 {
                let wv = load16(w.dtype, rp[k].add(full * 16 * esz), tmask);
                acc[k] = _mm512_fmadd_ps(wv, xv, acc[k]);
            }
        }
        for k in 0..nr {
            y[i + k] = _mm512_reduce_add_ps(acc[k]);
        }
        i += nr;
    }
}

/// q8 rows against one quantized input row, four rows at a time.
/// `c_total` = 128·Σ_b d_b·Σq_b (the offset correction, the same for every row).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c,avx2")]
pub(crate) unsafe fn q8_matvec(
    q: &Q8,
    a: &QAct,
    lanes: &LaneTables,
    c_total: f32,
    r0: usize,
    y: &mut [f32],
) {
    let cols = q.cols;
    let xq = a.qs.as_ptr();
    let dl = lanes.dl.as_ptr();
    let full = cols / 64;
    let tail = cols % 64;
    let tmask: __mmask64 = if tail == 0 { 0 } else { (1u64 << tail) - 1 };
    let flip = _mm512_set1_epi8(-128);
    let mut i = 0;
    while i < y.len() {
        let nr = (y.len() - i).min(4);
        let rp: [*const i8; 4] =
            std::array::from_fn(|k| q.q.as_ptr().add((r0 + i + k.min(nr - 1)) * cols) as *const i8);
        let mut acc = [_mm512_setzero_ps(); 4];
        for c in 0..full {
            let xv = _mm512_loadu_si512(xq.add(c * 64) as *const _);
            let d = _mm512_loadu_ps(dl.add(c * 16));
            for k in 0..4 {
                let wv = _mm512_xor_si512(_mm512_loadu_si512(rp[k].add(c * 64) as *const _), flip);
                let s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv);
                acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), d, acc[k]);
            }
        }
        if tail != 0 {
            let xv = _mm512_loadu_si512(xq.add(full * 64) as *const _);
            let d = _mm512_loadu_ps(dl.add(full * 16));
            for k in 0..4 {
                // Bytes past the row read as 0 → 0x80 after the flip, against zero padding: no effect.
                let wv =
                    _mm512_xor_si512(_mm512_maskz_loadu_epi8(tmask, rp[k].add(full * 64)), flip);
                let s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv);
                acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), d, acc[k]);
            }
        }
        for k in 0..nr {
            y[i + k] = q.scale(r0 + i + k) * (_mm512_reduce_add_ps(acc[k]) - c_total);
        }
        i += nr;
    }
}

/// Two q4 groups (64 weights) as 64 unsigned bytes in `PairEvenOdd` order:
/// [g0 low nibbles | g1 low | g0 high | g1 high].
#[inline(always)]
unsafe fn q4_pair(kind: Q4Kind, p: *const u8, last_single: bool) -> __m512i {
    let both: __m256i = if kind == Q4Kind::Tiled {
        let g0 = _mm_loadu_si128(p as *const __m128i);
        let g1 = if last_single {
            _mm_setzero_si128()
        } else {
            _mm_loadu_si128(p.add(18) as *const __m128i)
        };
        _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(g0), g1)
    } else if last_single {
        _mm256_maskz_loadu_epi8(0xFFFF, p as *const i8)
    } else {
        _mm256_loadu_si256(p as *const __m256i)
    };
    let z = _mm512_broadcast_i64x4(both);
    let z = _mm512_mask_srli_epi16::<4>(z, 0xFFFF_0000, z);
    _mm512_and_si512(z, _mm512_set1_epi8(0x0F))
}

/// q4 rows (cols % 32 == 0) against one `PairEvenOdd` input row.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c,avx2")]
pub(crate) unsafe fn q4_matvec(q: &Q4, a: &QAct, lanes: &LaneTables, r0: usize, y: &mut [f32]) {
    let gpr = q.gpr;
    let pairs = gpr.div_ceil(2);
    let stride = q.stride();
    let xq = a.qs.as_ptr();
    let (dl, cl) = (lanes.dl.as_ptr(), lanes.cl.as_ptr());
    // Group scales of the current row, plus a zero for the phantom partner of an odd last group.
    let mut scales = vec![0f32; pairs * 2];
    let spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
    for (i, yr) in y.iter_mut().enumerate() {
        let r = r0 + i;
        q.row_scales(r, &mut scales);
        let row = q.data.as_ptr().add(q.row_offset(r));
        let mut acc0 = _mm512_setzero_ps();
        let mut acc1 = _mm512_setzero_ps();
        for p in 0..pairs {
            let single = 2 * p + 1 == gpr;
            let wv = q4_pair(q.kind, row.add(2 * p * stride), single);
            let s = _mm512_dpbusd_epi32(
                _mm512_setzero_si512(),
                wv,
                _mm512_loadu_si512(xq.add(p * 64) as *const _),
            );
            let t = _mm512_fmsub_ps(
                _mm512_cvtepi32_ps(s),
                _mm512_loadu_ps(dl.add(p * 16)),
                _mm512_loadu_ps(cl.add(p * 16)),
            );
            // (s0, s1) into the low 64 bits, then spread to [s0×4, s1×4, s0×4, s1×4].
            let pair =
                _mm_castsi128_ps(_mm_loadl_epi64(scales.as_ptr().add(2 * p) as *const __m128i));
            let sv = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(pair));
            if p % 2 == 0 {
                acc0 = _mm512_fmadd_ps(t, sv, acc0);
            } else {
                acc1 = _mm512_fmadd_ps(t, sv, acc1);
            }
        }
        *yr = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    }
}

/// Register tile of the int8 matmul: T input rows × 32 weight rows (two 16-lane halves).
/// Per 32-block: eight `vpdpbusd` steps into i32, then `s_w·(d_x·I − c_x)` into f32.
///
/// # Safety
/// `pack`/`sc` hold a full panel for `a.nb` blocks; `qs`, `d`, `c` point at the tile's first input
/// row inside `a`; `y` has T rows at stride `ldy` with the masked lanes writable.
#[inline(always)]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
unsafe fn gemm_tile<const T: usize>(
    pack: *const u8,
    sc: *const f32,
    nb: usize,
    qs: *const i8,
    kp: usize,
    d: *const f32,
    c: *const f32,
    y: *mut f32,
    ldy: usize,
    m0: __mmask16,
    m1: __mmask16,
) {
    let mut acc = [[_mm512_setzero_ps(); 2]; T];
    for b in 0..nb {
        let mut ai = [[_mm512_setzero_si512(); 2]; T];
        for kq in b * 8..b * 8 + 8 {
            let w0 = _mm512_loadu_si512(pack.add(kq * 128) as *const _);
            let w1 = _mm512_loadu_si512(pack.add(kq * 128 + 64) as *const _);
            for t in 0..T {
                let xb = _mm512_set1_epi32(std::ptr::read_unaligned(
                    qs.add(t * kp + kq * 4) as *const i32
                ));
                ai[t][0] = _mm512_dpbusd_epi32(ai[t][0], w0, xb);
                ai[t][1] = _mm512_dpbusd_epi32(ai[t][1], w1, xb);
            }
        }
        let s0 = _mm512_loadu_ps(sc.add(b * 32));
        let s1 = _mm512_loadu_ps(sc.add(b * 32 + 16));
        for t in 0..T {
            let dv = _mm512_set1_ps(*d.add(t * nb + b));
            let cv = _mm512_set1_ps(*c.add(t * nb + b));
            acc[t][0] = _mm512_fmadd_ps(
                _mm512_fmsub_ps(_mm512_cvtepi32_ps(ai[t][0]), dv, cv),
                s0,
                acc[t][0],
            );
            acc[t][1] = _mm512_fmadd_ps(
                _mm512_fmsub_ps(_mm512_cvtepi32_ps(ai[t][1]), dv, cv),
                s1,
                acc[t][1],
            );
        }
    }
    for t in 0..T {
        _mm512_mask_storeu_ps(y.add(t * ldy), m0, acc[t][0]);
        _mm512_mask_storeu_ps(y.add(t * ldy + 16), m1, acc[t][1]);
    }
}

/// All input rows of `a` against one packed 32-row panel; writes Y[t, 0..nr) at `y + t·ldy`.
///
/// # Safety
/// As [`gemm_tile`], for every input row; the CPU must have AVX-512 VNNI.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c,avx2")]
pub(crate) unsafe fn gemm_panel(
    pack: &[u8],
    sc: &[f32],
    a: &QAct,
    n: usize,
    y: *mut f32,
    ldy: usize,
    nr: usize,
) {
    const T: usize = 6;
    let m0: __mmask16 = if nr >= 16 {
        0xFFFF
    } else {
        ((1u32 << nr) - 1) as u16
    };
    let m1: __mmask16 = if nr >= 32 {
        0xFFFF
    } else if nr <= 16 {
        0
    } else {
        ((1u32 << (nr - 16)) - 1) as u16
    };
    let (kp, nb) = (a.kp, a.nb);
    let (pk, s) = (pack.as_ptr(), sc.as_ptr());
    let mut t = 0;
    while t < n {
        let rows = (n - t).min(T);
        let (qs, d, c, yt) = (
            a.qs.as_ptr().add(t * kp),
            a.d.as_ptr().add(t * nb),
            a.c.as_ptr().add(t * nb),
            y.add(t * ldy),
        );
        match rows {
            6 => gemm_tile::<6>(pk, s, nb, qs, kp, d, c, yt, ldy, m0, m1),
            5 => gemm_tile::<5>(pk, s, nb, qs, kp, d, c, yt, ldy, m0, m1),
            4 => gemm_tile::<4>(pk, s, nb, qs, kp, d, c, yt, ldy, m0, m1),
            3 => gemm_tile::<3>(pk, s, nb, qs, kp, d, c, yt, ldy, m0, m1),
            2 => gemm_tile::<2>(pk, s, nb, qs, kp, d, c, yt, ldy, m0, m1),
            _ => gemm_tile::<1>(pk, s, nb, qs, kp, d, c, yt, ldy, m0, m1),
        }
        t += rows;
    }
}
