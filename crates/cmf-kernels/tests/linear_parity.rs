//! Every codec × every ISA path this CPU runs × odd shapes, matvec and matmul, against
//! `reference` (decode each row to f32, plain dot).
//!
//! Tolerance per output y_r (see `docs/kernels.md`):
//! - input quantization (int8 codecs): Σ_b (d_b/2)·Σ_{i∈b} |u_i|, where d_b is the block's input
//!   scale and u the weights multiplying the quantized input (q8_2f: the weight without its column
//!   factor, since the column factor is folded into the input). This is the exact worst case of
//!   rounding each input to the nearest step.
//! - f32 arithmetic: 1e-5 · Σ_i (|w_i| + max|w|)·|x_i| (blocked sums differ from the reference's
//!   serial sum by a few hundred ulps of the absolute sum at these lengths; the max|w| term covers
//!   the q4 offset correction, which cancels terms of that size).

mod common;

use cmf_format::Dtype;
use cmf_kernels::{
    matmul_multi_with, matmul_with, matvec_multi_with, matvec_with, reference, Isa, Weight,
};
use common::*;

fn f16v(b: &[u8], i: usize) -> f32 {
    half::f16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32()
}

/// Per-output tolerance for one input row.
fn tolerance(w: &Weight, x: &[f32]) -> Vec<f32> {
    let (rows, cols) = (w.rows, w.cols);
    let col: Vec<f32> = if w.dtype == Dtype::Q8_2f {
        let off = rows * cols + 2 * rows;
        (0..cols).map(|i| f16v(&w.data[off..], i)).collect()
    } else {
        vec![1.0; cols]
    };
    let int8_input = w.dtype.is_quantized() && !(w.dtype == Dtype::Q4Block && cols % 32 != 0);
    let xe: Vec<f32> = x.iter().zip(&col).map(|(a, c)| a * c).collect();
    let d: Vec<f32> = xe
        .chunks(32)
        .map(|b| b.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0)
        .collect();
    let mut row = vec![0f32; cols];
    (0..rows)
        .map(|r| {
            reference::decode_row(w, r, &mut row);
            let mrow = row.iter().fold(0f32, |m, v| m.max(v.abs()));
            let fp: f32 = row
                .iter()
                .zip(x)
                .map(|(wv, xv)| (wv.abs() + mrow) * xv.abs())
                .sum::<f32>()
                * 1e-5;
            let q: f32 = if int8_input {
                (0..cols)
                    .map(|i| {
                        if col[i] != 0.0 {
                            0.5001 * d[i / 32] * (row[i] / col[i]).abs()
                        } else {
                            0.0
                        }
                    })
                    .sum()
            } else {
                0.0
            };
            fp + q + 1e-6
        })
        .collect()
}

fn shapes(d: Dtype) -> Vec<(usize, usize)> {
    if needs_cols32(d) {
        vec![
            (1, 32),
            (5, 64),
            (16, 96),
            (33, 160),
            (67, 288),
            (130, 1024),
        ]
    } else {
        vec![
            (1, 1),
            (3, 7),
            (5, 64),
            (16, 96),
            (17, 33),
            (33, 150),
            (40, 255),
            (67, 288),
            (130, 1000),
        ]
    }
}

fn check(label: &str, got: &[f32], want: &[f32], tol: &[f32]) -> f32 {
    let mut worst = 0f32;
    for (i, ((g, w), t)) in got.iter().zip(want).zip(tol).enumerate() {
        let err = (g - w).abs();
        assert!(
            err <= *t,
            "{label}: output {i}: got {g}, reference {w}, |err| {err} > tolerance {t}"
        );
        worst = worst.max(err / t);
    }
    worst
}

