//! Encoding a tensor a few rows at a time, so a converter never holds a whole large tensor as
//! f32 (a 128k × 4096 embedding is 2 GiB of f32). The bytes are identical to [`super::encode`],
//! which is itself a single `push` of all rows.
//!
//! ```no_run
//! # use cmf_format::{codec::RowEncoder, CmfWriter, Dtype};
//! # fn f(w: &mut CmfWriter, rows_of: impl Fn(usize, usize) -> Vec<f32>) -> cmf_format::Result<()> {
//! let (rows, cols) = (128_256, 4096);
//! let mut enc = RowEncoder::new(Dtype::Q4Tp, &[rows, cols])?;
//! let mut buf = Vec::new();
//! w.begin_tensor("model.embed_tokens.weight", Dtype::Q4Tp, &[rows, cols])?;
//! for r in (0..rows).step_by(1024) {
//!     enc.push(&rows_of(r, (r + 1024).min(rows)), &mut buf)?; // whole rows, in order
//!     w.write_chunk(&buf)?;
//!     buf.clear();
//! }
//! enc.finish(&mut buf)?; // trailing scale planes
//! w.write_chunk(&buf)?;
//! w.end_tensor()?;
//! # Ok(()) }
//! ```
//!
//! q8_2f cannot stream (its column field needs every row first): use [`super::encode`].
//! Memory: the side planes (scales, q4tp params and codes) are buffered until `finish`; they
//! are ~1.5–6 % of the payload.

use super::{float, q4, q4tp, q8, CodecError};
use crate::dtype::{Dtype, Q4_GROUP};

pub struct RowEncoder {
    dtype: Dtype,
    cols: usize,
    numel: usize,
    /// Elements consumed so far.
    done: usize,
    /// q4_block: values of a group not yet complete (its groups span the flattened tensor).
    carry: Vec<f32>,
    /// Trailing plane: q8_row / q4_block scales, q4tp row params.
    side: Vec<u8>,
    /// q4tp codes (after the params).
    codes: Vec<u8>,
}

impl RowEncoder {
    pub fn new(dtype: Dtype, shape: &[usize]) -> Result<RowEncoder, CodecError> {
        let (numel, _) = super::layout(dtype, shape)?;
        match dtype {
            Dtype::U8 => return Err(CodecError::RawBytes),
            Dtype::Q8_2f => return Err(CodecError::NeedsWholeTensor { dtype }),
            _ => {}
        }
        let cols = shape.last().copied().unwrap_or(1);
        Ok(RowEncoder {
            dtype,
            cols,
            numel,
            done: 0,
            carry: Vec::new(),
            side: Vec::new(),
            codes: Vec::new(),
        })
    }

    /// Encodes the next `values` (whole rows for the matrix codecs, any count for the float
    /// codecs and q4_block) and appends the main-plane bytes to `out`.
    pub fn push(&mut self, values: &[f32], out: &mut Vec<u8>) -> Result<(), CodecError> {
        let first = self.done;
        if first + values.len() > self.numel {
            return Err(CodecError::ValueCount {
                shape: vec![],
                expected: self.numel,
                got: first + values.len(),
            });
        }
        let row_codec = matches!(self.dtype, Dtype::Q8Row | Dtype::Q4Tiled | Dtype::Q4Tp);
        if row_codec && self.cols > 0 && !values.len().is_multiple_of(self.cols) {
            return Err(CodecError::PartialRow {
                dtype: self.dtype,
                cols: self.cols,
                got: values.len(),
            });
        }
        if self.dtype.is_quantized() {
            if let Some((k, &value)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
                return Err(CodecError::NonFinite {
                    index: first + k,
                    value,
                });
            }
        }
        match self.dtype {
            Dtype::F32 => float::encode_f32(values, out),
            Dtype::F16 => float::encode_f16(values, first, out)?,
            Dtype::Bf16 => float::encode_bf16(values, first, out)?,
            Dtype::Q8Row => {
                for (r, row) in values.chunks(self.cols.max(1)).enumerate() {
                    q8::quantize_row(row, first + r * self.cols, out, &mut self.side)?;
                }
            }
            Dtype::Q4Tiled => {
                let mut nib = [0u8; 16];
                for (g, group) in values.chunks(Q4_GROUP).enumerate() {
                    let s = q4::quantize_group(group, first + g * Q4_GROUP, &mut nib)?;
                    out.extend_from_slice(&s.to_le_bytes());
                    out.extend_from_slice(&nib);
                }
            }
            Dtype::Q4Block => {
                // Complete the carried group first, then whole groups, then carry the rest.
                let mut rest = values;
                let group_start = first - self.carry.len();
                if !self.carry.is_empty() {
                    let take = (Q4_GROUP - self.carry.len()).min(rest.len());
                    self.carry.extend_from_slice(&rest[..take]);
                    rest = &rest[take..];
                    if self.carry.len() == Q4_GROUP {
                        let carry = std::mem::take(&mut self.carry);
                        self.block_group(&carry, group_start, out)?;
                    }
                }
                let mut at = first + (values.len() - rest.len());
                let mut groups = rest.chunks_exact(Q4_GROUP);
                for group in &mut groups {
                    self.block_group(group, at, out)?;
                    at += Q4_GROUP;
                }
                self.carry.extend_from_slice(groups.remainder());
            }
            Dtype::Q4Tp => {
                let stride = q4tp::code_stride(self.cols / Q4_GROUP);
                for (r, row) in values.chunks(self.cols.max(1)).enumerate() {
                    let at = self.codes.len();
                    self.codes.resize(at + stride, 0);
                    q4tp::encode_row(
                        row,
                        first + r * self.cols,
                        out,
                        &mut self.side,
                        &mut self.codes[at..],
                    )?;
                }
            }
            Dtype::U8 | Dtype::Q8_2f => unreachable!("refused by new()"),
        }
        self.done += values.len();
        Ok(())
    }

