//! 8-bit row codecs for `[rows = out, cols = in]` matrices.
//!
//! **q8_row** (dtype 3): `[i8 q: rows·cols][f16 s: rows]`, `w = q·s`.
//! Encoder: `s = f16(absmax(row)/127)` floored at 2⁻¹⁴, `q = round_half_even(w/s)` clamped to
//! [−128, 127]. Bound: `|w − ŵ| ≤ s/2` for every element (|w/s| ≤ 127·(1 + 2⁻¹¹) < 127.5, so
//! nothing clips). Rows with absmax > 65504·127 are refused (the f16 scale would overflow).
//!
//! **q8_2f** (dtype 9): `[i8 q: rows·cols][f16 s: rows][f16 col: cols]`, `w = q·s[o]·col[i]`.
//! Encoder (byte-identical to `cortiq_core::quant::encode_q8_2f`): `col[i] = f16(RMS of column
//! i)` floored at 2⁻¹⁴, sums of squares in f64 accumulated per block of 256 rows;
//! `s[o] = f16(max|w/col|/127)` floored; `q = round_half_even((w/col)/s)` clamped to ±127.
//! Bound: `|w − ŵ| ≤ col[i]·s[o]/2`, up to f32 rounding of the two products (≤ 2⁻²² relative).
//! Decode computes `(q·s)·col` in that order, as the reference does.

use super::float::f16_at;
use super::{f16_scale, f32_to_f16, for_each_unit, CodecError};
use rayon::prelude::*;

/// The error for a row or group whose scale overflows f16: names its largest element.
pub(crate) fn scale_overflow(values: &[f32], first: usize, limit: &'static str) -> CodecError {
    let (k, &value) = values
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))
        .expect("non-empty when a scale overflows");
    CodecError::OutOfRange {
        index: first + k,
        value,
        limit,
    }
}

/// Quantizes one q8_row row: codes to `q`, its f16 scale to `scales`. `first` is the row's
/// first element index (for errors).
pub(crate) fn quantize_row(
    row: &[f32],
    first: usize,
    q: &mut Vec<u8>,
    scales: &mut Vec<u8>,
) -> Result<(), CodecError> {
    let absmax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
    let s = f16_scale(absmax / 127.0);
    if !s.is_finite() {
        return Err(scale_overflow(row, first, "q8_row: |w| ≤ 65504·127"));
    }
    q.extend(
        row.iter()
            .map(|&v| (v / s).round_ties_even().clamp(-128.0, 127.0) as i8 as u8),
    );
    scales.extend_from_slice(&f32_to_f16(s).to_le_bytes());
    Ok(())
}

pub(crate) fn decode_row_range(
    bytes: &[u8],
    rows: usize,
    cols: usize,
    start: usize,
    out: &mut [f32],
) {
    let (q, scales) = bytes.split_at(rows * cols);
    for_each_unit(cols, start, out, |r, c0, seg| {
        let s = f16_at(scales, r);
        let src = &q[r * cols + c0..r * cols + c0 + seg.len()];
        for (o, &b) in seg.iter_mut().zip(src) {
            *o = b as i8 as f32 * s;
        }
    });
}

/// Rows per block of the column sum of squares. Part of the byte-exact contract with the
/// reference encoder: f64 addition is not associative.
const COL_BLOCK_ROWS: usize = 256;

pub(crate) fn encode_2f(
    values: &[f32],
    rows: usize,
    cols: usize,
    out: &mut Vec<u8>,
) -> Result<(), CodecError> {
    if rows == 0 {
        return Ok(()); // no rows, no column field (see Dtype::expected_nbytes)
    }
    // Block sums in parallel; added into the totals in block order, as the reference does.
    let block_sums: Vec<Vec<f64>> = if cols == 0 {
        Vec::new()
    } else {
        values
            .par_chunks(COL_BLOCK_ROWS * cols)
            .map(|block| {
                let mut sum = vec![0f64; cols];
                for row in block.chunks(cols) {
                    for (a, &v) in sum.iter_mut().zip(row) {
                        *a += v as f64 * v as f64;
                    }
                }
                sum
            })
            .collect()
    };
    let mut totals = vec![0f64; cols];
    for block_sum in &block_sums {
        for (t, a) in totals.iter_mut().zip(block_sum) {
            *t += *a;
        }
    }
    let col: Vec<f32> = totals
        .iter()
        .map(|&t| f16_scale((t / rows as f64).sqrt().max(1e-12) as f32))
        .collect();
    if col.iter().any(|c| !c.is_finite()) {
        return Err(scale_overflow(values, 0, "q8_2f: column RMS ≤ 65504"));
    }
    // Rows are independent once the column field is known: quantised in parallel, in place.
    let base = out.len();
    out.resize(base + rows * cols + rows * 2, 0);
    let (codes, scales) = out[base..].split_at_mut(rows * cols);
    let quantize = |r: usize, codes: &mut [u8], scale: &mut [u8]| -> Result<(), CodecError> {
        let row = &values[r * cols..(r + 1) * cols];
        let absmax = row
            .iter()
            .zip(&col)
            .fold(0f32, |m, (v, c)| m.max((v / c).abs()));
        let s = f16_scale(absmax.max(1e-12) / 127.0);
        if !s.is_finite() {
            return Err(scale_overflow(row, r * cols, "q8_2f: |w/col| ≤ 65504·127"));
        }
        for ((o, v), c) in codes.iter_mut().zip(row).zip(&col) {
            *o = ((v / c) / s).round_ties_even().clamp(-127.0, 127.0) as i8 as u8;
        }
        scale.copy_from_slice(&f32_to_f16(s).to_le_bytes());
        Ok(())
    };
    if cols == 0 {
        // No codes: every row's scale comes from an all-zero absmax.
        for (r, scale) in scales.chunks_mut(2).enumerate() {
            quantize(r, &mut [], scale)?;
        }
    } else {
        codes
            .par_chunks_mut(cols)
            .zip(scales.par_chunks_mut(2))
            .enumerate()
            // The first failing row in row order, as a sequential encoder would report it.
            .map(|(r, (c, s))| quantize(r, c, s).map_err(|e| (r, e)))
            .filter_map(Result::err)
            .min_by_key(|(r, _)| *r)
            .map_or(Ok(()), |(_, e)| Err(e))?;
    }
    for &c in &col {
        out.extend_from_slice(&f32_to_f16(c).to_le_bytes());
    }
    Ok(())
}

