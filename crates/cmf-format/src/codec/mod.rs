//! Weight codecs: f32 ⇄ stored bytes for every dtype this crate writes.
//!
//! `decode` is bit-exact with `cortiq_core::quant::dequant_*` 0.8.54 (tested in
//! `tests/interop_codecs.rs` on random payloads); `encode` of q8_2f produces the same bytes as
//! `cortiq_core::quant::encode_q8_2f`. The reference crate has no encoder for the other
//! quantized codecs; ours follow the spec's recipe (scale rounded to f16 first, values
//! quantized against the rounded scale, round half to even). Each module documents its
//! error bound and a test checks it.
//!
//! | codec | module | bound on \|w − ŵ\| |
//! | --- | --- | --- |
//! | f32 | [`float`] | 0 |
//! | f16 / bf16 | [`float`] | relative 2⁻¹¹ / 2⁻⁸ |
//! | q8_row | [`q8`] | s_row / 2, s_row ≈ absmax(row) / 127 |
//! | q8_2f | [`q8`] | ≈ s_row·col_i / 2 |
//! | q4_block, q4_tiled | [`q4`] | s_group / 2, s_group ≈ absmax(group) / 7 |
//! | q4tp | [`q4tp`] | max(s/2, \|w\| − 7s), s = the tile's ladder rung |
//!
//! `u8` tensors are raw bytes (JSON blobs, tables): they are not numbers, so `encode` and
//! `decode` refuse them; write and read their bytes directly.

pub mod float;
pub mod q4;
pub mod q4tp;
pub mod q8;
pub mod stream;

pub use stream::RowEncoder;

pub use float::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};

use crate::dtype::Dtype;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CodecError {
    #[error("{dtype} cannot hold shape {shape:?}: {why}")]
    Shape {
        dtype: Dtype,
        shape: Vec<usize>,
        why: String,
    },
    #[error("{dtype} {shape:?}: payload is {got} bytes, expected {expected}")]
    PayloadLength {
        dtype: Dtype,
        shape: Vec<usize>,
        expected: usize,
        got: usize,
    },
    #[error("shape {shape:?} has {expected} elements but {got} values were given")]
    ValueCount {
        shape: Vec<usize>,
        expected: usize,
        got: usize,
    },
    #[error("element range [{start}, +{len}) is outside a tensor of {numel} elements")]
    Range {
        start: usize,
        len: usize,
        numel: usize,
    },
    #[error("element {index} is {value}: quantized codecs need finite values")]
    NonFinite { index: usize, value: f32 },
    #[error("element {index} = {value} is out of range ({limit})")]
    OutOfRange {
        index: usize,
        value: f32,
        limit: &'static str,
    },
    #[error("u8 tensors hold raw bytes, not numbers: read or write their bytes directly")]
    RawBytes,
    #[error("{dtype} is encoded row by row: push whole rows of {cols} values (got {got})")]
    PartialRow {
        dtype: Dtype,
        cols: usize,
        got: usize,
    },
    #[error("{dtype} needs the whole tensor at once (column statistics): use codec::encode")]
    NeedsWholeTensor { dtype: Dtype },
}

/// Checks `shape` for `dtype` and returns (element count, payload bytes).
fn layout(dtype: Dtype, shape: &[usize]) -> Result<(usize, usize), CodecError> {
    let shape64: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
    let shape_err = || CodecError::Shape {
        dtype,
        shape: shape.to_vec(),
        why: dtype
            .shape_problem(&shape64)
            .unwrap_or_else(|| "too large for this platform".into()),
    };
    let nbytes = dtype.expected_nbytes(&shape64).ok_or_else(shape_err)?;
    let nbytes = usize::try_from(nbytes).map_err(|_| shape_err())?;
    let numel = shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(shape_err)?;
    Ok((numel, nbytes))
}

/// Rows × cols of a matrix codec's shape (validated by `layout`).
fn matrix(shape: &[usize]) -> (usize, usize) {
    match shape {
        &[r, c] => (r, c),
        _ => unreachable!("matrix codecs are 2-D; layout() checked"),
    }
}

/// Encodes `values` (row-major, `shape`) into `dtype`'s stored bytes.
pub fn encode(dtype: Dtype, shape: &[usize], values: &[f32]) -> Result<Vec<u8>, CodecError> {
    let (numel, nbytes) = layout(dtype, shape)?;
    if values.len() != numel {
        return Err(CodecError::ValueCount {
            shape: shape.to_vec(),
            expected: numel,
            got: values.len(),
        });
    }
    if dtype == Dtype::Q8_2f {
        if let Some((index, &value)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(CodecError::NonFinite { index, value });
        }
    }
    let mut out = Vec::with_capacity(nbytes);
    if dtype == Dtype::Q8_2f {
        let (rows, cols) = matrix(shape);
        q8::encode_2f(values, rows, cols, &mut out)?;
    } else {
        let mut enc = RowEncoder::new(dtype, shape)?;
        enc.push(values, &mut out)?;
        enc.finish(&mut out)?;
    }
    debug_assert_eq!(out.len(), nbytes);
    Ok(out)
}

/// Decodes a whole tensor into `out` (`out.len()` = element count).
pub fn decode(
    dtype: Dtype,
    shape: &[usize],
    bytes: &[u8],
    out: &mut [f32],
) -> Result<(), CodecError> {
    decode_range(dtype, shape, bytes, 0, out)
}

/// Decodes a whole tensor into a new vector.
pub fn decode_vec(dtype: Dtype, shape: &[usize], bytes: &[u8]) -> Result<Vec<f32>, CodecError> {
    let (numel, _) = layout(dtype, shape)?;
    let mut out = vec![0f32; numel];
    decode(dtype, shape, bytes, &mut out)?;
    Ok(out)
}