    fn block_group(
        &mut self,
        group: &[f32],
        first: usize,
        out: &mut Vec<u8>,
    ) -> Result<(), CodecError> {
        let mut nib = [0u8; 16];
        let s = q4::quantize_group(group, first, &mut nib)?;
        out.extend_from_slice(&nib);
        self.side.extend_from_slice(&s.to_le_bytes());
        Ok(())
    }

    /// Checks that every element was pushed and appends the trailing planes to `out`.
    pub fn finish(mut self, out: &mut Vec<u8>) -> Result<(), CodecError> {
        if self.done != self.numel {
            return Err(CodecError::ValueCount {
                shape: vec![],
                expected: self.numel,
                got: self.done,
            });
        }
        if !self.carry.is_empty() {
            // The last q4_block group is zero-padded.
            let carry = std::mem::take(&mut self.carry);
            self.block_group(&carry, self.numel - carry.len(), out)?;
        }
        out.extend_from_slice(&self.side);
        out.extend_from_slice(&self.codes);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::encode;

    #[test]
    fn chunked_equals_one_shot() {
        let (rows, cols) = (7usize, 96usize);
        let vals: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919) % 613) as f32 / 97.0 - 3.0)
            .collect();
        for dtype in [
            Dtype::F32,
            Dtype::F16,
            Dtype::Bf16,
            Dtype::Q8Row,
            Dtype::Q4Block,
            Dtype::Q4Tiled,
            Dtype::Q4Tp,
        ] {
            let whole = encode(dtype, &[rows, cols], &vals).unwrap();
            // whole rows: 1, 2, 3, 1 rows; q4_block and floats also take odd element counts
            let row_chunks = [cols, 2 * cols, 3 * cols, cols];
            let odd_chunks = [5, 27, 64, 1, 33, 542];
            let plans: Vec<&[usize]> =
                if matches!(dtype, Dtype::Q8Row | Dtype::Q4Tiled | Dtype::Q4Tp) {
                    vec![&row_chunks]
                } else {
                    vec![&row_chunks, &odd_chunks]
                };
            for plan in plans {
                let mut enc = RowEncoder::new(dtype, &[rows, cols]).unwrap();
                let (mut out, mut at) = (Vec::new(), 0);
                for &n in plan {
                    enc.push(&vals[at..at + n], &mut out).unwrap();
                    at += n;
                }
                enc.finish(&mut out).unwrap();
                assert_eq!(out, whole, "{dtype} chunks {plan:?}");
            }
        }
    }

    #[test]
    fn misuse_is_an_error() {
        let mut out = Vec::new();
        assert!(matches!(
            RowEncoder::new(Dtype::Q8_2f, &[2, 2]),
            Err(CodecError::NeedsWholeTensor { .. })
        ));
        let mut enc = RowEncoder::new(Dtype::Q8Row, &[2, 4]).unwrap();
        assert!(matches!(
            enc.push(&[0.0; 3], &mut out),
            Err(CodecError::PartialRow { .. })
        ));
        enc.push(&[0.0; 4], &mut out).unwrap();
        assert!(matches!(
            enc.push(&[0.0; 8], &mut out),
            Err(CodecError::ValueCount { .. })
        ));
        assert!(matches!(
            enc.finish(&mut out),
            Err(CodecError::ValueCount { .. })
        ));
        let mut enc = RowEncoder::new(Dtype::Q4Block, &[40]).unwrap();
        let e = enc.push(&[0.0, 1.0, f32::INFINITY], &mut out).unwrap_err();
        assert_eq!(
            e,
            CodecError::NonFinite {
                index: 2,
                value: f32::INFINITY
            }
        );
    }
}
