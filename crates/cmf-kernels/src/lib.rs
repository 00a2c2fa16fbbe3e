//! CPU compute kernels: quantized matrix-vector (decode) and matrix-matrix (prefill) products
//! over weights read in place from a CMF file, plus the row ops the models need.
//!
//! Shapes: a weight is `[rows = out, cols = in]`, row-major, in its storage codec.
//! `matvec`: y[rows] = W · x[cols].  `matmul`: Y[n, rows] = X[n, cols] · Wᵀ.
//!
//! The public functions are the contract the models code against; the implementations behind
//! them dispatch on CPU features at run time (see `simd`). `reference` holds the plain scalar
//! versions every fast kernel is tested against.

pub mod reference;

use cmf_format::Dtype;

/// A weight matrix borrowed from the file (no copy), in its storage codec.
#[derive(Clone, Copy, Debug)]
pub struct Weight<'a> {
    pub dtype: Dtype,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
}

/// y[rows] = W · x[cols]
pub fn matvec(w: &Weight, x: &[f32], y: &mut [f32]) {
    reference::matvec(w, x, y)
}

/// y[n, rows] = x[n, cols] · Wᵀ
pub fn matmul(w: &Weight, x: &[f32], n: usize, y: &mut [f32]) {
    reference::matmul(w, x, n, y)
}
