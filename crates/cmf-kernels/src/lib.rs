//! CPU compute kernels: quantized matrix-vector (decode) and matrix-matrix (prefill) products
//! over weights read in place from a CMF file, plus the row ops the models need.
//!
//! Shapes: a weight is `[rows = out, cols = in]`, row-major, in its storage codec.
//! `matvec`: y[rows] = W · x[cols].  `matmul`: Y[n, rows] = X[n, cols] · Wᵀ.
//!
//! The public functions are the contract the models code against; the implementations behind
//! them dispatch on CPU features at run time (see [`cpu`]) and run on the crate's thread pool
//! ([`set_num_threads`]). `reference` holds the plain scalar versions every fast kernel is tested
//! against. Numerics and measured speed: `docs/kernels.md`.

pub mod attention;
pub mod conv;
pub mod cpu;
pub mod gdn;
pub mod reference;

pub mod ops;

mod act;
mod codec;
mod linear;
mod pool;
mod sgemm;
mod simd;

use cmf_format::Dtype;

pub use attention::{
    attention, attention_decode, attention_paged, AttnParams, Kv, KvBlocks, KvCache, KvDtype,
    KvSlice, PagedKv,
};
pub use conv::{conv2d, Conv2d};
pub use cpu::Isa;
pub use gdn::GdnGeometry;
pub use linear::{matmul_multi_with, matmul_with, matvec_multi_with, matvec_with};
pub use ops::{NormStyle, RopeStyle, RopeTable};
pub use pool::{num_threads, run_in_pool, set_num_threads};

/// A weight matrix borrowed from the file (no copy), in its storage codec.
#[derive(Clone, Copy, Debug)]
pub struct Weight<'a> {
    pub dtype: Dtype,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
}

/// Why bytes cannot be used as a weight matrix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WeightError {
    /// The codec is not a matrix codec (u8 blobs).
    NotAMatrixCodec(Dtype),
    /// The shape is invalid for the codec (e.g. q4_tiled with cols not a multiple of 32).
    BadShape {
        dtype: Dtype,
        rows: usize,
        cols: usize,
    },
    /// The byte length disagrees with codec and shape.
    BadLength {
        dtype: Dtype,
        rows: usize,
        cols: usize,
        expected: u64,
        actual: usize,
    },
}

impl std::fmt::Display for WeightError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WeightError::NotAMatrixCodec(d) => write!(f, "codec {d} is not a matrix codec"),
            WeightError::BadShape { dtype, rows, cols } => {
                write!(f, "shape [{rows}, {cols}] is not valid for codec {dtype}")
            }
            WeightError::BadLength {
                dtype,
                rows,
                cols,
                expected,
                actual,
            } => {
                write!(
                    f,
                    "{dtype} [{rows}, {cols}] needs {expected} bytes, got {actual}"
                )
            }
        }
    }
}

impl std::error::Error for WeightError {}

impl<'a> Weight<'a> {
    /// A checked weight view: the byte length must match codec and shape exactly.
    pub fn new(
        dtype: Dtype,
        rows: usize,
        cols: usize,
        data: &'a [u8],
    ) -> Result<Weight<'a>, WeightError> {
        let w = Weight {
            dtype,
            rows,
            cols,
            data,
        };
        w.check()?;
        Ok(w)
    }

    /// Checks the view (the kernels call this and panic on a bad one: build views with `new`).
    pub fn check(&self) -> Result<(), WeightError> {
        let (dtype, rows, cols) = (self.dtype, self.rows, self.cols);
        if dtype == Dtype::U8 {
            return Err(WeightError::NotAMatrixCodec(dtype));
        }
        let expected = dtype
            .expected_nbytes(&[rows as u64, cols as u64])
            .ok_or(WeightError::BadShape { dtype, rows, cols })?;
        if expected != self.data.len() as u64 {
            return Err(WeightError::BadLength {
                dtype,
                rows,
                cols,
                expected,
                actual: self.data.len(),
            });
        }
        Ok(())
    }
}

/// y[rows] = W · x[cols]
pub fn matvec(w: &Weight, x: &[f32], y: &mut [f32]) {
    matvec_with(cpu::active(), w, x, y)
}

/// `ys[j] = W_j · x` for weights sharing one input (one quantization, one pool dispatch).
pub fn matvec_multi(ws: &[&Weight], x: &[f32], ys: &mut [&mut [f32]]) {
    matvec_multi_with(cpu::active(), ws, x, ys)
}

/// y[n, rows] = x[n, cols] · Wᵀ
pub fn matmul(w: &Weight, x: &[f32], n: usize, y: &mut [f32]) {
    matmul_with(cpu::active(), w, x, n, y)
}

/// `Y_j = X·W_jᵀ` for weights sharing `n` input rows (a few rows: one quantization, one pool
/// dispatch; each result is `matmul`'s).
pub fn matmul_multi(ws: &[&Weight], x: &[f32], n: usize, ys: &mut [&mut [f32]]) {
    matmul_multi_with(cpu::active(), ws, x, n, ys)
}
