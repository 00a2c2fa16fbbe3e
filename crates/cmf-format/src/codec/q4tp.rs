//! **q4tp** (dtype 15): q4_tiled's nibbles with each tile's scale replaced by a 5-bit rung on a
//! per-row geometric ladder; ≈ 4.17 bits/weight instead of 4.5. 2-D, `cols % 32 == 0`,
//! `gpr = cols / 32` groups per row.
//!
//! ```text
//! [nibbles: rows·gpr·16 B][params: rows × (f16 lo, f16 step)][codes: rows × ⌈gpr·5/8⌉ B]
//! ```
//! Codes are 5-bit fields, LSB-first, each row's codes starting on a byte boundary. Tile `g`
//! of row `r` has scale `ladder[code]`, where `ladder[0] = 2^lo` and `ladder[c] =
//! ladder[c−1]·2^step` — computed exactly that way (one `exp2` per term, 31 multiplies) so
//! every decoder lands on the same f32 bits (`cortiq_core::quant::q4tp_ladder`). `exp2` is the
//! platform libm's: bit-exactness with the reference holds on the same platform.
//!
//! Encoder (spec §3.2): per tile the q4 scale `f16(absmax/7)` in log2; `lo` = the row's
//! smallest live log-scale and `step` = span/31, both rounded to f16 *before* codes are
//! chosen (step nudged up by single f16 ulps until rung 31 covers the largest scale);
//! all-zero tiles are left out of the span. The nearest rung is the start; rungs −2..+1 around
//! it are tried and the one with the least squared tile error is kept (lowest rung on ties).
//! Nibbles are quantized against the chosen rung: `q = round_half_even(w/s)` in [−8, 7].
//!
//! Bound: for an element of a tile with rung scale `s`, `|w − ŵ| ≤ max(s/2, |w| − 7s)` (the
//! second term only when a rung below absmax/7 clips the tile's largest values); each tile's
//! squared error is at most that of its nearest rung. On Gaussian rows the RMS error is within
//! a few percent of q4_tiled's (test `q4tp_rms_close_to_q4_tiled`).

use super::{f16_scale, f16_to_f32, f32_to_f16, for_each_unit, CodecError};
use crate::dtype::Q4_GROUP;

/// Highest rung: 5-bit codes.
pub const MAX_CODE: usize = 31;

/// Bytes of codes per row.
pub fn code_stride(groups_per_row: usize) -> usize {
    (groups_per_row * 5).div_ceil(8)
}

/// `(params_offset, codes_offset, code_stride)` inside a q4tp payload.
pub fn sections(rows: usize, cols: usize) -> (usize, usize, usize) {
    let gpr = cols / Q4_GROUP;
    let nib = rows * gpr * 16;
    (nib, nib + rows * 4, code_stride(gpr))
}

/// The 32 scales of a row from its f16 `lo` and `step` (log2 units).
pub fn ladder(lo_bits: u16, step_bits: u16) -> [f32; 32] {
    let ratio = f16_to_f32(step_bits).exp2();
    let mut t = [0f32; 32];
    t[0] = f16_to_f32(lo_bits).exp2();
    for c in 1..32 {
        t[c] = t[c - 1] * ratio;
    }
    t
}

/// Tile `g`'s 5-bit code in one row's code bytes.
#[inline]
pub fn code(row_codes: &[u8], g: usize) -> usize {
    let (byte, shift) = (g * 5 / 8, g * 5 % 8);
    let lo = row_codes[byte] as u16;
    let hi = row_codes.get(byte + 1).copied().unwrap_or(0) as u16;
    (((lo | (hi << 8)) >> shift) & 0x1F) as usize
}

fn put_code(row_codes: &mut [u8], g: usize, code: usize) {
    let (byte, shift) = (g * 5 / 8, g * 5 % 8);
    let v = ((code & 0x1F) as u16) << shift;
    row_codes[byte] |= v as u8;
    if shift > 3 {
        row_codes[byte + 1] |= (v >> 8) as u8;
    }
}

