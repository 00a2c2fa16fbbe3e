//! Scalar reference kernels: decode one row to f32, then a plain dot product.
//! Slow on purpose and obviously right; every optimised kernel is tested against these.

use crate::Weight;
use cmf_format::Dtype;
use half::{bf16, f16};

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32()
}

/// Decodes row `r` of `w` into `out[cols]`.
pub fn decode_row(w: &Weight, r: usize, out: &mut [f32]) {
    let (rows, cols, d) = (w.rows, w.cols, w.data);
    assert_eq!(out.len(), cols);
    match w.dtype {
        Dtype::F32 => {
            for (c, o) in out.iter_mut().enumerate() {
                let i = (r * cols + c) * 4;
                *o = f32::from_le_bytes([d[i], d[i + 1], d[i + 2], d[i + 3]]);
            }
        }
        Dtype::F16 => out
            .iter_mut()
            .enumerate()
            .for_each(|(c, o)| *o = f16_at(d, r * cols + c)),
        Dtype::Bf16 => out.iter_mut().enumerate().for_each(|(c, o)| {
            let i = (r * cols + c) * 2;
            *o = bf16::from_le_bytes([d[i], d[i + 1]]).to_f32()
        }),
        Dtype::Q8Row => {
            let s = f16_at(&d[rows * cols..], r);
            for (c, o) in out.iter_mut().enumerate() {
                *o = d[r * cols + c] as i8 as f32 * s;
            }
        }
        Dtype::Q8_2f => {
            let s = f16_at(&d[rows * cols..], r);
            let col = &d[rows * cols + rows * 2..];
            for (c, o) in out.iter_mut().enumerate() {
                *o = d[r * cols + c] as i8 as f32 * s * f16_at(col, c);
            }
        }
        Dtype::Q4Block => {
            let n = rows * cols;
            let scales = &d[n.div_ceil(32) * 16..];
            for (c, o) in out.iter_mut().enumerate() {
                let k = r * cols + c;
                let byte = d[k / 2];
                let q = if k.is_multiple_of(2) {
                    byte & 15
                } else {
                    byte >> 4
                };
                *o = (q as f32 - 8.0) * f16_at(scales, k / 32);
            }
        }
        Dtype::Q4Tiled => {
            let tiles = cols / 32;
            for (c, o) in out.iter_mut().enumerate() {
                let t = &d[(r * tiles + c / 32) * 18..][..18];
                let byte = t[2 + (c % 32) / 2];
                let q = if c % 2 == 0 { byte & 15 } else { byte >> 4 };
                *o = (q as f32 - 8.0) * f16_at(t, 0);
            }
        }
        Dtype::Q4Tp => {
            // [nibbles rows·gpr·16][rows × (f16 lo, f16 step)][rows × ⌈gpr·5/8⌉ 5-bit codes]
            let gpr = cols / 32;
            let (params, codes) = crate::codec::q4tp_planes(d, rows, gpr);
            let ladder = crate::codec::q4tp_ladder(params, r);
            let stride = crate::codec::q4tp_code_stride(gpr);
            for (c, o) in out.iter_mut().enumerate() {
                let g = c / 32;
                let s = ladder[crate::codec::q4tp_code(&codes[r * stride..(r + 1) * stride], g)];
                let byte = d[(r * gpr + g) * 16 + (c % 32) / 2];
                let q = if c % 2 == 0 { byte & 15 } else { byte >> 4 };
                *o = (q as f32 - 8.0) * s;
            }
        }
        other => panic!("reference::decode_row: codec {other} is not a matrix codec"),
    }
}

pub fn matvec(w: &Weight, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), w.cols);
    assert_eq!(y.len(), w.rows);
    let mut row = vec![0f32; w.cols];
    for (r, yr) in y.iter_mut().enumerate() {
        decode_row(w, r, &mut row);
        *yr = row.iter().zip(x).map(|(a, b)| a * b).sum();
    }
}

pub fn matmul(w: &Weight, x: &[f32], n: usize, y: &mut [f32]) {
    assert_eq!(x.len(), n * w.cols);
    assert_eq!(y.len(), n * w.rows);
    let mut row = vec![0f32; w.cols];
    for r in 0..w.rows {
        decode_row(w, r, &mut row);
        for t in 0..n {
            y[t * w.rows + r] = row
                .iter()
                .zip(&x[t * w.cols..(t + 1) * w.cols])
                .map(|(a, b)| a * b)
                .sum();
        }
    }
}
