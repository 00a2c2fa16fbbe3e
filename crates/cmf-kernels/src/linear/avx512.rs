//! AVX-512 (F/BW/VL/DQ + VNNI) kernels: the matvecs, the q8 strips for a few input rows and the
//! packed GEMM's register tile (its panels are packed in `gemm.rs`).
//!
//! The int8 products use `vpdpbusd` (u8 × s8, four products summed per i32 lane):
//! - q8: weights enter as `w ^ 0x80 = w + 128` (unsigned), the input as s8; the extra
//!   `128·Σ_b d_b·Σq_b` is the same for every row and is subtracted once at the end.
//! - q4: nibbles are already unsigned (q ∈ 0..15); the input is stored in `QuadEvenOdd` order so
//!   64 nibble bytes (four groups) line up with it after a mask (low nibbles) and a shift (high).

#![allow(clippy::needless_range_loop)] // register tiles read clearest with explicit indices

use std::arch::x86_64::*;

use crate::act::{LaneTables, QAct};
use crate::codec::{q4tp_code_stride, q4tp_ladder, q4tp_planes, Q4Kind, Q4, Q8};
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

/// y[i] = row(r0+i) · x for float weights, one row at a time (one sequential stream, as for
/// q8), two accumulators.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx2")]
pub(crate) unsafe fn float_matvec(w: &FloatW, x: &[f32], r0: usize, y: &mut [f32]) {
    let cols = w.cols;
    let esz = if w.dtype == Dtype::F32 { 4 } else { 2 };
    let full = cols / 16;
    let tail = cols % 16;
    let tmask: __mmask16 = ((1u32 << tail) - 1) as __mmask16;
    let xp = x.as_ptr();
    for (i, yr) in y.iter_mut().enumerate() {
        let row = w.data.as_ptr().add((r0 + i) * cols * esz);
        let (mut a0, mut a1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let mut c = 0;
        while c + 2 <= full {
            a0 = _mm512_fmadd_ps(
                load16(w.dtype, row.add(c * 16 * esz), 0xFFFF),
                _mm512_loadu_ps(xp.add(c * 16)),
                a0,
            );
            a1 = _mm512_fmadd_ps(
                load16(w.dtype, row.add((c + 1) * 16 * esz), 0xFFFF),
                _mm512_loadu_ps(xp.add((c + 1) * 16)),
                a1,
            );
            c += 2;
        }
        if c < full {
            a0 = _mm512_fmadd_ps(
                load16(w.dtype, row.add(c * 16 * esz), 0xFFFF),
                _mm512_loadu_ps(xp.add(c * 16)),
                a0,
            );
        }
        if tail != 0 {
            let xv = _mm512_maskz_loadu_ps(tmask, xp.add(full * 16));
            a1 = _mm512_fmadd_ps(load16(w.dtype, row.add(full * 16 * esz), tmask), xv, a1);
        }
        *yr = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    }
}

/// One q8 row · input: `U` chunks of 64 bytes per step in independent accumulators.
#[inline(always)]
unsafe fn q8_row<const U: usize>(
    row: *const i8,
    xq: *const i8,
    dl: *const f32,
    full: usize,
    tail: usize,
) -> f32 {
    let flip = _mm512_set1_epi8(-128);
    let mut acc = [_mm512_setzero_ps(); U];
    let step = |acc: &mut __m512, c: usize, wv: __m512i| {
        let s = _mm512_dpbusd_epi32(
            _mm512_setzero_si512(),
            _mm512_xor_si512(wv, flip),
            _mm512_loadu_si512(xq.add(c * 64) as *const _),
        );
        *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_loadu_ps(dl.add(c * 16)), *acc);
    };
    let mut c = 0;
    while c + U <= full {
        for u in 0..U {
            step(
                &mut acc[u],
                c + u,
                _mm512_loadu_si512(row.add((c + u) * 64) as *const _),
            );
        }
        c += U;
    }
    while c < full {
        step(
            &mut acc[0],
            c,
            _mm512_loadu_si512(row.add(c * 64) as *const _),
        );
        c += 1;
    }
    if tail != 0 {
        // Bytes past the row read as 0 → 0x80 after the flip, against zero padding: no effect.
        step(
            &mut acc[0],
            full,
            _mm512_maskz_loadu_epi8((1u64 << tail) - 1, row.add(full * 64)),
        );
    }
    let mut sum = acc[0];
    for a in &acc[1..] {
        sum = _mm512_add_ps(sum, *a);
    }
    _mm512_reduce_add_ps(sum)
}

