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
        matches!(self, Dtype::Q8Row | Dtype::Q4Block | Dtype::Q8_2f | Dtype::Q4Tiled | Dtype::Q4Tp)
    }

    /// Exact payload size for `shape`, or `None` when the shape is invalid for the codec
    /// (e.g. q8_row on a 1-D tensor, q4_tiled with cols not a multiple of 32) or overflows.
    /// Matrix codecs read `shape` as `[out, in]` (rows, cols); leading dims fold into rows.
    pub fn expected_nbytes(self, shape: &[u64]) -> Option<u64> {
        let n = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d))?;
        let (rows, cols) = match shape {
            [] => (1, 1),
            [c] => (1, *c),
            [lead @ .., c] => (lead.iter().try_fold(1u64, |a, &d| a.checked_mul(d))?, *c),
        };
        let groups = |k: u64| k.div_ceil(Q4_GROUP as u64);
        match self {
            Dtype::F32 => n.checked_mul(4),
            Dtype::F16 | Dtype::Bf16 => n.checked_mul(2),
            Dtype::U8 => Some(n),
            Dtype::Q8Row if shape.len() >= 2 => n.checked_add(rows.checked_mul(2)?),
            Dtype::Q8_2f if shape.len() >= 2 => n.checked_add(rows.checked_mul(2)?)?.checked_add(cols.checked_mul(2)?),
            Dtype::Q4Block => groups(n).checked_mul(18),
            Dtype::Q4Tiled if shape.len() >= 2 && cols % Q4_GROUP as u64 == 0 => {
                rows.checked_mul(cols / Q4_GROUP as u64)?.checked_mul(Q4_TILE_BYTES as u64)
            }
            Dtype::Q4Tp if shape.len() >= 2 && cols % Q4_GROUP as u64 == 0 => {
                // [nibbles rows·gpr·16][rows × (f16 lo, f16 step)][rows × ⌈gpr·5/8⌉ codes]
                let gpr = cols / Q4_GROUP as u64;
                let per_row = gpr.checked_mul(16)?.checked_add(4)?.checked_add((gpr * 5).div_ceil(8))?;
                rows.checked_mul(per_row)
            }
            _ => None,
        }
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
        assert_eq!(Dtype::Q8Row.expected_nbytes(&[8]), None);
        assert_eq!(Dtype::F32.expected_nbytes(&[u64::MAX, 2]), None);
    }
}
