//! Typed views of a weight's bytes, one per codec family, so kernels index planes instead of
//! recomputing byte offsets. Layouts: `../shared/reference/CMF.md` and cortiq-core's
//! `quant.rs` (`q4tp_sections`, `q4tp_code`, `q4tp_ladder`).

use cmf_format::Dtype;

use crate::Weight;

/// Elements per q4 group (tile).
pub const GROUP: usize = 32;

/// IEEE half bits to f32, exactly, without branches (vectorizable; `half`'s conversion checks for
/// F16C at run time on every call). Normal and subnormal halves: the bits moved into an f32 and
/// rescaled by 2^112; infinities and NaNs: the f32 exponent set to all ones.
#[inline(always)]
pub(crate) fn f16_to_f32(h: u16) -> f32 {
    let h = h as u32;
    let sign = (h & 0x8000) << 16;
    let em = h & 0x7FFF;
    let v = f32::from_bits(em << 13) * f32::from_bits(0x7780_0000);
    let bits = if em >= 0x7C00 {
        (em << 13) | 0x7F80_0000
    } else {
        v.to_bits()
    };
    f32::from_bits(bits | sign)
}

#[inline(always)]
pub(crate) fn f16_at(b: &[u8], i: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[2 * i], b[2 * i + 1]]))
}

/// An int8 matrix with one f32 scale per row (q8_row; q8_2f after its column field is folded
/// into the activation).
pub(crate) struct Q8<'a> {
    /// rows × cols signed bytes, row-major.
    pub q: &'a [u8],
    /// f16 scale per row.
    pub scales: &'a [u8],
    /// q8_2f only: f16 scale per column.
    pub col: Option<&'a [u8]>,
    pub cols: usize,
}

impl<'a> Q8<'a> {
    pub fn new(w: &Weight<'a>) -> Q8<'a> {
        let n = w.rows * w.cols;
        let scales = &w.data[n..n + 2 * w.rows];
        let col =
            (w.dtype == Dtype::Q8_2f).then(|| &w.data[n + 2 * w.rows..n + 2 * w.rows + 2 * w.cols]);
        Q8 {
            q: &w.data[..n],
            scales,
            col,
            cols: w.cols,
        }
    }

    #[inline]
    pub fn row(&self, r: usize) -> &'a [u8] {
        &self.q[r * self.cols..(r + 1) * self.cols]
    }

    #[inline]
    pub fn scale(&self, r: usize) -> f32 {
        f16_at(self.scales, r)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Q4Kind {
    /// q4_block with cols % 32 == 0: nibble plane (16 B per group) then an f16 scale plane.
    Block,
    /// q4_tiled: 18-byte tiles `[f16 s][16 B nibbles]`.
    Tiled,
    /// q4tp: nibble plane, per-row (f16 lo, f16 step), per-row 5-bit ladder codes.
    Tp,
}

/// A 4-bit matrix whose groups never straddle rows (cols % 32 == 0). In every layout byte j of a
/// group holds element 2j in its low nibble and 2j+1 in its high nibble; w = (q − 8)·s.
pub(crate) struct Q4<'a> {
    pub kind: Q4Kind,
    pub data: &'a [u8],
    pub rows: usize,
    /// Groups per row.
    pub gpr: usize,
}

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
impl<'a> Q4<'a> {
    /// `None` for q4_block tensors whose groups straddle rows (cols % 32 != 0): those take the
    /// decode-row path.
    pub fn new(w: &Weight<'a>) -> Option<Q4<'a>> {
        let kind = match w.dtype {
            Dtype::Q4Block => Q4Kind::Block,
            Dtype::Q4Tiled => Q4Kind::Tiled,
            Dtype::Q4Tp => Q4Kind::Tp,
            _ => return None,
        };
        w.cols.is_multiple_of(GROUP).then_some(Q4 {
            kind,
            data: w.data,
            rows: w.rows,
            gpr: w.cols / GROUP,
        })
    }

    /// Byte distance between consecutive groups' nibbles.
    #[inline]
    pub fn stride(&self) -> usize {
        if self.kind == Q4Kind::Tiled {
            18
        } else {
            16
        }
    }

    /// The 16 nibble bytes of group `g` of row `r`.
    #[inline]
    pub fn nibbles(&self, r: usize, g: usize) -> &'a [u8] {
        let t = r * self.gpr + g;
        match self.kind {
            Q4Kind::Block | Q4Kind::Tp => &self.data[t * 16..t * 16 + 16],
            Q4Kind::Tiled => &self.data[t * 18 + 2..t * 18 + 18],
        }
    }