/// q8 rows against quantized input row `t` (whose lane tables are `lanes`), one row at a time:
/// consecutive rows are consecutive memory, so the weights are read as one sequential stream
/// (measured with `kbench matvec`: interleaving 4 rows was 25–75 % slower from DRAM).
/// `c_total` = 128·Σ_b d_b·Σq_b (the offset correction, the same for every row).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c,avx2")]
pub(crate) unsafe fn q8_matvec(
    q: &Q8,
    a: &QAct,
    t: usize,
    lanes: &LaneTables,
    c_total: f32,
    r0: usize,
    y: &mut [f32],
) {
    let cols = q.cols;
    let xq = a.qs.as_ptr().add(t * a.kp);
    let dl = lanes.dl.as_ptr();
    let (full, tail) = (cols / 64, cols % 64);
    for (i, yr) in y.iter_mut().enumerate() {
        let r = r0 + i;
        let row = q.q.as_ptr().add(r * cols) as *const i8;
        touch_ahead(row, cols, PAGE_TOUCH_DISTANCE);
        let dot = q8_row::<2>(row, xq, dl, full, tail);
        *yr = q.scale(r) * (dot - c_total);
    }
}

/// Weight rows per strip of [`q8_strip_matmul`]: one per 32-bit lane.
const STRIP: usize = 16;

/// Input rows per pass over a strip: one f32 accumulator each, beside the strip's eight
/// transposed quads.
const STRIP_TILE: usize = 8;

/// Lane of weight row r of a strip after [`transpose_block`] (its own inverse: also the row of
/// lane l).
const LANE_OF_ROW: [i32; 16] = [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15];

/// Block `b` (32 bytes) of the 16 rows at `rows[j]`, flipped to w + 128 and transposed: `v[q]`
/// holds quad q (bytes 4q..4q + 4 of the block) of every row, one row per 32-bit lane in the
/// order [`LANE_OF_ROW`]. `len` bytes of the block are inside the rows (32 but for a row tail);
/// the rest read as w = 0.
#[inline(always)]
unsafe fn transpose_block(rows: &[*const i8; STRIP], b: usize, len: usize) -> [__m512i; 8] {
    let mask: __mmask32 = if len >= 32 { !0 } else { (1u32 << len) - 1 };
    let flip = _mm512_set1_epi8(-128);
    let load = |j: usize| _mm256_maskz_loadu_epi8(mask, rows[j].add(32 * b));
    // r[j]: row j in the low 256 bits, row j + 8 in the high 256 bits.
    let mut r = [_mm512_setzero_si512(); 8];
    for j in 0..8 {
        r[j] = _mm512_xor_si512(
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(load(j)), load(j + 8)),
            flip,
        );
    }
    // 4×4 dword transposes inside each 128-bit lane: u[i] (i < 4) holds dword i of rows 0..3
    // (and 8..11) per lane, u[4 + i] the same of rows 4..7 (12..15).
    let mut u = [_mm512_setzero_si512(); 8];
    for h in 0..2 {
        let a = 4 * h;
        let t0 = _mm512_unpacklo_epi32(r[a], r[a + 1]);
        let t1 = _mm512_unpackhi_epi32(r[a], r[a + 1]);
        let t2 = _mm512_unpacklo_epi32(r[a + 2], r[a + 3]);
        let t3 = _mm512_unpackhi_epi32(r[a + 2], r[a + 3]);
        u[a] = _mm512_unpacklo_epi64(t0, t2);
        u[a + 1] = _mm512_unpackhi_epi64(t0, t2);
        u[a + 2] = _mm512_unpacklo_epi64(t1, t3);
        u[a + 3] = _mm512_unpackhi_epi64(t1, t3);
    }
    // Lanes 0 and 2 of a u hold quads 0..3 of the block, lanes 1 and 3 quads 4..7: gather
    // each quad's four 128-bit pieces into one vector.
    let mut v = [_mm512_setzero_si512(); 8];
    for i in 0..4 {
        v[i] = _mm512_shuffle_i64x2::<0x88>(u[i], u[4 + i]);
        v[4 + i] = _mm512_shuffle_i64x2::<0xDD>(u[i], u[4 + i]);
    }
    v
}

