//! 2-D convolution for the Flux VAE decoder: NCHW, stride 1, kernel 1×1 or 3×3 with "same"
//! padding (1 for 3×3), via im2col + [`crate::matmul`] (so every weight codec works and the
//! products run on the packed GEMM tiles).
//!
//! The image is processed in bands of output rows so that the im2col matrix stays near
//! `BAND_BYTES` however large the image (the decoder's last stages are 128 channels × 1024²).

use crate::cpu::Isa;
use crate::pool::{self, SendPtr};
use crate::Weight;

/// Target size of one band's im2col matrix.
const BAND_BYTES: usize = 24 << 20;

/// out[c_out, h, w] = conv(x[c_in, h, w], weight) + bias, for one sample.
/// `weight` is `[c_out, c_in·k·k]` (PyTorch's `[c_out, c_in, k, k]` flattened), k = 1 or 3.
#[allow(clippy::too_many_arguments)]
pub fn conv2d(
    x: &[f32],
    c_in: usize,
    h: usize,
    w: usize,
    weight: &Weight,
    k: usize,
    bias: Option<&[f32]>,
    out: &mut [f32],
) {
    conv2d_with(crate::cpu::active(), x, c_in, h, w, weight, k, bias, out)
}

/// [`conv2d`] on a given path (tests and benchmarks).
#[doc(hidden)]
#[allow(clippy::too_many_arguments)]
pub fn conv2d_with(
    isa: Isa,
    x: &[f32],
    c_in: usize,
    h: usize,
    w: usize,
    weight: &Weight,
    k: usize,
    bias: Option<&[f32]>,
    out: &mut [f32],
) {
    assert!(k == 1 || k == 3, "conv2d: kernel {k} (only 1×1 and 3×3)");
    let c_out = weight.rows;
    let kk = c_in * k * k;
    assert_eq!(
        weight.cols, kk,
        "conv2d: weight has {} columns, c_in·k·k = {kk}",
        weight.cols
    );
    assert_eq!(x.len(), c_in * h * w, "conv2d: x is not [{c_in}, {h}, {w}]");
    assert_eq!(
        out.len(),
        c_out * h * w,
        "conv2d: out is not [{c_out}, {h}, {w}]"
    );
    if let Some(b) = bias {
        assert_eq!(b.len(), c_out, "conv2d: bias needs {c_out} values");
    }
    if h == 0 || w == 0 {
        return;
    }
    let band = (BAND_BYTES / (w * kk * 4).max(1)).clamp(1, h);
    let mut cols = vec![0f32; band * w * kk];
    let mut y = vec![0f32; band * w * c_out];
    let pad = (k / 2) as isize;
    let op = SendPtr(out.as_mut_ptr());
    let mut y0 = 0;
    while y0 < h {
        let rows = band.min(h - y0);
        let n = rows * w;
        // im2col: one row per output pixel, columns in the weight's (c_in, ky, kx) order.
        let cp = SendPtr(cols.as_mut_ptr());
        pool::for_each_task(rows, |r| {
            let oy = (y0 + r) as isize;
            // SAFETY: pixel row r of the band belongs to this task.
            let dst = unsafe { cp.slice(r * w * kk, w * kk) };
            for ox in 0..w {
                let d = &mut dst[ox * kk..(ox + 1) * kk];
                for ci in 0..c_in {
                    let plane = &x[ci * h * w..(ci + 1) * h * w];
                    for ky in 0..k {
                        let iy = oy + ky as isize - pad;
                        for kx in 0..k {
                            let ix = ox as isize + kx as isize - pad;
                            let inside = iy >= 0 && iy < h as isize && ix >= 0 && ix < w as isize;
                            d[(ci * k + ky) * k + kx] = if inside {
                                plane[iy as usize * w + ix as usize]
                            } else {
                                0.0
                            };
                        }
                    }
                }
            }
        });
        crate::linear::matmul_with(isa, weight, &cols[..n * kk], n, &mut y[..n * c_out]);
        // [pixels, c_out] → [c_out, pixels] plus bias, TR channels per task: each cache line of
        // `y` (16 channels of one pixel) is read once instead of once per channel.
        const TR: usize = 16;
        pool::for_each_task(c_out.div_ceil(TR), |blk| {
            let (c0, c1) = (blk * TR, ((blk + 1) * TR).min(c_out));
            // SAFETY: channels c0..c1, rows y0..y0+rows, belong to this task.
            let mut dst: Vec<&mut [f32]> = (c0..c1)
                .map(|co| unsafe { op.slice(co * h * w + y0 * w, n) })
                .collect();
            let b: Vec<f32> = (c0..c1).map(|co| bias.map_or(0.0, |b| b[co])).collect();
            for p in 0..n {
                let src = &y[p * c_out + c0..p * c_out + c1];
                for ((d, &v), &bb) in dst.iter_mut().zip(src).zip(&b) {
                    d[p] = v + bb;
                }
            }
        });
        y0 += rows;
    }
}