pub(crate) fn decode_2f_range(
    bytes: &[u8],
    rows: usize,
    cols: usize,
    start: usize,
    out: &mut [f32],
) {
    let (q, rest) = bytes.split_at(rows * cols);
    let (scales, col) = rest.split_at(rows * 2);
    // (rows == 0 means an empty range: the closure below never runs.)
    for_each_unit(cols, start, out, |r, c0, seg| {
        let s = f16_at(scales, r);
        for (k, o) in seg.iter_mut().enumerate() {
            let i = c0 + k;
            *o = q[r * cols + i] as i8 as f32 * s * f16_at(col, i);
        }
    });
}

#[cfg(test)]
mod tests {
    use crate::codec::{decode_vec, encode, f16_to_f32};
    use crate::Dtype;

    fn sample(rows: usize, cols: usize, seed: u32) -> Vec<f32> {
        let mut x = seed;
        (0..rows * cols)
            .map(|i| {
                x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                let v = (x >> 8) as f32 / (1 << 24) as f32 - 0.5;
                // an outlier column and a near-zero row exercise both fields
                if i % cols == 3 {
                    v * 40.0
                } else if i / cols == 1 {
                    v * 1e-7
                } else {
                    v
                }
            })
            .collect()
    }

    #[test]
    fn q8_row_error_within_half_a_step() {
        let (rows, cols) = (5, 37);
        let w = sample(rows, cols, 1);
        let b = encode(Dtype::Q8Row, &[rows, cols], &w).unwrap();
        let d = decode_vec(Dtype::Q8Row, &[rows, cols], &b).unwrap();
        for r in 0..rows {
            let s = f16_to_f32(u16::from_le_bytes([
                b[rows * cols + 2 * r],
                b[rows * cols + 2 * r + 1],
            ]));
            let absmax = w[r * cols..(r + 1) * cols]
                .iter()
                .fold(0f32, |m, v| m.max(v.abs()));
            assert!(s <= (absmax / 127.0 * (1.0 + 1e-3)).max(6.2e-5));
            for c in 0..cols {
                let i = r * cols + c;
                assert!(
                    (w[i] - d[i]).abs() <= s / 2.0,
                    "row {r} col {c}: {} vs {}",
                    w[i],
                    d[i]
                );
            }
        }
    }

    #[test]
    fn q8_2f_error_within_half_a_step() {
        let (rows, cols) = (300, 9); // > 256 rows: two column blocks
        let w = sample(rows, cols, 2);
        let b = encode(Dtype::Q8_2f, &[rows, cols], &w).unwrap();
        let d = decode_vec(Dtype::Q8_2f, &[rows, cols], &b).unwrap();
        let f16 = |off: usize| f16_to_f32(u16::from_le_bytes([b[off], b[off + 1]]));
        for r in 0..rows {
            let s = f16(rows * cols + 2 * r);
            for c in 0..cols {
                let col = f16(rows * cols + 2 * rows + 2 * c);
                let i = r * cols + c;
                assert!(
                    (w[i] - d[i]).abs() <= 0.5 * s * col * (1.0 + 1e-5),
                    "{r},{c}"
                );
            }
        }
    }

    #[test]
    fn out_of_range_is_refused() {
        assert!(encode(Dtype::Q8Row, &[1, 2], &[1e10, 0.0]).is_err());
    }
}