fn quantize(v: f32, s: f32) -> f32 {
    (v / s).round_ties_even().clamp(-8.0, 7.0)
}

fn tile_sq_error(tile: &[f32], s: f32) -> f32 {
    tile.iter().map(|&v| (v - quantize(v, s) * s).powi(2)).sum()
}

/// Encodes one row (`cols` values, a multiple of 32): its nibbles to `nib`, its (f16 lo,
/// f16 step) to `params`, its 5-bit codes into `row_codes` (zeroed, `code_stride` bytes).
/// `first` is the row's first element index (for errors).
pub(crate) fn encode_row(
    row: &[f32],
    first: usize,
    nib: &mut Vec<u8>,
    params: &mut Vec<u8>,
    row_codes: &mut [u8],
) -> Result<(), CodecError> {
    let gpr = row.len() / Q4_GROUP;
    let mut log_scale = vec![0f32; gpr];
    let mut dead = vec![false; gpr];
    let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
    for (g, tile) in row.chunks(Q4_GROUP).enumerate() {
        let absmax = tile.iter().fold(0f32, |m, v| m.max(v.abs()));
        let s = f16_scale(absmax / 7.0);
        if !s.is_finite() {
            return Err(super::q8::scale_overflow(
                tile,
                first + g * Q4_GROUP,
                "q4tp: |w| ≤ 65504·7",
            ));
        }
        // An all-zero tile decodes to zero at any scale: keeping it out of the span keeps
        // the floor scale from stretching the ladder of the live tiles.
        dead[g] = absmax == 0.0;
        log_scale[g] = s.log2();
        if !dead[g] {
            lo = lo.min(log_scale[g]);
            hi = hi.max(log_scale[g]);
        }
    }
    if !lo.is_finite() {
        // No live tile (or no tile at all).
        lo = log_scale.first().copied().unwrap_or(0.0);
        hi = lo;
    }
    let lo_bits = f32_to_f16(lo);
    let lo_r = f16_to_f32(lo_bits);
    let mut step_bits = f32_to_f16((hi - lo_r).max(0.0) / MAX_CODE as f32);
    // Round-to-nearest may land rung 31 just short of the top scale; walk up by ulps.
    for _ in 0..64 {
        let st = f16_to_f32(step_bits);
        if st > 0.0 && lo_r + MAX_CODE as f32 * st >= hi {
            break;
        }
        step_bits += 1;
    }
    params.extend_from_slice(&lo_bits.to_le_bytes());
    params.extend_from_slice(&step_bits.to_le_bytes());
    let st = f16_to_f32(step_bits);
    let tab = ladder(lo_bits, step_bits);
    for (g, tile) in row.chunks(Q4_GROUP).enumerate() {
        let c = if dead[g] {
            0
        } else {
            let nearest = ((log_scale[g] - lo_r) / st)
                .round_ties_even()
                .clamp(0.0, MAX_CODE as f32) as usize;
            let mut best = (tile_sq_error(tile, tab[nearest]), nearest);
            let (lowest, highest) = (nearest.saturating_sub(2), (nearest + 1).min(MAX_CODE));
            for (cand, &scale) in tab.iter().enumerate().take(highest + 1).skip(lowest) {
                let err = tile_sq_error(tile, scale);
                if err < best.0 || (err == best.0 && cand < best.1) {
                    best = (err, cand);
                }
            }
            best.1
        };
        put_code(row_codes, g, c);
        let s = tab[c];
        let q = |k: usize| (quantize(tile[k], s) as i8 + 8) as u8;
        nib.extend((0..16).map(|k| q(2 * k) | (q(2 * k + 1) << 4)));
    }
    Ok(())
}

