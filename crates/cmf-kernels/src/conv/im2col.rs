//! The im2col schedule: per band of output rows, one row of `c_in·k·k` patch values per output
//! pixel, multiplied on the weight codec's packed GEMM, then transposed to NCHW with the bias.

use super::{Conv2d, BAND_BYTES};
use crate::cpu::Isa;
use crate::pool::{self, SendPtr};

/// [`super::conv2d_with`] for any weight codec; shapes checked by the caller.
pub(super) fn conv(isa: Isa, layer: Conv2d, x: &[f32], h: usize, w: usize, out: &mut [f32]) {
    let Conv2d { weight, k, bias } = layer;
    let (c_in, c_out) = (layer.c_in(), layer.c_out());
    let kk = c_in * k * k;
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
