//! The ops the Z-Image models use, as thin adapters over cmf-kernels (the one implementation of
//! each op in the workspace): the models keep Z-Image's shapes and conventions, the kernels do the
//! arithmetic. Row ops that the kernels run on one thread are split into row blocks here.
//!
//! Activations are f32, row-major.

use cmf_kernels::ops as k;
use cmf_kernels::{AttnParams, Kv, NormStyle, RopeStyle, RopeTable, Weight};
use rayon::prelude::*;

/// `y[n, rows] = x[n, cols] · Wᵀ`.
pub fn matmul(w: &Weight, x: &[f32], n: usize, y: &mut [f32]) {
    cmf_kernels::matmul(w, x, n, y)
}

/// `y[r, :] += b` for every row.
pub fn add_bias(y: &mut [f32], b: &[f32]) {
    k::add_rows(y, b)
}

/// Rows per task for row ops that the kernels run serially: ~64k values per task.
fn row_block(dim: usize) -> usize {
    (65536 / dim.max(1)).max(1) * dim
}

/// RMSNorm over rows of `dim`: `x · rsqrt(mean(x²) + eps) · w` (diffusers/transformers `RMSNorm`).
pub fn rms_norm(x: &[f32], dim: usize, w: &[f32], eps: f32, out: &mut [f32]) {
    let b = row_block(dim);
    out.par_chunks_mut(b)
        .zip(x.par_chunks(b))
        .for_each(|(o, xi)| k::rms_norm(xi, dim, Some(w), eps, NormStyle::Plain, o));
}

/// In-place RMSNorm.
pub fn rms_norm_inplace(x: &mut [f32], dim: usize, w: &[f32], eps: f32) {
    let b = row_block(dim);
    x.par_chunks_mut(b)
        .for_each(|xi| k::rms_norm_inplace(xi, dim, Some(w), eps, NormStyle::Plain));
}

/// LayerNorm over rows of `dim` without affine parameters (biased variance, as torch).
pub fn layer_norm_plain(x: &[f32], dim: usize, eps: f32, out: &mut [f32]) {
    let b = row_block(dim);
    out.par_chunks_mut(b)
        .zip(x.par_chunks(b))
        .for_each(|(o, xi)| k::layer_norm(xi, dim, None, None, eps, o));
}

/// `x · sigmoid(x)` for one value (small vectors: the t-embedding).
pub fn silu(v: f32) -> f32 {
    v / (1.0 + (-v).exp())
}

pub fn silu_inplace(x: &mut [f32]) {
    k::silu(x)
}

/// SwiGLU gate in place: `a = silu(a) · b`.
pub fn swiglu_inplace(a: &mut [f32], b: &[f32]) {
    k::swiglu_inplace(a, b)
}

/// A RoPE table from per-row angles `[rows, pairs]` that are already rounded to f32 (diffusers
/// computes the angles in f64 and keeps them as f32 before `torch.polar`).
pub fn rope_table(angles: &[f32], pairs: usize) -> RopeTable {
    let a: Vec<f64> = angles.iter().map(|&x| x as f64).collect();
    RopeTable::from_angles(&a, pairs)
}

/// Interleaved (complex-pair) RoPE over `x[n, heads, hd]` in place, rows `first_row ..` of `table`
/// (diffusers `ZSingleStreamAttnProcessor.apply_rotary_emb`: `view_as_complex(x.reshape(…, -1, 2))
/// * freqs_cis`).
pub fn rope_interleaved(
    x: &mut [f32],
    n: usize,
    heads: usize,
    hd: usize,
    table: &RopeTable,
    first_row: usize,
) {
    let per_task = (4096 / (heads * hd)).max(1);
    x.par_chunks_mut(per_task * heads * hd)
        .enumerate()
        .for_each(|(i, c)| {
            let rows = c.len() / (heads * hd);
            k::rope(
                c,
                rows,
                hd,
                RopeStyle::Interleaved,
                table,
                first_row + i * per_task,
            )
        });
    debug_assert_eq!(x.len(), n * heads * hd);
}

/// Non-causal multi-head attention, blockwise (no n×n score matrix): `q`, `k`, `v`, `out` are
/// `[n, heads·hd]`; scale `1/sqrt(hd)` (torch SDPA's default).
pub fn attention(
    q: &[f32],
    kk: &[f32],
    v: &[f32],
    n: usize,
    heads: usize,
    hd: usize,
    out: &mut [f32],
) {
    let p = AttnParams {
        n_heads: heads,
        n_kv_heads: heads,
        head_dim: hd,
        scale: 1.0 / (hd as f32).sqrt(),
        causal: false,
        q_pos0: 0,
        window: None,
    };
    cmf_kernels::attention(q, Kv::f32(kk, v, n), &p, None, out)
}

/// GroupNorm of `x[channels, hw]` (per-channel affine, eps), optionally followed by SiLU: the
/// kernel's own signature, nothing to adapt.
pub use k::group_norm;

/// 3×3 or 1×1 "same" convolution of one NCHW sample `x[c_in, h, w]`: `out[c_out, h, w]`.
pub fn conv2d(layer: cmf_kernels::Conv2d, x: &[f32], h: usize, w: usize, out: &mut [f32]) {
    cmf_kernels::conv2d(layer, x, h, w, out)
}

/// Nearest-neighbour ×2 upsampling of `x[c, h, w]` → `[c, 2h, 2w]` (torch `interpolate(mode="nearest")`).
pub fn upsample_nearest2x(x: &[f32], c: usize, h: usize, w: usize) -> Vec<f32> {
    let mut out = vec![0f32; c * 4 * h * w];
    out.par_chunks_mut(2 * w).enumerate().for_each(|(row, o)| {
        // `row` indexes the 2h output rows of every channel.
        let (ch, y) = (row / (2 * h), (row % (2 * h)) / 2);
        let src = &x[(ch * h + y) * w..(ch * h + y + 1) * w];
        for (xx, &v) in src.iter().enumerate() {
            o[2 * xx] = v;
            o[2 * xx + 1] = v;
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upsample() {
        let x = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]; // c=1, h=2, w=3
        let u = upsample_nearest2x(&x, 1, 2, 3);
        assert_eq!(&u[..6], &[1.0, 1.0, 2.0, 2.0, 3.0, 3.0]);
        assert_eq!(&u[6..12], &[1.0, 1.0, 2.0, 2.0, 3.0, 3.0]);
        assert_eq!(&u[12..18], &[4.0, 4.0, 5.0, 5.0, 6.0, 6.0]);
    }

    #[test]
    fn rope_table_rotates_interleaved_pairs() {
        let th = 0.3f32;
        let t = rope_table(&[th, 0.0], 2);
        let mut x = vec![1.0f32, 0.0, 0.0, 2.0];
        rope_interleaved(&mut x, 1, 1, 4, &t, 0);
        assert!((x[0] - th.cos()).abs() < 1e-7 && (x[1] - th.sin()).abs() < 1e-7);
        assert_eq!(&x[2..], &[0.0, 2.0]);
    }
}
