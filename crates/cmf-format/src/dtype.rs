//! Tensor storage codecs as the CMF v2 directory names them (`u8 dtype`).
//!
//! Ids are fixed by the spec (github infosave2007/cmf, docs/CMF_V2_SPEC.md) and shared with the
//! reference crate `cortiq-core`; an id never changes meaning. Only the codecs this engine can
//! read are listed: any other id is refused by the reader with the tensor named.

/// Elements per quantization group in the q4 families.
pub const Q4_GROUP: usize = 32;
/// Bytes of one q4_tiled tile: `[f16 scale][16 B nibbles]`.
pub const Q4_TILE_BYTES: usize = 18;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Dtype {
    F32 = 0,
    F16 = 1,
    Bf16 = 2,
    /// `[i8 out·in][f16 scale out]`, w = q·s.
    Q8Row = 3,
    /// groups of 32 over the flattened tensor: `[u8 ⌈n/32⌉·16][f16 ⌈n/32⌉]`, w = (q − 8)·s.
    Q4Block = 4,
    /// Raw bytes (embedded JSON blobs and tables).
    U8 = 6,
    /// `[i8 out·in][f16 row out][f16 col in]`, w = q·row[o]·col[i].
    Q8_2f = 9,
    /// per 32-group tile `[f16 s][16 B nibbles]`, same values as q4_block; 2-D, cols % 32 == 0.
    Q4Tiled = 11,
    /// q4_tiled nibbles with 5-bit per-tile scale codes on a per-row geometric ladder.
    Q4Tp = 15,
}

impl Dtype {
    pub const ALL: [Dtype; 9] = [
        Dtype::F32,
        Dtype::F16,
        Dtype::Bf16,
        Dtype::Q8Row,
        Dtype::Q4Block,
        Dtype::U8,
        Dtype::Q8_2f,
        Dtype::Q4Tiled,
        Dtype::Q4Tp,
    ];

    pub fn from_id(id: u8) -> Option<Dtype> {
        Dtype::ALL.into_iter().find(|d| *d as u8 == id)
    }

    pub fn id(self) -> u8 {
        self as u8
    }