/// Prefetches the share of block step `b` of the `len` bytes at `p`: 8 lines (16 rows × 32 bytes
/// per step, so a strip's steps cover the next strip exactly).
#[inline(always)]
unsafe fn prefetch_next_strip(p: *const i8, len: usize, b: usize) {
    for k in 0..8 {
        let at = (8 * b + k) * 64;
        if at < len {
            _mm_prefetch::<_MM_HINT_T0>(p.add(at));
        }
    }
}

/// `T` inputs against one transposed block: per input, the block's integer dot for all 16 rows
/// (exact in i32), then `acc += I·d_b`.
#[inline(always)]
unsafe fn strip_block_step<const T: usize>(
    acc: &mut [__m512; T],
    v: &[__m512i; 8],
    xq: &[*const i8; T],
    d: &[*const f32; T],
    b: usize,
) {
    for t in 0..T {
        let x = xq[t].add(32 * b) as *const i32;
        let bc = |q: usize| _mm512_set1_epi32(std::ptr::read_unaligned(x.add(q)));
        let mut i0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v[0], bc(0));
        let mut i1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v[1], bc(1));
        for q in (2..8).step_by(2) {
            i0 = _mm512_dpbusd_epi32(i0, v[q], bc(q));
            i1 = _mm512_dpbusd_epi32(i1, v[q + 1], bc(q + 1));
        }
        acc[t] = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1)),
            _mm512_set1_ps(*d[t].add(b)),
            acc[t],
        );
    }
}

