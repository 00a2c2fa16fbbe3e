//! 2-D convolution for the Flux VAE decoder: NCHW, stride 1, kernel 1×1 or 3×3 with "same"
//! padding (1 for 3×3). Two schedules, both in bands of output rows so that their scratch stays
//! near `BAND_BYTES` however large the image (the decoder's last stages are 128 channels × 1024²):
//! - float weights (f32 / f16 / bf16, what the converters write for the VAE): [`taps`], one f32
//!   GEMM per kernel tap over the input read in place at the tap's offset;
//! - quantized weights: [`im2col`], the patches copied out and multiplied on the codec's packed
//!   GEMM ([`crate::matmul_with`]), so every weight codec works.

mod im2col;
mod taps;

use crate::cpu::Isa;
use crate::linear::FloatW;
use crate::Weight;

/// Target size of one band's scratch (the im2col matrix; the padded input band and its output).
const BAND_BYTES: usize = 24 << 20;

/// One convolution layer: `weight` is `[c_out, c_in·k·k]` (PyTorch's `[c_out, c_in, k, k]`
/// flattened), k = 1 or 3, and an optional bias of c_out values.
#[derive(Clone, Copy, Debug)]
pub struct Conv2d<'a> {
    pub weight: &'a Weight<'a>,
    pub k: usize,
    pub bias: Option<&'a [f32]>,
}

impl Conv2d<'_> {
    /// Input channels: the weight's columns over the kernel's taps.
    pub fn c_in(&self) -> usize {
        self.weight.cols / (self.k * self.k).max(1)
    }

    pub fn c_out(&self) -> usize {
        self.weight.rows
    }
}

/// out[c_out, h, w] = conv(x[c_in, h, w]) + bias, for one sample.
pub fn conv2d(layer: Conv2d, x: &[f32], h: usize, w: usize, out: &mut [f32]) {
    conv2d_with(crate::cpu::active(), layer, x, h, w, out)
}

/// [`conv2d`] on a given path (tests and benchmarks).
#[doc(hidden)]
pub fn conv2d_with(isa: Isa, layer: Conv2d, x: &[f32], h: usize, w: usize, out: &mut [f32]) {
    let schedule = if FloatW::of(layer.weight).is_some() {
        Schedule::TAPS
    } else {
        Schedule::Im2col
    };
    conv2d_schedule_with(isa, schedule, layer, x, h, w, out)
}

/// Which schedule [`conv2d_schedule_with`] runs.
#[doc(hidden)]
#[derive(Clone, Copy, Debug)]
pub enum Schedule {
    /// Patches copied out, any codec.
    Im2col,
    /// One GEMM per tap (float codecs only), in bands of about `band_bytes` of scratch.
    Taps { band_bytes: usize },
}

impl Schedule {
    /// The tap schedule with the bands [`conv2d_with`] uses.
    pub const TAPS: Schedule = Schedule::Taps {
        band_bytes: BAND_BYTES,
    };
}

/// [`conv2d_with`] on a chosen schedule (the schedules' tests, with bands small enough that a
/// test image spans several, and A/B benchmarks).
#[doc(hidden)]
pub fn conv2d_schedule_with(
    isa: Isa,
    schedule: Schedule,
    layer: Conv2d,
    x: &[f32],
    h: usize,
    w: usize,
    out: &mut [f32],
) {
    if check(layer, x, h, w, out) {
        match schedule {
            Schedule::Im2col => im2col::conv(isa, layer, x, h, w, out),
            Schedule::Taps { band_bytes } => {
                assert!(
                    FloatW::of(layer.weight).is_some(),
                    "conv2d: the tap schedule takes float weights, not {}",
                    layer.weight.dtype
                );
                taps::conv(isa, layer, x, h, w, band_bytes, out)
            }
        }
    }
}

/// Panics on inconsistent shapes (a caller's bug, not bad input: the VAE checks the file's
/// shapes at load); false when there is nothing to compute.
fn check(layer: Conv2d, x: &[f32], h: usize, w: usize, out: &[f32]) -> bool {
    let k = layer.k;
    assert!(k == 1 || k == 3, "conv2d: kernel {k} (only 1×1 and 3×3)");
    let (c_in, c_out) = (layer.c_in(), layer.c_out());
    assert_eq!(
        layer.weight.cols % (k * k),
        0,
        "conv2d: weight has {} columns, not a multiple of k·k = {}",
        layer.weight.cols,
        k * k
    );
    assert_eq!(x.len(), c_in * h * w, "conv2d: x is not [{c_in}, {h}, {w}]");
    assert_eq!(
        out.len(),
        c_out * h * w,
        "conv2d: out is not [{c_out}, {h}, {w}]"
    );
    if let Some(b) = layer.bias {
        assert_eq!(b.len(), c_out, "conv2d: bias needs {c_out} values");
    }
    h > 0 && w > 0 && c_out > 0
}
