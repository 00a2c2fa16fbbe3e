//! Test helpers: the seeded generator (cmf-test-support) and random payloads for every matrix
//! codec.
#![allow(dead_code)]

use cmf_format::Dtype;
use half::{bf16, f16};

pub use cmf_test_support::Rng;

fn push_f16(out: &mut Vec<u8>, v: f32) {
    out.extend_from_slice(&f16::from_f32(v).to_le_bytes());
}

/// A random payload of `dtype` for a [rows, cols] matrix (random codes and plausible scales).
pub fn random_weight(rng: &mut Rng, dtype: Dtype, rows: usize, cols: usize) -> Vec<u8> {
    let n = rows * cols;
    let mut out = Vec::new();
    match dtype {
        Dtype::F32 => (0..n).for_each(|_| out.extend_from_slice(&(rng.f32() * 0.5).to_le_bytes())),
        Dtype::F16 => (0..n).for_each(|_| push_f16(&mut out, rng.f32() * 0.5)),
        Dtype::Bf16 => (0..n)
            .for_each(|_| out.extend_from_slice(&bf16::from_f32(rng.f32() * 0.5).to_le_bytes())),
        Dtype::Q8Row | Dtype::Q8_2f => {
            (0..n).for_each(|_| out.push(rng.next_u64() as u8)); // the full i8 range, −128 included
            (0..rows).for_each(|_| push_f16(&mut out, 0.001 + 0.01 * rng.f32().abs()));
            if dtype == Dtype::Q8_2f {
                (0..cols).for_each(|_| push_f16(&mut out, 0.2 + 2.0 * rng.f32().abs()));
            }
        }
        Dtype::Q4Block => {
            let g = n.div_ceil(32);
            (0..g * 16).for_each(|_| out.push(rng.next_u64() as u8));
            (0..g).for_each(|_| push_f16(&mut out, 0.01 + 0.05 * rng.f32().abs()));
        }
        Dtype::Q4Tiled => {
            for _ in 0..rows * cols / 32 {
                push_f16(&mut out, 0.01 + 0.05 * rng.f32().abs());
                (0..16).for_each(|_| out.push(rng.next_u64() as u8));
            }
        }
        Dtype::Q4Tp => {
            let gpr = cols / 32;
            (0..rows * gpr * 16).for_each(|_| out.push(rng.next_u64() as u8));
            for _ in 0..rows {
                push_f16(&mut out, -7.0 + 2.0 * rng.f32()); // lo (log2 of the smallest scale)
                push_f16(&mut out, 0.05 + 0.1 * rng.f32().abs()); // step
            }
            let stride = (gpr * 5).div_ceil(8);
            (0..rows * stride).for_each(|_| out.push(rng.next_u64() as u8));
        }
        Dtype::U8 => unreachable!(),
    }
    out
}

/// The matrix codecs with the shapes each accepts.
pub const CODECS: [Dtype; 8] = [
    Dtype::F32,
    Dtype::F16,
    Dtype::Bf16,
    Dtype::Q8Row,
    Dtype::Q8_2f,
    Dtype::Q4Block,
    Dtype::Q4Tiled,
    Dtype::Q4Tp,
];

pub fn needs_cols32(d: Dtype) -> bool {
    matches!(d, Dtype::Q4Tiled | Dtype::Q4Tp)
}