/// q8 weight rows `r0..r0 + nr` against every quantized input row of `a` (offset corrections
/// `c_total`, one per input): `Y[t, r0 + i]` at `y + t·ldy + i`. Strips of 16 rows are
/// transposed block by block in registers ([`transpose_block`]), so that one `vpdpbusd` sums
/// four products for 16 rows of one input with the input's quad broadcast, and a block's
/// integer dot is converted to f32 once instead of once per 64 bytes. The f32 sum runs block by
/// block, not in the matvec's lane order: results match the matvec to f32 rounding, not bit for
/// bit, and do not depend on how many inputs there are.
///
/// # Safety
/// The CPU must have AVX-512 VNNI; `y` must be writable at `t·ldy + i` for every input t and
/// i < nr.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c,avx2")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn q8_strip_matmul(
    q: &Q8,
    a: &QAct,
    c_total: &[f32],
    r0: usize,
    nr: usize,
    y: *mut f32,
    ldy: usize,
) {
    let n = c_total.len();
    let cols = q.cols;
    let blocks = cols.div_ceil(32);
    let xq: Vec<*const i8> = (0..n).map(|t| a.qs.as_ptr().add(t * a.kp)).collect();
    let d: Vec<*const f32> = (0..n).map(|t| a.d.as_ptr().add(t * a.nb)).collect();
    let idx = _mm512_loadu_si512(LANE_OF_ROW.as_ptr() as *const _);
    let mut s0 = 0;
    while s0 < nr {
        let m = (nr - s0).min(STRIP);
        let first = r0 + s0;
        // Lanes past the last row repeat it (read, never stored).
        let rows: [*const i8; STRIP] =
            std::array::from_fn(|j| q.q.as_ptr().add((first + j.min(m - 1)) * cols) as *const i8);
        touch_ahead(rows[0], m * cols, PAGE_TOUCH_DISTANCE);
        // The next strip (contiguous after this one), a line at a time in address order while
        // this one runs: the transposes read 16 rows at once, which the hardware prefetchers
        // do not follow from memory.
        let next = rows[0].wrapping_add(m * cols);
        let next_len = (nr - s0 - m).min(STRIP) * cols;
        let mask: __mmask16 = if m == STRIP {
            0xFFFF
        } else {
            ((1u32 << m) - 1) as u16
        };
        let scales = _mm512_permutexvar_ps(
            idx,
            _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(
                mask,
                q.scales.as_ptr().add(2 * first) as *const i16,
            )),
        );
        let mut t0 = 0;
        while t0 < n {
            let k = (n - t0).min(STRIP_TILE);
            macro_rules! tile {
                ($T:literal) => {{
                    let x: &[*const i8; $T] = xq[t0..t0 + $T].try_into().expect("tile width");
                    let dt: &[*const f32; $T] = d[t0..t0 + $T].try_into().expect("tile width");
                    let mut acc = [_mm512_setzero_ps(); $T];
                    for b in 0..blocks {
                        if t0 == 0 {
                            prefetch_next_strip(next, next_len, b);
                        }
                        let v = transpose_block(&rows, b, (cols - 32 * b).min(32));
                        strip_block_step::<$T>(&mut acc, &v, x, dt, b);
                    }
                    for t in 0..$T {
                        let c = _mm512_set1_ps(c_total[t0 + t]);
                        let res = _mm512_mul_ps(_mm512_sub_ps(acc[t], c), scales);
                        _mm512_mask_storeu_ps(
                            y.add((t0 + t) * ldy + s0),
                            mask,
                            _mm512_permutexvar_ps(idx, res),
                        );
                    }
                }};
            }
            match k {
                8 => tile!(8),
                7 => tile!(7),
                6 => tile!(6),
                5 => tile!(5),
                4 => tile!(4),
                3 => tile!(3),
                2 => tile!(2),
                _ => tile!(1),
            }
            t0 += k;
        }
        s0 += STRIP;
    }
}

/// How far ahead of the row being read [`touch_ahead`] reaches. Measured on Qwen3-0.6B q8_row
/// decode (docs/kernels.md): 64–512 KiB all gain 15–25 % over none, 256 KiB was best at 2
/// threads; touching every line instead (1–32 KiB ahead) was slower than no prefetch at all.
const PAGE_TOUCH_DISTANCE: usize = 256 << 10;

/// Prefetches one cache line per 4 KiB of the `len` bytes at `p + dist`: the weight stream
/// `dist` bytes ahead has its pages' translations and first lines ready when the demand loads
/// arrive (the hardware prefetchers do not cross 4 KiB pages).
/// A hint only: `wrapping_add` because the address may lie past the matrix (the prefetch of
/// an unmapped or foreign address is dropped, never faults).
#[inline(always)]
unsafe fn touch_ahead(p: *const i8, len: usize, dist: usize) {
    let mut off = 0;
    while off < len {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off + dist));
        off += 4096;
    }
}

/// Layout of a q4 row for the matvec kernel (const parameter, so the inner loop has no branch
/// on it).
const BLOCK: u8 = 0;
const TILED: u8 = 1;
const TP: u8 = 2;

/// Four groups' (s0, s1, s2, s3) as f32, spread to [s0×4, s1×4, s2×4, s3×4].
#[inline(always)]
unsafe fn spread4(s: __m128) -> __m512 {
    let idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(s))
}