    /// Byte offset of row `r`'s first nibble byte.
    #[inline]
    pub fn row_offset(&self, r: usize) -> usize {
        let t = r * self.gpr;
        match self.kind {
            Q4Kind::Block | Q4Kind::Tp => t * 16,
            Q4Kind::Tiled => t * 18 + 2,
        }
    }

    /// Writes row `r`'s `gpr` group scales as f32.
    pub fn row_scales(&self, r: usize, out: &mut [f32]) {
        let gpr = self.gpr;
        let out = &mut out[..gpr];
        match self.kind {
            Q4Kind::Block => {
                let plane = &self.data[self.rows * gpr * 16..];
                for (g, o) in out.iter_mut().enumerate() {
                    *o = f16_at(plane, r * gpr + g);
                }
            }
            Q4Kind::Tiled => {
                for (g, o) in out.iter_mut().enumerate() {
                    let t = (r * gpr + g) * 18;
                    *o = f16_to_f32(u16::from_le_bytes([self.data[t], self.data[t + 1]]));
                }
            }
            Q4Kind::Tp => {
                let (params, codes) = q4tp_planes(self.data, self.rows, gpr);
                let ladder = q4tp_ladder(params, r);
                let stride = q4tp_code_stride(gpr);
                let row_codes = &codes[r * stride..(r + 1) * stride];
                for (g, o) in out.iter_mut().enumerate() {
                    *o = ladder[q4tp_code(row_codes, g)];
                }
            }
        }
    }
}

/// Bytes of 5-bit codes per q4tp row (whole bytes, so rows decode independently).
pub(crate) fn q4tp_code_stride(gpr: usize) -> usize {
    (gpr * 5).div_ceil(8)
}

/// (row params, codes) planes of a q4tp payload: `[nibbles rows·gpr·16][rows × (f16 lo, f16 step)][codes]`.
pub(crate) fn q4tp_planes(data: &[u8], rows: usize, gpr: usize) -> (&[u8], &[u8]) {
    let nib = rows * gpr * 16;
    (&data[nib..nib + rows * 4], &data[nib + rows * 4..])
}

/// Group `g`'s 5-bit code, LSB-first within the row's code bytes.
#[inline]
pub(crate) fn q4tp_code(codes: &[u8], g: usize) -> usize {
    let bit = g * 5;
    let (b, sh) = (bit / 8, bit % 8);
    let lo = codes[b] as u16;
    let hi = if sh > 3 {
        codes.get(b + 1).copied().unwrap_or(0) as u16
    } else {
        0
    };
    (((lo | (hi << 8)) >> sh) & 0x1F) as usize
}

/// Row `r`'s 32-rung ladder `s[c] = 2^(lo + c·step)`, evaluated as one exp2 and 31 products
/// exactly as cortiq-core's `q4tp_ladder` does, so every consumer gets the same f32 bits.
pub(crate) fn q4tp_ladder(params: &[u8], r: usize) -> [f32; 32] {
    let lo = f16_at(params, 2 * r);
    let step = f16_at(params, 2 * r + 1);
    let ratio = step.exp2();
    let mut t = [0f32; 32];
    t[0] = lo.exp2();
    for c in 1..32 {
        t[c] = t[c - 1] * ratio;
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_conversion_is_exact_for_every_bit_pattern() {
        for h in 0..=u16::MAX {
            let want = half::f16::from_bits(h).to_f32();
            let got = f16_to_f32(h);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{h:#06x}: {got} vs {want}"
            );
        }
    }

    #[test]
    fn q4tp_codes_read_lsb_first_across_bytes() {
        // Codes 0..31 packed 5 bits each, LSB first, written by hand.
        let codes: Vec<usize> = (0..13).map(|g| (g * 7 + 3) % 32).collect();
        let mut bytes = vec![0u8; q4tp_code_stride(codes.len())];
        for (g, &c) in codes.iter().enumerate() {
            for bit in 0..5 {
                if c >> bit & 1 == 1 {
                    let at = g * 5 + bit;
                    bytes[at / 8] |= 1 << (at % 8);
                }
            }
        }
        for (g, &c) in codes.iter().enumerate() {
            assert_eq!(q4tp_code(&bytes, g), c, "group {g}");
        }
    }

    #[test]
    fn q4tp_ladder_is_geometric_from_lo() {
        let mut params = vec![0u8; 4];
        params[..2].copy_from_slice(&half::f16::from_f32(-3.0).to_le_bytes());
        params[2..].copy_from_slice(&half::f16::from_f32(0.25).to_le_bytes());
        let t = q4tp_ladder(&params, 0);
        assert_eq!(t[0], 0.125);
        assert!((t[4] / t[0] - 2.0).abs() < 1e-6);
        assert!((t[31] / (0.125 * 2f32.powf(31.0 * 0.25)) - 1.0).abs() < 1e-5);
    }
}