    /// The spec's lower-case name (`q8_row`, `q8_2f`, …), as `cmf info` prints it.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
            Dtype::Q8Row => "q8_row",
            Dtype::Q4Block => "q4_block",
            Dtype::U8 => "u8",
            Dtype::Q8_2f => "q8_2f",
            Dtype::Q4Tiled => "q4_tiled",
            Dtype::Q4Tp => "q4tp",
        }
    }

    pub fn from_name(name: &str) -> Option<Dtype> {
        Dtype::ALL.into_iter().find(|d| d.name() == name)
    }

    /// Whether the codec quantizes (needs an encoder with an error bound) rather than stores.
    pub fn is_quantized(self) -> bool {
        matches!(
            self,
            Dtype::Q8Row | Dtype::Q4Block | Dtype::Q8_2f | Dtype::Q4Tiled | Dtype::Q4Tp
        )
    }

    /// Exact payload size for `shape`, or `None` when the shape is invalid for the codec or the
    /// size overflows. Matrix codecs (q8_row, q8_2f, q4_tiled, q4tp) take exactly 2-D
    /// `[rows = out, cols = in]` shapes (spec §3.2 "2-D only"); q4_tiled and q4tp also need
    /// `cols % 32 == 0`. q4_block groups the flattened tensor, so any shape works.
    ///
    /// Agrees with `cortiq_core::quant::expected_nbytes` on every shape both accept; the
    /// reference is laxer on a few the spec rules out (1-D q8_row, 1-D q4_tiled), which this
    /// reader refuses rather than guess a layout for.
    pub fn expected_nbytes(self, shape: &[u64]) -> Option<u64> {
        let n = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d))?;
        let matrix = match shape {
            [rows, cols] => Some((*rows, *cols)),
            _ => None,
        };
        let group = Q4_GROUP as u64;
        match (self, matrix) {
            (Dtype::F32, _) => n.checked_mul(4),
            (Dtype::F16 | Dtype::Bf16, _) => n.checked_mul(2),
            (Dtype::U8, _) => Some(n),
            (Dtype::Q4Block, _) => n.div_ceil(group).checked_mul(Q4_TILE_BYTES as u64),
            // [i8 rows·cols][f16 rows]
            (Dtype::Q8Row, Some((rows, _))) => n.checked_add(rows.checked_mul(2)?),
            // [i8 rows·cols][f16 rows][f16 cols]; a 0-row matrix stores no column field either,
            // as the reference computes cols as n / rows.
            (Dtype::Q8_2f, Some((rows, cols))) => {
                let cols = if rows == 0 { 0 } else { cols };
                n.checked_add(rows.checked_mul(2)?)?
                    .checked_add(cols.checked_mul(2)?)
            }
            // rows·cols/32 tiles of 18 bytes
            (Dtype::Q4Tiled, Some((_, cols))) if cols % group == 0 => {
                (n / group).checked_mul(Q4_TILE_BYTES as u64)
            }
            // [nibbles rows·gpr·16][rows × (f16 lo, f16 step)][rows × ⌈gpr·5/8⌉ codes]
            (Dtype::Q4Tp, Some((rows, cols))) if cols % group == 0 => {
                let gpr = cols / group;
                let per_row = gpr
                    .checked_mul(16)?
                    .checked_add(4)?
                    .checked_add(gpr.checked_mul(5)?.div_ceil(8))?;
                rows.checked_mul(per_row)
            }
            _ => None,
        }
    }

    /// Why `shape` is not valid for this codec (for error messages), or `None` if it is.
    pub fn shape_problem(self, shape: &[u64]) -> Option<String> {
        if self.expected_nbytes(shape).is_some() {
            return None;
        }
        let is_matrix = matches!(
            self,
            Dtype::Q8Row | Dtype::Q8_2f | Dtype::Q4Tiled | Dtype::Q4Tp
        );
        Some(if is_matrix && shape.len() != 2 {
            format!("{self} needs a 2-D [rows, cols] shape, got {shape:?}")
        } else if matches!(self, Dtype::Q4Tiled | Dtype::Q4Tp)
            && shape.len() == 2
            && !shape[1].is_multiple_of(32)
        {
            format!("{self} needs cols divisible by 32, got {shape:?}")
        } else {
            format!("{self} payload size for shape {shape:?} overflows")
        })
    }

    /// Name of a dtype id the reference implementation knows but this reader does not decode
    /// (vbit, q1, mxfp4, ...), for a precise refusal message.
    pub fn foreign_name(id: u8) -> Option<&'static str> {
        Some(match id {
            5 => "mix8_4",
            7 => "q4_col",
            8 => "vbit",
            10 => "vbit_ro",
            12 => "q1",
            13 => "q1s",
            14 => "q1t",
            16 => "q2tp",
            17 => "u32",
            18 => "u64",
            19 => "blr",
            20 => "q1g",
            21 => "mxfp4",
            _ => return None,
        })
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip() {
        for d in Dtype::ALL {
            assert_eq!(Dtype::from_id(d.id()), Some(d));
            assert_eq!(Dtype::from_name(d.name()), Some(d));
        }
        assert_eq!(Dtype::from_id(5), None);
    }

    #[test]
    fn sizes() {
        assert_eq!(Dtype::Q8Row.expected_nbytes(&[4, 8]), Some(32 + 8));
        assert_eq!(Dtype::Q8_2f.expected_nbytes(&[4, 8]), Some(32 + 8 + 16));
        assert_eq!(Dtype::Q4Block.expected_nbytes(&[33]), Some(36));
        assert_eq!(Dtype::Q4Tiled.expected_nbytes(&[2, 64]), Some(72));
        assert_eq!(Dtype::Q4Tiled.expected_nbytes(&[2, 48]), None);
        assert_eq!(Dtype::Q4Tiled.expected_nbytes(&[64]), None);
        assert_eq!(Dtype::Q8Row.expected_nbytes(&[8]), None);
        assert_eq!(Dtype::Q8Row.expected_nbytes(&[2, 3, 4]), None);
        // q4tp: 2 rows × (2 groups · 16 B + 4 B params + ⌈10/8⌉ = 2 B codes)
        assert_eq!(
            Dtype::Q4Tp.expected_nbytes(&[2, 64]),
            Some(2 * (32 + 4 + 2))
        );
        assert_eq!(Dtype::Q4Block.expected_nbytes(&[]), Some(18));
        assert_eq!(Dtype::F16.expected_nbytes(&[0, 5]), Some(0));
        assert!(Dtype::Q4Tp
            .shape_problem(&[2, 48])
            .unwrap()
            .contains("divisible by 32"));
        assert_eq!(Dtype::F32.expected_nbytes(&[u64::MAX, 2]), None);
    }
}
