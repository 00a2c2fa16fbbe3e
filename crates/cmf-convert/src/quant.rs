//! The `--quant` choice and which codec each tensor gets.
//!
//! Policy (all importers): tensors with fewer than two dimensions (norm weights, biases) stay
//! f32 whatever the choice — they are tiny, and RMSNorm weights near 1.0 lose most of their
//! information in 8 bits. Matrices (including the embedding table and `lm_head`) take the chosen
//! codec. A matrix whose shape the codec cannot hold (q4 needs a row length that is a multiple of
//! 32) falls back to q8_row, and that fallback is reported.

use std::str::FromStr;

use cmf_format::{Dtype, QuantType};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quant {
    /// q8_row: int8 per row with an f16 scale (≈8.1 bits/weight).
    Q8,
    /// q8_2f: int8 with a row and a column f16 scale.
    Q8_2f,
    /// q4_tiled: 4-bit, one f16 scale per 32 weights in an 18-byte tile (4.5 bits/weight).
    Q4,
    F16,
    Bf16,
    F32,
}

impl Quant {
    pub const NAMES: &'static str = "q8, q8_2f, q4, f16, bf16, f32";

    /// The codec matrices get.
    pub fn matrix_dtype(self) -> Dtype {
        match self {
            Quant::Q8 => Dtype::Q8Row,
            Quant::Q8_2f => Dtype::Q8_2f,
            Quant::Q4 => Dtype::Q4Tiled,
            Quant::F16 => Dtype::F16,
            Quant::Bf16 => Dtype::Bf16,
            Quant::F32 => Dtype::F32,
        }
    }

    /// The header's informational `quant_type` (the reference reader knows only these names;
    /// q4_tiled files report Q4_BLOCK, the family the reference uses for them).
    pub fn header_quant_type(self) -> QuantType {
        match self {
            Quant::Q8 => QuantType::Q8Row,
            Quant::Q8_2f => QuantType::Q8_2f,
            Quant::Q4 => QuantType::Q4Block,
            Quant::F16 => QuantType::F16,
            Quant::Bf16 => QuantType::BF16,
            Quant::F32 => QuantType::F32,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Quant::Q8 => "q8",
            Quant::Q8_2f => "q8_2f",
            Quant::Q4 => "q4",
            Quant::F16 => "f16",
            Quant::Bf16 => "bf16",
            Quant::F32 => "f32",
        }
    }

    /// The codec for one tensor of `shape` (row-major, `[out, in]` for matrices).
    pub fn dtype_for(self, shape: &[usize]) -> Dtype {
        if shape.len() < 2 {
            return Dtype::F32;
        }
        let d = self.matrix_dtype();
        let shape64: Vec<u64> = shape.iter().map(|&s| s as u64).collect();
        if d.expected_nbytes(&shape64).is_some() {
            d
        } else {
            Dtype::Q8Row
        }
    }
}

impl FromStr for Quant {
    type Err = String;

    fn from_str(s: &str) -> Result<Quant, String> {
        Ok(match s {
            "q8" | "q8_row" => Quant::Q8,
            "q8_2f" => Quant::Q8_2f,
            "q4" | "q4_tiled" => Quant::Q4,
            "f16" => Quant::F16,
            "bf16" => Quant::Bf16,
            "f32" => Quant::F32,
            other => {
                return Err(format!(
                    "unknown quantization '{other}' (expected one of: {})",
                    Quant::NAMES
                ))
            }
        })
    }
}

impl std::fmt::Display for Quant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vectors_stay_f32_and_q4_falls_back() {
        assert_eq!(Quant::Q4.dtype_for(&[64]), Dtype::F32);
        assert_eq!(Quant::Q4.dtype_for(&[8, 64]), Dtype::Q4Tiled);
        assert_eq!(Quant::Q4.dtype_for(&[8, 48]), Dtype::Q8Row);
        assert_eq!(Quant::Bf16.dtype_for(&[8, 48]), Dtype::Bf16);
        assert_eq!("q8".parse::<Quant>(), Ok(Quant::Q8));
        assert!("q3".parse::<Quant>().unwrap_err().contains("q8_2f"));
    }
}