/// Σ over four groups (quad `c` of the row): s_w·(d_x·I − c_x) per lane, added to `acc`.
/// `groups` < 4 only for a row's last quad (the rest read as zero).
/// Scales: q4_block reads 4 f16 from the scale plane (`sc` = the row's f16 scales), q4_tiled
/// assembles the 4 tile headers' f16 in a scalar register, q4tp reads the row's f32 scales
/// decoded ahead of time (`sc` = f32 buffer).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn q4_quad_step<const KIND: u8>(
    row: *const u8,
    c: usize,
    groups: usize,
    xq: *const i8,
    dl: *const f32,
    cl: *const f32,
    sc: *const u8,
    acc: __m512,
) -> __m512 {
    let mask = _mm512_set1_epi8(0x0F);
    let (z, scales) = if KIND == TILED {
        // row points at the first tile's header; nibbles start 2 bytes in.
        let p = row.add(c * 72);
        let g = |i: usize| {
            if i < groups {
                _mm_loadu_si128(p.add(18 * i + 2) as *const __m128i)
            } else {
                _mm_setzero_si128()
            }
        };
        let lo = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(g(0)), g(1));
        let hi = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(g(2)), g(3));
        let h = |i: usize| {
            if i < groups {
                std::ptr::read_unaligned(p.add(18 * i) as *const u16) as u64
            } else {
                0
            }
        };
        let bits = h(0) | h(1) << 16 | h(2) << 32 | h(3) << 48;
        (
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi),
            _mm_cvtph_ps(_mm_cvtsi64_si128(bits as i64)),
        )
    } else {
        let z = if groups >= 4 {
            _mm512_loadu_si512(row.add(c * 64) as *const _)
        } else {
            _mm512_maskz_loadu_epi8((1u64 << (16 * groups)) - 1, row.add(c * 64) as *const i8)
        };
        let m = ((1u32 << groups) - 1) as u8;
        let scales = if KIND == BLOCK {
            _mm_cvtph_ps(_mm_maskz_loadu_epi16(m, sc.add(8 * c) as *const i16))
        } else {
            _mm_maskz_loadu_ps(m, sc.add(16 * c) as *const f32)
        };
        (z, scales)
    };
    let lo = _mm512_and_si512(z, mask);
    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(z), mask);
    let xe = _mm512_loadu_si512(xq.add(128 * c) as *const _);
    let xo = _mm512_loadu_si512(xq.add(128 * c + 64) as *const _);
    let s = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xe), hi, xo);
    let t = _mm512_fmsub_ps(
        _mm512_cvtepi32_ps(s),
        _mm512_loadu_ps(dl.add(16 * c)),
        _mm512_loadu_ps(cl.add(16 * c)),
    );
    _mm512_fmadd_ps(t, spread4(scales), acc)
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn q4_row_dot<const KIND: u8>(
    row: *const u8,
    gpr: usize,
    xq: *const i8,
    dl: *const f32,
    cl: *const f32,
    sc: *const u8,
) -> f32 {
    let full = gpr / 4;
    let mut acc0 = _mm512_setzero_ps();
    let mut acc1 = _mm512_setzero_ps();
    let mut c = 0;
    while c + 2 <= full {
        acc0 = q4_quad_step::<KIND>(row, c, 4, xq, dl, cl, sc, acc0);
        acc1 = q4_quad_step::<KIND>(row, c + 1, 4, xq, dl, cl, sc, acc1);
        c += 2;
    }
    if c < full {
        acc0 = q4_quad_step::<KIND>(row, c, 4, xq, dl, cl, sc, acc0);
        c += 1;
    }
    if !gpr.is_multiple_of(4) {
        acc1 = q4_quad_step::<KIND>(row, c, gpr % 4, xq, dl, cl, sc, acc1);
    }
    _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1))
}

