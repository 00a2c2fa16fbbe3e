//! The tap schedule for float weights: a k×k convolution as k·k f32 GEMMs accumulated in place,
//! out[c_out, q] = Σ_t W_t[c_out, c_in] · X[c_in, q + off_t], with no patch matrix.
//!
//! Per band of output rows, the input rows the band needs are copied once into planes padded by
//! `pad = k / 2` zero columns on each side (row pitch `wp = w + 2·pad`) and `pad` zero rows above
//! and below. Output position q = r·wp + c (band row r, column c) then reads tap (ky, kx) at plane
//! index q + ky·wp + kx: each tap's B operand is the padded planes at one constant offset, read
//! in place, where im2col wrote every input value k·k times. Positions with c ≥ w are computed
//! from the pad and dropped (2·pad of every wp columns).
//!
//! Tasks take `CHUNK` positions × `CO_BLOCK` output channels, so that a tap's B block (c_in ×
//! CHUNK floats) stays in L2 while every 8-row block of W_t passes over it.

use super::Conv2d;
use crate::cpu::Isa;
use crate::linear::FloatW;
use crate::pool::{self, SendPtr};
use crate::sgemm::{sgemm, NR};
use crate::Weight;

/// Output positions per task (a multiple of [`NR`]).
const CHUNK: usize = 256;
/// Output channels per task.
const CO_BLOCK: usize = 128;

/// [`super::conv2d_with`] for f32 / f16 / bf16 weights; shapes checked by the caller.
pub(super) fn conv(
    isa: Isa,
    layer: Conv2d,
    x: &[f32],
    h: usize,
    w: usize,
    band_bytes: usize,
    out: &mut [f32],
) {
    let Conv2d { weight, k, bias } = layer;
    let (c_in, c_out) = (layer.c_in(), layer.c_out());
    let (pad, taps) = (k / 2, k * k);
    let wp = w + 2 * pad;
    let wt = tap_weights(weight, c_in, taps);

    // Band rows: the padded input band and the band's output both near band_bytes.
    let per_row = c_in.max(c_out) * wp * 4;
    let rows_max = (band_bytes / per_row.max(1))
        .saturating_sub(k - 1)
        .clamp(1, h);
    let (n_max, stride) = geometry(rows_max, wp, k);
    let mut band = vec![0f32; c_in * stride];
    let mut acc = vec![0f32; c_out * n_max];
    let (bp, ap, op) = (
        SendPtr(band.as_mut_ptr()),
        SendPtr(acc.as_mut_ptr()),
        SendPtr(out.as_mut_ptr()),
    );
    let mut y0 = 0;
    while y0 < h {
        let rows = rows_max.min(h - y0);
        // The band's input rows y0 − pad .. y0 + rows + pad, zero outside the image. Pad columns
        // are never written (zero since allocation).
        pool::for_each_task(c_in, |ci| {
            // SAFETY: plane ci of the band belongs to this task.
            let plane = unsafe { bp.slice(ci * stride, stride) };
            let src = &x[ci * h * w..(ci + 1) * h * w];
            for i in 0..rows + k - 1 {
                let dst = &mut plane[i * wp + pad..i * wp + pad + w];
                match (y0 + i).checked_sub(pad).filter(|&iy| iy < h) {
                    Some(iy) => dst.copy_from_slice(&src[iy * w..(iy + 1) * w]),
                    None => dst.fill(0.0),
                }
            }
        });
        let n = positions(rows, wp);
        let (chunks, co_blocks) = (n.div_ceil(CHUNK), c_out.div_ceil(CO_BLOCK));
        pool::for_each_task(chunks * co_blocks, |task| {
            let (q0, co0) = ((task / co_blocks) * CHUNK, (task % co_blocks) * CO_BLOCK);
            let (nc, m) = (CHUNK.min(n - q0), CO_BLOCK.min(c_out - co0));
            for t in 0..taps {
                let off = (t / k) * wp + t % k;
                // SAFETY: B reads c_in planes at [off + q0, off + q0 + nc) ⊂ [0, stride) (see
                // `geometry`); this task alone writes acc rows co0..co0 + m, columns q0..q0 + nc;
                // nc is a multiple of NR; the isa is the caller's, supported by the CPU.
                unsafe {
                    sgemm(
                        isa,
                        m,
                        nc,
                        c_in,
                        wt[(t * c_out + co0) * c_in..].as_ptr(),
                        c_in,
                        bp.ptr().add(off + q0),
                        stride,
                        ap.ptr().add(co0 * n + q0),
                        n,
                        t > 0,
                    )
                }
            }
            // The valid positions of this block to NCHW, plus the bias.
            for co in co0..co0 + m {
                let b = bias.map_or(0.0, |b| b[co]);
                // SAFETY: acc row co, columns q0..q0 + nc, were written by this task above.
                let src = unsafe { ap.slice(co * n + q0, nc) };
                for r in q0 / wp..(q0 + nc).div_ceil(wp).min(rows) {
                    let (c0, c1) = (q0.max(r * wp), (q0 + nc).min(r * wp + w));
                    if c0 >= c1 {
                        continue;
                    }
                    // SAFETY: output channel co, row y0 + r, columns c0 − r·wp .. c1 − r·wp: this
                    // task's channels and positions (tasks' (co, q) ranges are disjoint).
                    let dst = unsafe { op.slice(co * h * w + (y0 + r) * w + c0 - r * wp, c1 - c0) };
                    for (d, &v) in dst.iter_mut().zip(&src[c0 - q0..c1 - q0]) {
                        *d = v + b;
                    }
                }
            }
        });
        y0 += rows;
    }
}

/// (positions computed, plane stride) of a band of `rows` output rows: positions rounded up to
/// [`NR`]; the stride holds the last position's furthest tap, (k − 1)·(wp + 1) on, rounded to
/// whole cache lines and made an odd number of them, so that a B column block's c_in lines (one
/// per plane) spread over the cache sets instead of sharing a few.
fn geometry(rows: usize, wp: usize, k: usize) -> (usize, usize) {
    let n = positions(rows, wp);
    let mut stride = (n + (k - 1) * (wp + 1)).div_ceil(16) * 16;
    if (stride / 16).is_multiple_of(2) {
        stride += 16;
    }
    (n, stride)
}

/// Positions computed for a band of `rows` output rows of pitch `wp`: a whole number of [`NR`]
/// columns.
fn positions(rows: usize, wp: usize) -> usize {
    (rows * wp).div_ceil(NR) * NR
}

/// The weight `[c_out, c_in·taps]` (PyTorch's `[c_out, c_in, ky, kx]`) as f32 per tap:
/// `[taps][c_out][c_in]`, so that a tap's matrix is a plain row-major A operand.
fn tap_weights(weight: &Weight, c_in: usize, taps: usize) -> Vec<f32> {
    let c_out = weight.rows;
    let fw = FloatW::of(weight).expect("conv2d_schedule_with checked the codec");
    let mut wt = vec![0f32; taps * c_out * c_in];
    let wp = SendPtr(wt.as_mut_ptr());
    const ROWS: usize = 16;
    pool::for_each_task(c_out.div_ceil(ROWS), |blk| {
        let mut row = vec![0f32; c_in * taps];
        for co in blk * ROWS..((blk + 1) * ROWS).min(c_out) {
            fw.decode_row(co, &mut row);
            for t in 0..taps {
                // SAFETY: row co of every tap's matrix belongs to this task.
                let dst = unsafe { wp.slice((t * c_out + co) * c_in, c_in) };
                for (ci, d) in dst.iter_mut().enumerate() {
                    *d = row[ci * taps + t];
                }
            }
        }
    });
    wt
}