#[test]
fn matvec_matches_reference_for_every_codec_and_path() {
    let mut rng = Rng(1);
    for isa in Isa::all_supported() {
        for dtype in CODECS {
            for (rows, cols) in shapes(dtype) {
                let data = random_weight(&mut rng, dtype, rows, cols);
                let w = Weight::new(dtype, rows, cols, &data).unwrap();
                let x = rng.activations(cols);
                let mut want = vec![0f32; rows];
                reference::matvec(&w, &x, &mut want);
                let mut got = vec![f32::NAN; rows];
                matvec_with(isa, &w, &x, &mut got);
                check(
                    &format!("matvec {isa} {dtype} [{rows}, {cols}]"),
                    &got,
                    &want,
                    &tolerance(&w, &x),
                );
            }
        }
    }
}

/// The grouped decode product (q|k|v, gate|up): one shared input quantization and one dispatch
/// must give, per weight, the reference within tolerance and exactly the single-weight result.
/// Covers a shared codec (the fused path), a mixed group (per-weight fallback), and a tiny
/// weight next to a large one (uneven task split).
#[test]
fn matvec_multi_matches_single_matvecs() {
    let mut rng = Rng(11);
    let cols = 256;
    for isa in Isa::all_supported() {
        for dtype in CODECS {
            let groups: [&[(Dtype, usize)]; 3] = [
                &[(dtype, 300), (dtype, 37), (dtype, 64)],
                &[(dtype, 5), (dtype, 4096)],
                &[(dtype, 40), (Dtype::F32, 24)],
            ];
            for group in groups {
                let datas: Vec<Vec<u8>> = group
                    .iter()
                    .map(|&(d, rows)| random_weight(&mut rng, d, rows, cols))
                    .collect();
                let ws: Vec<Weight> = group
                    .iter()
                    .zip(&datas)
                    .map(|(&(d, rows), b)| Weight::new(d, rows, cols, b).unwrap())
                    .collect();
                let x = rng.activations(cols);
                let mut outs: Vec<Vec<f32>> = ws.iter().map(|w| vec![f32::NAN; w.rows]).collect();
                let refs: Vec<&Weight> = ws.iter().collect();
                let mut ys: Vec<&mut [f32]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
                matvec_multi_with(isa, &refs, &x, &mut ys);
                for (w, got) in ws.iter().zip(&outs) {
                    let label = format!("matvec_multi {isa} {} [{}, {cols}]", w.dtype, w.rows);
                    let mut single = vec![f32::NAN; w.rows];
                    matvec_with(isa, w, &x, &mut single);
                    let same = got
                        .iter()
                        .zip(&single)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{label}: differs from matvec_with");
                    let mut want = vec![0f32; w.rows];
                    reference::matvec(w, &x, &mut want);
                    check(&label, got, &want, &tolerance(w, &x));
                }
            }
        }
    }
}

/// The grouped product over several input rows equals one `matmul_with` per weight, bit for bit:
/// a shared codec (one quantization, one dispatch for n ≤ 16), a mixed group (one by one), a
/// tiny weight beside a large one, and n past the few-row limit (the GEMM).
#[test]
fn matmul_multi_matches_single_matmuls() {
    let mut rng = Rng(13);
    let cols = 160;
    for isa in Isa::all_supported() {
        for dtype in CODECS {
            let groups: [&[(Dtype, usize)]; 3] = [
                &[(dtype, 300), (dtype, 37), (dtype, 64)],
                &[(dtype, 5), (dtype, 1100)],
                &[(dtype, 40), (Dtype::F32, 24)],
            ];
            for (gi, group) in groups.iter().enumerate() {
                let n = [2, 7, 16, 17][(gi + dtype as usize) % 4];
                let datas: Vec<Vec<u8>> = group
                    .iter()
                    .map(|&(d, rows)| random_weight(&mut rng, d, rows, cols))
                    .collect();
                let ws: Vec<Weight> = group
                    .iter()
                    .zip(&datas)
                    .map(|(&(d, rows), b)| Weight::new(d, rows, cols, b).unwrap())
                    .collect();
                let x = rng.activations(n * cols);
                let mut outs: Vec<Vec<f32>> =
                    ws.iter().map(|w| vec![f32::NAN; n * w.rows]).collect();
                let refs: Vec<&Weight> = ws.iter().collect();
                let mut ys: Vec<&mut [f32]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
                matmul_multi_with(isa, &refs, &x, n, &mut ys);
                for (w, got) in ws.iter().zip(&outs) {
                    let mut single = vec![f32::NAN; n * w.rows];
                    matmul_with(isa, w, &x, n, &mut single);
                    let same = got
                        .iter()
                        .zip(&single)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "matmul_multi {isa} {} [{}, {cols}] n={n}: differs from matmul_with",
                        w.dtype, w.rows
                    );
                }
            }
        }
    }
}