/// q4tp row `r`'s group scales: the row's 32-rung ladder (`codec::q4tp_ladder`, bit-exact with
/// the format's definition), then 16 codes at a time — 16 × 5 bits is 10 whole bytes — shifted
/// out of two 64-bit words and looked up with one two-register permute. `codes` is scratch of
/// stride + 16 bytes (so the 8-byte reads never leave it); `out` holds ⌈gpr/16⌉·16 floats.
#[inline(always)]
unsafe fn q4tp_row_scales(q: &Q4, r: usize, codes: &mut [u8], out: &mut [f32]) {
    let gpr = q.gpr;
    let stride = q4tp_code_stride(gpr);
    let (params, plane) = q4tp_planes(q.data, q.rows, gpr);
    let ladder = q4tp_ladder(params, r);
    codes[..stride].copy_from_slice(&plane[r * stride..(r + 1) * stride]);
    let (lad_lo, lad_hi) = (
        _mm512_loadu_ps(ladder.as_ptr()),
        _mm512_loadu_ps(ladder.as_ptr().add(16)),
    );
    let shifts = _mm512_setr_epi64(0, 5, 10, 15, 20, 25, 30, 35);
    let five = _mm512_set1_epi32(31);
    for k in 0..gpr.div_ceil(16) {
        let b = codes.as_ptr().add(10 * k);
        let w0 = _mm512_set1_epi64(std::ptr::read_unaligned(b as *const i64));
        let w1 = _mm512_set1_epi64(std::ptr::read_unaligned(b.add(5) as *const i64));
        let c0 = _mm512_cvtepi64_epi32(_mm512_srlv_epi64(w0, shifts));
        let c1 = _mm512_cvtepi64_epi32(_mm512_srlv_epi64(w1, shifts));
        let idx = _mm512_and_si512(
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(c0), c1),
            five,
        );
        _mm512_storeu_ps(
            out.as_mut_ptr().add(16 * k),
            _mm512_permutex2var_ps(lad_lo, idx, lad_hi),
        );
    }
}

/// q4 rows (cols % 32 == 0) against `QuadEvenOdd` input row `t` (lane tables `lanes`). Per four groups: one 64-byte
/// nibble load (four 16-byte loads for q4_tiled), low and high halves through two `vpdpbusd`
/// into the same lanes, then `s_w·(d_x·I − c_x)` per lane.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c,avx2")]
pub(crate) unsafe fn q4_matvec(
    q: &Q4,
    a: &QAct,
    t: usize,
    lanes: &LaneTables,
    r0: usize,
    y: &mut [f32],
) {
    let gpr = q.gpr;
    let xq = a.qs.as_ptr().add(t * a.kp);
    let (dl, cl) = (lanes.dl.as_ptr(), lanes.cl.as_ptr());
    match q.kind {
        Q4Kind::Block => {
            let plane = q.data.as_ptr().add(q.rows * gpr * 16);
            for (i, yr) in y.iter_mut().enumerate() {
                let r = r0 + i;
                *yr = q4_row_dot::<BLOCK>(
                    q.data.as_ptr().add(r * gpr * 16),
                    gpr,
                    xq,
                    dl,
                    cl,
                    plane.add(r * gpr * 2),
                );
            }
        }
        Q4Kind::Tiled => {
            for (i, yr) in y.iter_mut().enumerate() {
                let r = r0 + i;
                *yr = q4_row_dot::<TILED>(
                    q.data.as_ptr().add(r * gpr * 18),
                    gpr,
                    xq,
                    dl,
                    cl,
                    std::ptr::null(),
                );
            }
        }
        Q4Kind::Tp => {
            let mut scales = vec![0f32; gpr.div_ceil(16) * 16];
            let mut codes = vec![0u8; q4tp_code_stride(gpr) + 16];
            for (i, yr) in y.iter_mut().enumerate() {
                let r = r0 + i;
                q4tp_row_scales(q, r, &mut codes, &mut scales);
                *yr = q4_row_dot::<TP>(
                    q.data.as_ptr().add(r * gpr * 16),
                    gpr,
                    xq,
                    dl,
                    cl,
                    scales.as_ptr() as *const u8,
                );
            }
        }
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