pub(crate) fn decode_range(bytes: &[u8], rows: usize, cols: usize, start: usize, out: &mut [f32]) {
    let gpr = cols / Q4_GROUP;
    let (params_off, codes_off, stride) = sections(rows, cols);
    for_each_unit(cols, start, out, |r, c0, row_seg| {
        let p = &bytes[params_off + 4 * r..params_off + 4 * r + 4];
        let tab = ladder(
            u16::from_le_bytes([p[0], p[1]]),
            u16::from_le_bytes([p[2], p[3]]),
        );
        let row_codes = &bytes[codes_off + r * stride..codes_off + (r + 1) * stride];
        for_each_unit(Q4_GROUP, c0, row_seg, |g, k0, seg| {
            let s = tab[code(row_codes, g)];
            let tile = &bytes[(r * gpr + g) * 16..(r * gpr + g + 1) * 16];
            for (k, o) in seg.iter_mut().enumerate() {
                let (byte, idx) = (tile[(k0 + k) / 2], k0 + k);
                let nib = if idx % 2 == 0 { byte & 0x0F } else { byte >> 4 };
                *o = (nib as f32 - 8.0) * s;
            }
        });
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{decode_vec, encode};
    use crate::Dtype;

    /// Rows of roughly Gaussian values whose per-tile magnitude varies over ~2 octaves.
    fn sample(rows: usize, cols: usize) -> Vec<f32> {
        let mut x = 12345u32;
        let mut uni = move || {
            x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (x >> 8) as f32 / (1 << 24) as f32
        };
        (0..rows * cols)
            .map(|i| {
                let g: f32 = (0..4).map(|_| uni()).sum::<f32>() - 2.0;
                let tile_gain = 1.0 + 3.0 * (((i / 32) * 7919 % 13) as f32 / 13.0);
                g * tile_gain * 0.02
            })
            .collect()
    }

    #[test]
    fn codes_round_trip() {
        let mut row = vec![0u8; code_stride(13)];
        for g in 0..13 {
            put_code(&mut row, g, (g * 7) % 32);
        }
        for g in 0..13 {
            assert_eq!(code(&row, g), (g * 7) % 32);
        }
    }

    #[test]
    fn element_bound_holds() {
        let (rows, cols) = (6, 160);
        let mut w = sample(rows, cols);
        w[32..64].iter_mut().for_each(|v| *v = 0.0); // a dead tile
        let b = encode(Dtype::Q4Tp, &[rows, cols], &w).unwrap();
        let d = decode_vec(Dtype::Q4Tp, &[rows, cols], &b).unwrap();
        let (po, co, stride) = sections(rows, cols);
        for r in 0..rows {
            let tab = ladder(
                u16::from_le_bytes([b[po + 4 * r], b[po + 4 * r + 1]]),
                u16::from_le_bytes([b[po + 4 * r + 2], b[po + 4 * r + 3]]),
            );
            for c in 0..cols {
                let s = tab[code(&b[co + r * stride..co + (r + 1) * stride], c / 32)];
                let i = r * cols + c;
                let bound = (s / 2.0).max(w[i].abs() - 7.0 * s) * (1.0 + 1e-6);
                assert!(
                    (w[i] - d[i]).abs() <= bound,
                    "{r},{c}: {} vs {} (s={s})",
                    w[i],
                    d[i]
                );
            }
        }
        assert!(d[32..64].iter().all(|&v| v == 0.0));
    }

    #[test]
    fn q4tp_rms_close_to_q4_tiled() {
        let (rows, cols) = (64, 256);
        let w = sample(rows, cols);
        let rms = |dtype| {
            let d = decode_vec(
                dtype,
                &[rows, cols],
                &encode(dtype, &[rows, cols], &w).unwrap(),
            )
            .unwrap();
            (w.iter().zip(&d).map(|(a, b)| (a - b).powi(2)).sum::<f32>() / w.len() as f32).sqrt()
        };
        let (tp, tiled) = (rms(Dtype::Q4Tp), rms(Dtype::Q4Tiled));
        assert!(tp <= tiled * 1.05, "q4tp rms {tp} vs q4_tiled {tiled}");
    }
}