#[test]
fn matmul_matches_reference_for_every_codec_and_path() {
    let mut rng = Rng(2);
    let ns: Vec<usize> = (1..=17).chain([31, 64]).collect();
    for isa in Isa::all_supported() {
        for dtype in CODECS {
            for (si, (rows, cols)) in shapes(dtype).into_iter().enumerate() {
                let data = random_weight(&mut rng, dtype, rows, cols);
                let w = Weight::new(dtype, rows, cols, &data).unwrap();
                for (ni, &n) in ns.iter().enumerate() {
                    // Every n on the small shapes; a rotating subset on the large ones (time).
                    if rows * cols > 20_000 && (ni + si) % 4 != 0 {
                        continue;
                    }
                    let x = rng.activations(n * cols);
                    let mut want = vec![0f32; n * rows];
                    reference::matmul(&w, &x, n, &mut want);
                    let mut got = vec![f32::NAN; n * rows];
                    matmul_with(isa, &w, &x, n, &mut got);
                    for t in 0..n {
                        let tol = tolerance(&w, &x[t * cols..(t + 1) * cols]);
                        check(
                            &format!("matmul {isa} {dtype} [{rows}, {cols}] n={n} t={t}"),
                            &got[t * rows..(t + 1) * rows],
                            &want[t * rows..(t + 1) * rows],
                            &tol,
                        );
                    }
                }
            }
        }
    }
}

/// f32 rounding only (no input quantization term): 1e-5 · Σ_i (|w_i| + max|w|)·|x_i| per output,
/// for two kernels that quantize the input the same way but sum in different orders.
fn rounding_tolerance(w: &Weight, x: &[f32]) -> Vec<f32> {
    let mut row = vec![0f32; w.cols];
    (0..w.rows)
        .map(|r| {
            reference::decode_row(w, r, &mut row);
            let mrow = row.iter().fold(0f32, |m, v| m.max(v.abs()));
            let s: f32 = row
                .iter()
                .zip(x)
                .map(|(wv, xv)| (wv.abs() + mrow) * xv.abs())
                .sum();
            1e-5 * s + 1e-6
        })
        .collect()
}

