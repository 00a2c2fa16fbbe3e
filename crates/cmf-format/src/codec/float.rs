//! Scalar float conversions (f16, bf16) and the plain float codecs f32 / f16 / bf16.
//!
//! Error bounds (finite inputs, round to nearest even):
//! - `f32`: exact.
//! - `f16`: relative error ≤ 2⁻¹¹ for |x| in the normal range [2⁻¹⁴, 65504]; absolute error
//!   ≤ 2⁻²⁵ below it (subnormals). |x| ≥ 65520 would round to ±inf: the encoder refuses it.
//! - `bf16`: relative error ≤ 2⁻⁸ over the whole f32 range (bf16 keeps f32's exponent);
//!   values that would round past bf16::MAX are refused.
//!
//! NaN and ±inf inputs are stored as NaN and ±inf (callers that care check first).

use super::CodecError;
use half::{bf16, f16};

/// IEEE half → f32, exact. NaN payloads are kept bit for bit (no quieting), as
/// `cortiq_core::quant::f16_to_f32` does, so decodes compare bit-exact with it.
#[inline]
pub fn f16_to_f32(bits: u16) -> f32 {
    if bits & 0x7C00 == 0x7C00 && bits & 0x03FF != 0 {
        let sign = ((bits >> 15) as u32) << 31;
        return f32::from_bits(sign | 0x7F80_0000 | ((bits as u32 & 0x03FF) << 13));
    }
    f16::from_bits(bits).to_f32()
}

/// f32 → IEEE half bits, round to nearest even; overflow gives ±inf.
#[inline]
pub fn f32_to_f16(x: f32) -> u16 {
    f16::from_f32(x).to_bits()
}

/// bfloat16 → f32: the bits are the upper half of an f32 (exact, NaN payload kept).
#[inline]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// f32 → bfloat16 bits, round to nearest even.
#[inline]
pub fn f32_to_bf16(x: f32) -> u16 {
    bf16::from_f32(x).to_bits()
}

/// Reads f16 number `i` of a little-endian f16 array.
#[inline]
pub(crate) fn f16_at(bytes: &[u8], i: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]))
}

pub(crate) fn encode_f32(values: &[f32], out: &mut Vec<u8>) {
    out.reserve(values.len() * 4);
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
}

pub(crate) fn encode_f16(
    values: &[f32],
    first: usize,
    out: &mut Vec<u8>,
) -> Result<(), CodecError> {
    encode_16bit(values, first, out, f32_to_f16, 0x7C00, "f16 max 65504")
}

pub(crate) fn encode_bf16(
    values: &[f32],
    first: usize,
    out: &mut Vec<u8>,
) -> Result<(), CodecError> {
    encode_16bit(values, first, out, f32_to_bf16, 0x7F80, "bf16 max 3.39e38")
}

/// Appends `convert(v)` little-endian for each value; a finite value that converts to ±inf
/// (`inf_bits` under the sign) is an error naming its index (`first` + position) and `limit`.
fn encode_16bit(
    values: &[f32],
    first: usize,
    out: &mut Vec<u8>,
    convert: fn(f32) -> u16,
    inf_bits: u16,
    limit: &'static str,
) -> Result<(), CodecError> {
    out.reserve(values.len() * 2);
    for (i, &v) in values.iter().enumerate() {
        let h = convert(v);
        if v.is_finite() && h & 0x7FFF == inf_bits {
            return Err(CodecError::OutOfRange {
                index: first + i,
                value: v,
                limit,
            });
        }
        out.extend_from_slice(&h.to_le_bytes());
    }
    Ok(())
}

/// Decodes elements `[start, start + out.len())` of a little-endian f32 array.
pub(crate) fn decode_f32_range(bytes: &[u8], start: usize, out: &mut [f32]) {
    let src = &bytes[start * 4..(start + out.len()) * 4];
    for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
        *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
}

pub(crate) fn decode_f16_range(bytes: &[u8], start: usize, out: &mut [f32]) {
    let src = &bytes[start * 2..(start + out.len()) * 2];
    for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
        *o = f16_to_f32(u16::from_le_bytes([c[0], c[1]]));
    }
}

pub(crate) fn decode_bf16_range(bytes: &[u8], start: usize, out: &mut [f32]) {
    let src = &bytes[start * 2..(start + out.len()) * 2];
    for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
        *o = bf16_to_f32(u16::from_le_bytes([c[0], c[1]]));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_round_trip_every_pattern() {
        for bits in 0..=u16::MAX {
            let x = f16_to_f32(bits);
            if x.is_nan() {
                // payload kept: converting back through the top mantissa bits is lossless
                assert_eq!((x.to_bits() >> 13) as u16 & 0x3FF, bits & 0x3FF);
            } else {
                assert_eq!(f32_to_f16(x), bits, "{bits:#06x}");
            }
        }
    }

    #[test]
    fn f16_error_bound() {
        let mut x = 6.2e-5f32;
        while x < 65000.0 {
            let y = f16_to_f32(f32_to_f16(x));
            assert!(((y - x) / x).abs() <= 2f32.powi(-11), "{x}");
            x *= 1.0007;
        }
        let mut v = Vec::new();
        assert!(encode_f16(&[1.0, 70000.0], 0, &mut v).is_err());
        assert!(encode_f16(&[65504.0, f32::INFINITY], 0, &mut v).is_ok());
    }

    #[test]
    fn bf16_round_to_nearest_even_and_bound() {
        assert_eq!(f32_to_bf16(f32::from_bits(0x3F80_8000)), 0x3F80); // tie → even
        assert_eq!(f32_to_bf16(f32::from_bits(0x3F81_8000)), 0x3F82); // tie → even
        assert_eq!(f32_to_bf16(f32::from_bits(0x3F80_8001)), 0x3F81);
        let mut x = 1e-30f32;
        while x < 1e30 {
            let y = bf16_to_f32(f32_to_bf16(x));
            assert!(((y - x) / x).abs() <= 2f32.powi(-8), "{x}");
            x *= 1.37;
        }
    }
}