/// Decodes elements `[start, start + out.len())` of the row-major tensor (e.g. one row of an
/// embedding table: `start = token · cols`). Same values as a full `decode`.
pub fn decode_range(
    dtype: Dtype,
    shape: &[usize],
    bytes: &[u8],
    start: usize,
    out: &mut [f32],
) -> Result<(), CodecError> {
    let (numel, nbytes) = layout(dtype, shape)?;
    if bytes.len() != nbytes {
        return Err(CodecError::PayloadLength {
            dtype,
            shape: shape.to_vec(),
            expected: nbytes,
            got: bytes.len(),
        });
    }
    if start.checked_add(out.len()).is_none_or(|end| end > numel) {
        return Err(CodecError::Range {
            start,
            len: out.len(),
            numel,
        });
    }
    match dtype {
        Dtype::F32 => float::decode_f32_range(bytes, start, out),
        Dtype::F16 => float::decode_f16_range(bytes, start, out),
        Dtype::Bf16 => float::decode_bf16_range(bytes, start, out),
        Dtype::U8 => return Err(CodecError::RawBytes),
        Dtype::Q8Row => {
            let (rows, cols) = matrix(shape);
            q8::decode_row_range(bytes, rows, cols, start, out)
        }
        Dtype::Q8_2f => {
            let (rows, cols) = matrix(shape);
            q8::decode_2f_range(bytes, rows, cols, start, out)
        }
        Dtype::Q4Block => q4::decode_block_range(bytes, numel, start, out),
        Dtype::Q4Tiled => q4::decode_tiled_range(bytes, start, out),
        Dtype::Q4Tp => {
            let (rows, cols) = matrix(shape);
            q4tp::decode_range(bytes, rows, cols, start, out)
        }
    }
    Ok(())
}

/// Calls `f(unit, first, out_segment)` for each run of `out` that lies in one unit of `unit_len`
/// elements (a row, a 32-group), where element `start + k` of the flat tensor lands in `out[k]`
/// and `first` is the run's first index inside its unit.
pub(crate) fn for_each_unit(
    unit_len: usize,
    start: usize,
    out: &mut [f32],
    mut f: impl FnMut(usize, usize, &mut [f32]),
) {
    if unit_len == 0 {
        return;
    }
    let mut e = start;
    let mut rest = out;
    while !rest.is_empty() {
        let (unit, first) = (e / unit_len, e % unit_len);
        let take = (unit_len - first).min(rest.len());
        let (seg, tail) = rest.split_at_mut(take);
        f(unit, first, seg);
        e += take;
        rest = tail;
    }
}

/// f16-rounded quantization scale, floored at the smallest normal f16 (2⁻¹⁴ ≈ 6.1035e-5) so
/// it never underflows: the shared rule of the q8 and q4 encoders (spec §3.2; the reference
/// converter calls it `f16_scale`). Rounding *before* quantizing makes encoder and decoder use
/// the same scale.
pub(crate) fn f16_scale(raw: f32) -> f32 {
    const F16_MIN_NORMAL: f32 = 6.103_515_6e-5;
    f16_to_f32(f32_to_f16(raw)).max(F16_MIN_NORMAL)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn for_each_unit_covers_the_range() {
        let mut out = vec![0f32; 7];
        let mut seen = Vec::new();
        for_each_unit(3, 2, &mut out, |u, first, seg| {
            seen.push((u, first, seg.len()))
        });
        assert_eq!(seen, vec![(0, 2, 1), (1, 0, 3), (2, 0, 3)]);
    }

    #[test]
    fn bad_arguments_are_errors_not_panics() {
        assert!(matches!(
            encode(Dtype::Q8Row, &[4], &[0.0; 4]),
            Err(CodecError::Shape { .. })
        ));
        assert!(matches!(
            encode(Dtype::F16, &[4], &[0.0; 3]),
            Err(CodecError::ValueCount { .. })
        ));
        assert!(matches!(
            encode(Dtype::Q4Block, &[2], &[0.0, f32::NAN]),
            Err(CodecError::NonFinite { index: 1, .. })
        ));
        assert!(matches!(
            encode(Dtype::U8, &[2], &[0.0; 2]),
            Err(CodecError::RawBytes)
        ));
        let mut out = [0f32; 4];
        assert!(matches!(
            decode(Dtype::F32, &[4], &[0; 15], &mut out),
            Err(CodecError::PayloadLength { .. })
        ));
        assert!(matches!(
            decode_range(Dtype::F32, &[4], &[0; 16], 2, &mut out),
            Err(CodecError::Range { .. })
        ));
    }

    /// Every codec: decode(encode(x)) within its bound, and decode_range agrees with decode.
    #[test]
    fn ranges_agree_with_full_decode() {
        let shape = [3usize, 64];
        let vals: Vec<f32> = (0..192)
            .map(|i| ((i * 7919) % 1000) as f32 / 250.0 - 2.0)
            .collect();
        for dtype in Dtype::ALL.into_iter().filter(|&d| d != Dtype::U8) {
            let bytes = encode(dtype, &shape, &vals).unwrap();
            let full = decode_vec(dtype, &shape, &bytes).unwrap();
            for (start, len) in [(0, 192), (5, 40), (64, 64), (100, 92), (191, 1)] {
                let mut part = vec![0f32; len];
                decode_range(dtype, &shape, &bytes, start, &mut part).unwrap();
                assert_eq!(
                    &part[..],
                    &full[start..start + len],
                    "{dtype} [{start}, +{len})"
                );
            }
        }
    }
}