/// A product over a few input rows (n ≤ 16: decode of a batch of sequences) gives every row
/// what the matvec gives it alone, on every codec and path: bit for bit, except the AVX-512 q8
/// strips (n ≥ 2), which sum a row's blocks in another order and must agree to f32 rounding.
/// So a sequence's outputs do not depend on how many others share its step beyond that.
/// Odd shapes: a row tail shorter than one block, row counts that leave a partial strip, input
/// counts that leave a partial tile. n = 17, past the few-row kernels (the GEMM, whose AVX2
/// panels use the unquantized input), must agree within the reference tolerance.
#[test]
fn few_row_matmul_equals_matvec_per_row() {
    let mut rng = Rng(12);
    for isa in Isa::all_supported() {
        for dtype in CODECS {
            let shapes: &[(usize, usize)] = if needs_cols32(dtype) {
                &[(7, 32), (33, 96), (19, 224), (65, 576)]
            } else {
                &[(7, 5), (33, 96), (19, 200), (65, 577), (3, 1000), (40, 31)]
            };
            for &(rows, cols) in shapes {
                let data = random_weight(&mut rng, dtype, rows, cols);
                let w = Weight::new(dtype, rows, cols, &data).unwrap();
                for n in 1..=17 {
                    let strips = isa == Isa::Avx512
                        && matches!(dtype, Dtype::Q8Row | Dtype::Q8_2f)
                        && n >= 2;
                    let x = rng.activations(n * cols);
                    let mut got = vec![f32::NAN; n * rows];
                    matmul_with(isa, &w, &x, n, &mut got);
                    for t in 0..n {
                        let xt = &x[t * cols..(t + 1) * cols];
                        let mut single = vec![f32::NAN; rows];
                        matvec_with(isa, &w, xt, &mut single);
                        let row = &got[t * rows..(t + 1) * rows];
                        let label = format!("matmul {isa} {dtype} [{rows}, {cols}] n={n} t={t}");
                        if n == 17 {
                            check(&label, row, &single, &tolerance(&w, xt));
                        } else if strips {
                            check(&label, row, &single, &rounding_tolerance(&w, xt));
                        } else if let Some(i) =
                            (0..rows).find(|&i| row[i].to_bits() != single[i].to_bits())
                        {
                            panic!(
                                "{label} output {i}: {} but the matvec gives {}",
                                row[i], single[i]
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn float_codecs_are_f32_accurate() {
    // The float paths must stay far inside the generic tolerance: 1e-6 relative to Σ|w·x|.
    let mut rng = Rng(3);
    for isa in Isa::all_supported() {
        for dtype in [Dtype::F32, Dtype::F16, Dtype::Bf16] {
            let (rows, cols) = (37, 1000);
            let data = random_weight(&mut rng, dtype, rows, cols);
            let w = Weight::new(dtype, rows, cols, &data).unwrap();
            let x = rng.vec(cols, 1.0);
            let mut want = vec![0f64; rows];
            let mut row = vec![0f32; cols];
            let mut scale = vec![0f64; rows];
            for r in 0..rows {
                reference::decode_row(&w, r, &mut row);
                want[r] = row.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
                scale[r] = row
                    .iter()
                    .zip(&x)
                    .map(|(a, b)| (*a as f64 * *b as f64).abs())
                    .sum();
            }
            let mut got = vec![0f32; rows];
            matvec_with(isa, &w, &x, &mut got);
            for r in 0..rows {
                assert!(
                    (got[r] as f64 - want[r]).abs() <= 1e-6 * scale[r],
                    "{isa} {dtype} row {r}: {} vs {}",
                    got[r],
                    want[r]
                );
            }
        }
    }
}

#[test]
fn bad_weights_are_refused() {
    let data = vec![0u8; 10];
    assert!(Weight::new(Dtype::F32, 2, 2, &data).is_err());
    assert!(Weight::new(Dtype::Q4Tiled, 1, 48, &[0u8; 27]).is_err());
    assert!(Weight::new(Dtype::U8, 1, 10, &data).is_err());
    assert!(Weight::new(Dtype::Q8Row, 2, 4, &[0u8; 12]).is_ok());
}

#[test]
fn non_finite_inputs_propagate() {
    // A NaN or ∞ input must not vanish in the int8 input quantization: every output it feeds is NaN.
    let mut rng = Rng(4);
    for isa in Isa::all_supported() {
        for dtype in CODECS {
            let (rows, cols) = (5usize, 96usize);
            let data = random_weight(&mut rng, dtype, rows, cols);
            let w = Weight::new(dtype, rows, cols, &data).unwrap();
            for bad in [f32::NAN, f32::INFINITY] {
                let mut x = rng.vec(2 * cols, 1.0);
                x[40] = bad;
                let mut y = vec![0f32; 2 * rows];
                matmul_with(isa, &w, &x, 2, &mut y);
                assert!(
                    y[..rows].iter().all(|v| !v.is_finite()),
                    "{isa} {dtype} matmul with {bad}: {:?}",
                    &y[..rows]
                );
                assert!(
                    y[rows..].iter().all(|v| v.is_finite()),
                    "{isa} {dtype}: the clean row stays finite"
                );
                let mut y1 = vec![0f32; rows];
                matvec_with(isa, &w, &x[..cols], &mut y1);
                assert!(
                    y1.iter().all(|v| !v.is_finite()),
                    "{isa} {dtype} matvec with {bad}: {y1:?}"
                );
            }
        }
    }
}
