//! 4-bit group codecs: groups of 32 consecutive elements, one f16 scale per group.
//!
//! Values: `w = (q − 8)·s`, `q ∈ [0, 15]`; element `2k` of a group is the low nibble of byte
//! `k`, element `2k + 1` the high nibble.
//!
//! **q4_block** (dtype 4): groups over the *flattened* tensor, the last one zero-padded;
//! `[u8 nibbles: ⌈n/32⌉·16][f16 s: ⌈n/32⌉]`.
//! **q4_tiled** (dtype 11): 2-D, `cols % 32 == 0`; one 18-byte tile per group,
//! `[f16 s][16 B nibbles]` — the same numbers as q4_block, laid out in one stream.
//!
//! Encoder: `s = f16(absmax(group)/7)` floored at 2⁻¹⁴, `q = round_half_even(w/s)` clamped to
//! [−8, 7], plus 8. Bound: `|w − ŵ| ≤ s/2` for every element (|w/s| ≤ 7·(1 + 2⁻¹¹), so
//! nothing clips; −8 is never used). Groups with absmax > 65504·7 are refused.

use super::float::f16_at;
use super::{f16_scale, f16_to_f32, f32_to_f16, for_each_unit, CodecError};
use crate::dtype::{Q4_GROUP, Q4_TILE_BYTES};

/// Quantizes one group (≤ 32 values; missing ones count as 0) into 16 nibble bytes and
/// returns the f16 bits of its scale. `first` is the group's first element index, for errors.
pub(crate) fn quantize_group(
    group: &[f32],
    first: usize,
    nibbles: &mut [u8],
) -> Result<u16, CodecError> {
    let absmax = group.iter().fold(0f32, |m, v| m.max(v.abs()));
    let s = f16_scale(absmax / 7.0);
    if !s.is_finite() {
        let (k, &value) = group
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))
            .expect("non-empty group");
        return Err(CodecError::OutOfRange {
            index: first + k,
            value,
            limit: "q4: |w| ≤ 65504·7",
        });
    }
    let q = |k: usize| -> u8 {
        let v = group.get(k).copied().unwrap_or(0.0);
        ((v / s).round_ties_even().clamp(-8.0, 7.0) as i8 + 8) as u8
    };
    for (k, byte) in nibbles.iter_mut().enumerate() {
        *byte = q(2 * k) | (q(2 * k + 1) << 4);
    }
    Ok(f32_to_f16(s))
}

#[inline]
fn nibble(packed: &[u8], k: usize) -> f32 {
    let byte = packed[k / 2];
    (if k.is_multiple_of(2) {
        byte & 0x0F
    } else {
        byte >> 4
    }) as f32
}

pub(crate) fn decode_block_range(bytes: &[u8], numel: usize, start: usize, out: &mut [f32]) {
    let groups = numel.div_ceil(Q4_GROUP);
    let (packed, scales) = bytes.split_at(groups * 16);
    for_each_unit(Q4_GROUP, start, out, |g, k0, seg| {
        let s = f16_at(scales, g);
        let p = &packed[g * 16..(g + 1) * 16];
        for (k, o) in seg.iter_mut().enumerate() {
            *o = (nibble(p, k0 + k) - 8.0) * s;
        }
    });
}

pub(crate) fn decode_tiled_range(bytes: &[u8], start: usize, out: &mut [f32]) {
    for_each_unit(Q4_GROUP, start, out, |g, k0, seg| {
        let tile = &bytes[g * Q4_TILE_BYTES..(g + 1) * Q4_TILE_BYTES];
        let s = f16_to_f32(u16::from_le_bytes([tile[0], tile[1]]));
        for (k, o) in seg.iter_mut().enumerate() {
            *o = (nibble(&tile[2..], k0 + k) - 8.0) * s;
        }
    });
}

#[cfg(test)]
mod tests {
    use crate::codec::{decode_vec, encode, f16_to_f32};
    use crate::Dtype;

    fn sample(n: usize) -> Vec<f32> {
        let mut x = 7u32;
        (0..n)
            .map(|i| {
                x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                let v = (x >> 8) as f32 / (1 << 24) as f32 - 0.5;
                if i % 97 == 0 {
                    v * 50.0
                } else {
                    v
                }
            })
            .collect()
    }

    #[test]
    fn q4_block_bound_and_padding() {
        let w = sample(101); // 4 groups, last one padded
        let b = encode(Dtype::Q4Block, &[101], &w).unwrap();
        assert_eq!(b.len(), 4 * 18);
        let d = decode_vec(Dtype::Q4Block, &[101], &b).unwrap();
        for (i, (x, y)) in w.iter().zip(&d).enumerate() {
            let g = i / 32;
            let s = f16_to_f32(u16::from_le_bytes([b[64 + 2 * g], b[64 + 2 * g + 1]]));
            assert!((x - y).abs() <= s / 2.0, "{i}: {x} vs {y}");
        }
    }

    #[test]
    fn q4_tiled_is_q4_block_rearranged() {
        let w = sample(4 * 64);
        let block = encode(Dtype::Q4Block, &[4, 64], &w).unwrap();
        let tiled = encode(Dtype::Q4Tiled, &[4, 64], &w).unwrap();
        for g in 0..8 {
            assert_eq!(
                tiled[g * 18..g * 18 + 2],
                block[128 + 2 * g..128 + 2 * g + 2]
            );
            assert_eq!(tiled[g * 18 + 2..g * 18 + 18], block[g * 16..g * 16 + 16]);
        }
        assert_eq!(
            decode_vec(Dtype::Q4Block, &[4, 64], &block).unwrap(),
            decode_vec(Dtype::Q4Tiled, &[4, 64], &tiled).unwrap()
        );
    }
}
