//! conv2d against the naive f64 convolution: f32, f16 and bf16 weights (the VAE's codecs) on
//! every path and every float schedule (one GEMM per tap, im2col), plus a q8_row weight (im2col).
//! Float tolerance: 1e-5·Σ|w·x| per output (the f32 sums' bound); q8: the input-quantization bound
//! is covered by 2e-2 relative to Σ|w·x|.

mod common;

use cmf_format::Dtype;
use cmf_kernels::conv::{conv2d_schedule_with, conv2d_with, Schedule};
use cmf_kernels::Conv2d;
use cmf_kernels::{reference, Isa, Weight};
use common::Rng;

fn abs_conv(
    x: &[f32],
    c_in: usize,
    h: usize,
    w: usize,
    wt: &[f32],
    c_out: usize,
    k: usize,
) -> Vec<f32> {
    let xa: Vec<f32> = x.iter().map(|v| v.abs()).collect();
    let wa: Vec<f32> = wt.iter().map(|v| v.abs()).collect();
    let mut out = vec![0f32; c_out * h * w];
    reference::conv2d(&xa, c_in, h, w, &wa, c_out, k, None, &mut out);
    out
}

/// Every schedule that takes float weights: the default (the tap schedule), the tap schedule
/// with bands so small that each image spans several (band edges, a short last band), and
/// im2col.
fn float_schedules() -> [(&'static str, Option<Schedule>); 4] {
    [
        ("default", None),
        ("taps, 1 row a band", Some(Schedule::Taps { band_bytes: 1 })),
        (
            "taps, small bands",
            Some(Schedule::Taps {
                band_bytes: 8 << 10,
            }),
        ),
        ("im2col", Some(Schedule::Im2col)),
    ]
}

#[test]
fn conv_matches_reference() {
    let mut rng = Rng(30);
    for (c_in, c_out, h, w, k) in [
        (3usize, 5usize, 7usize, 9usize, 3usize),
        (16, 8, 5, 4, 1),
        (8, 33, 6, 6, 3),
        (1, 1, 1, 1, 3),
        // more output channels than a task's block (128), positions past one task's chunk (256)
        (9, 130, 11, 29, 3),
        (20, 3, 17, 40, 1),
    ] {
        let x = rng.vec(c_in * h * w, 1.0);
        let bias = rng.vec(c_out, 0.1);
        for dtype in [Dtype::F32, Dtype::F16, Dtype::Bf16] {
            let bytes = common::random_weight(&mut rng, dtype, c_out, c_in * k * k);
            let weight = Weight::new(dtype, c_out, c_in * k * k, &bytes).unwrap();
            let mut wt = vec![0f32; c_out * c_in * k * k];
            for r in 0..c_out {
                reference::decode_row(
                    &weight,
                    r,
                    &mut wt[r * c_in * k * k..(r + 1) * c_in * k * k],
                );
            }
            let mut want = vec![0f32; c_out * h * w];
            reference::conv2d(&x, c_in, h, w, &wt, c_out, k, Some(&bias), &mut want);
            let scale = abs_conv(&x, c_in, h, w, &wt, c_out, k);
            for isa in Isa::all_supported() {
                for (name, schedule) in float_schedules() {
                    let mut got = vec![f32::NAN; c_out * h * w];
                    let layer = Conv2d {
                        weight: &weight,
                        k,
                        bias: Some(&bias),
                    };
                    match schedule {
                        None => conv2d_with(isa, layer, &x, h, w, &mut got),
                        Some(s) => conv2d_schedule_with(isa, s, layer, &x, h, w, &mut got),
                    }
                    for i in 0..got.len() {
                        assert!(
                            (got[i] - want[i]).abs() <= 1e-5 * scale[i] + 1e-6,
                            "{isa} {name} {dtype} conv {c_in}->{c_out} {h}x{w} k{k} [{i}]: {} vs {}",
                            got[i],
                            want[i]
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn conv_with_quantized_weight() {
    let mut rng = Rng(31);
    let (c_in, c_out, h, w, k) = (8usize, 12usize, 5usize, 7usize, 3usize);
    let x = rng.vec(c_in * h * w, 1.0);
    let data = common::random_weight(&mut rng, Dtype::Q8Row, c_out, c_in * 9);
    let weight = Weight::new(Dtype::Q8Row, c_out, c_in * 9, &data).unwrap();
    let mut wt = vec![0f32; c_out * c_in * 9];
    for r in 0..c_out {
        reference::decode_row(&weight, r, &mut wt[r * c_in * 9..(r + 1) * c_in * 9]);
    }
    let mut want = vec![0f32; c_out * h * w];
    reference::conv2d(&x, c_in, h, w, &wt, c_out, k, None, &mut want);
    let scale = abs_conv(&x, c_in, h, w, &wt, c_out, k);
    for isa in Isa::all_supported() {
        let mut got = vec![0f32; c_out * h * w];
        let layer = Conv2d {
            weight: &weight,
            k,
            bias: None,
        };
        conv2d_with(isa, layer, &x, h, w, &mut got);
        for i in 0..got.len() {
            assert!(
                (got[i] - want[i]).abs() <= 2e-2 * scale[i] + 1e-6,
                "{isa} [{i}]: {} vs {}",
                got[i],
                want[i]
            );
        }
    }
}
