//! The row and tensor ops the Z-Image models use, over f32 activations laid out row-major.
//!
//! Matrix products go to `cmf_kernels`. The rest are plain Rust here until their cmf-kernels
//! versions land (RMSNorm, LayerNorm, GroupNorm, interleaved RoPE, SiLU, blockwise attention,
//! conv2d); then each one below becomes a call into cmf-kernels, so there is one implementation of
//! each op in the workspace. Numerics follow torch: norms accumulate in a wider type than the data,
//! softmax subtracts the running maximum.

use cmf_kernels::Weight;
use rayon::prelude::*;

/// `y[n, rows] = x[n, cols] · Wᵀ`.
pub fn matmul(w: &Weight, x: &[f32], n: usize, y: &mut [f32]) {
    cmf_kernels::matmul(w, x, n, y)
}

/// `y[r, :] += b` for every row.
pub fn add_bias(y: &mut [f32], b: &[f32]) {
    y.par_chunks_mut(b.len())
        .for_each(|row| row.iter_mut().zip(b).for_each(|(v, bb)| *v += bb));
}

/// Rows per rayon task for cheap row ops: enough work per task to amortise scheduling.
fn rows_per_task(dim: usize) -> usize {
    (16384 / dim.max(1)).max(1)
}

/// RMSNorm over rows of `dim`: `x · rsqrt(mean(x²) + eps) · w` (diffusers/transformers `RMSNorm`).
pub fn rms_norm(x: &[f32], dim: usize, w: &[f32], eps: f32, out: &mut [f32]) {
    debug_assert_eq!(w.len(), dim);
    let rpt = rows_per_task(dim);
    out.par_chunks_mut(dim * rpt)
        .zip(x.par_chunks(dim * rpt))
        .for_each(|(o, xi)| {
            for (orow, xrow) in o.chunks_mut(dim).zip(xi.chunks(dim)) {
                let ss: f64 = xrow.iter().map(|&v| (v as f64) * (v as f64)).sum();
                let r = 1.0 / ((ss / dim as f64) as f32 + eps).sqrt();
                for ((ov, &xv), &wv) in orow.iter_mut().zip(xrow).zip(w) {
                    *ov = wv * (xv * r);
                }
            }
        });
}

/// In-place RMSNorm.
pub fn rms_norm_inplace(x: &mut [f32], dim: usize, w: &[f32], eps: f32) {
    let rpt = rows_per_task(dim);
    x.par_chunks_mut(dim * rpt).for_each(|xi| {
        for row in xi.chunks_mut(dim) {
            let ss: f64 = row.iter().map(|&v| (v as f64) * (v as f64)).sum();
            let r = 1.0 / ((ss / dim as f64) as f32 + eps).sqrt();
            row.iter_mut()
                .zip(w)
                .for_each(|(v, &wv)| *v = wv * (*v * r));
        }
    });
}

/// LayerNorm over rows of `dim` without affine parameters (biased variance, as torch).
pub fn layer_norm_plain(x: &[f32], dim: usize, eps: f32, out: &mut [f32]) {
    let rpt = rows_per_task(dim);
    out.par_chunks_mut(dim * rpt)
        .zip(x.par_chunks(dim * rpt))
        .for_each(|(o, xi)| {
            for (orow, xrow) in o.chunks_mut(dim).zip(xi.chunks(dim)) {
                let mean = xrow.iter().map(|&v| v as f64).sum::<f64>() / dim as f64;
                let var = xrow.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / dim as f64;
                let r = 1.0 / (var as f32 + eps).sqrt();
                let m = mean as f32;
                orow.iter_mut()
                    .zip(xrow)
                    .for_each(|(ov, &xv)| *ov = (xv - m) * r);
            }
        });
}

pub fn silu(v: f32) -> f32 {
    v / (1.0 + (-v).exp())
}

pub fn silu_inplace(x: &mut [f32]) {
    x.par_chunks_mut(16384)
        .for_each(|c| c.iter_mut().for_each(|v| *v = silu(*v)));
}

/// SwiGLU gate in place: `a = silu(a) · b`.
pub fn swiglu_inplace(a: &mut [f32], b: &[f32]) {
    a.par_chunks_mut(16384)
        .zip(b.par_chunks(16384))
        .for_each(|(ac, bc)| {
            ac.iter_mut().zip(bc).for_each(|(x, &g)| *x = silu(*x) * g);
        });
}

/// Interleaved (complex-pair) RoPE over `x[n, heads, hd]` in place: each adjacent pair
/// `(x[2i], x[2i+1])` of every head is multiplied by `cos θ + i·sin θ` for `θ = angle[row, i]`.
/// `cs` holds `[n, hd/2]` pairs `(cos, sin)`. (diffusers `ZSingleStreamAttnProcessor.apply_rotary_emb`:
/// `view_as_complex(x.reshape(..., -1, 2)) * freqs_cis`.)
pub fn rope_interleaved(x: &mut [f32], n: usize, heads: usize, hd: usize, cs: &[(f32, f32)]) {
    debug_assert_eq!(x.len(), n * heads * hd);
    debug_assert_eq!(cs.len(), n * hd / 2);
    x.par_chunks_mut(heads * hd)
        .enumerate()
        .for_each(|(r, row)| {
            let c = &cs[r * hd / 2..(r + 1) * hd / 2];
            for head in row.chunks_mut(hd) {
                for (pair, &(cos, sin)) in head.chunks_mut(2).zip(c) {
                    let (a, b) = (pair[0], pair[1]);
                    pair[0] = a * cos - b * sin;
                    pair[1] = a * sin + b * cos;
                }
            }
        });
}

/// Query rows and key rows per attention tile.
const ATT_BQ: usize = 32;
const ATT_BK: usize = 64;

/// Non-causal multi-head attention, computed blockwise with an online softmax (no n×n score matrix):
/// `out[i, h] = Σ_j softmax_j(q[i,h]·k[j,h] · scale) v[j,h]`. `q`, `k`, `v`, `out` are `[n, heads·hd]`.
pub fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n: usize,
    heads: usize,
    hd: usize,
    out: &mut [f32],
) {
    let stride = heads * hd;
    debug_assert!(q.len() == n * stride && k.len() == n * stride && v.len() == n * stride);
    let scale = 1.0 / (hd as f32).sqrt();
    let qblocks = n.div_ceil(ATT_BQ);
    // One task per (query block, head); each writes its own [bq, hd] tile, gathered below.
    let tiles: Vec<(usize, usize, Vec<f32>)> = (0..qblocks * heads)
        .into_par_iter()
        .map(|task| {
            let (qb, h) = (task / heads, task % heads);
            let q0 = qb * ATT_BQ;
            let bq = ATT_BQ.min(n - q0);
            let mut m = vec![f32::NEG_INFINITY; bq];
            let mut l = vec![0f32; bq];
            let mut acc = vec![0f32; bq * hd];
            let mut s = vec![0f32; ATT_BK];
            for k0 in (0..n).step_by(ATT_BK) {
                let bk = ATT_BK.min(n - k0);
                for i in 0..bq {
                    let qi = &q[(q0 + i) * stride + h * hd..][..hd];
                    let mut mx = m[i];
                    for (j, sj) in s[..bk].iter_mut().enumerate() {
                        let kj = &k[(k0 + j) * stride + h * hd..][..hd];
                        *sj = dot(qi, kj) * scale;
                        mx = mx.max(*sj);
                    }
                    let corr = (m[i] - mx).exp();
                    let a = &mut acc[i * hd..(i + 1) * hd];
                    if corr != 1.0 {
                        a.iter_mut().for_each(|x| *x *= corr);
                    }
                    let mut sum = l[i] * corr;
                    for (j, &sj) in s[..bk].iter().enumerate() {
                        let p = (sj - mx).exp();
                        sum += p;
                        let vj = &v[(k0 + j) * stride + h * hd..][..hd];
                        a.iter_mut().zip(vj).for_each(|(x, &vv)| *x += p * vv);
                    }
                    m[i] = mx;
                    l[i] = sum;
                }
            }
            for i in 0..bq {
                let inv = 1.0 / l[i];
                acc[i * hd..(i + 1) * hd].iter_mut().for_each(|x| *x *= inv);
            }
            (q0, h, acc)
        })
        .collect();
    for (q0, h, acc) in tiles {
        for (i, row) in acc.chunks(hd).enumerate() {
            out[(q0 + i) * stride + h * hd..][..hd].copy_from_slice(row);
        }
    }
}

/// Dot product with 8 independent accumulators (lets the compiler vectorise).
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, ar) = a.split_at(a.len() / 8 * 8);
    let (bc, br) = b.split_at(ac.len());
    for (x, y) in ac.chunks_exact(8).zip(bc.chunks_exact(8)) {
        for t in 0..8 {
            acc[t] += x[t] * y[t];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Attention with the full score matrix, in f64: the obvious definition.
    fn attention_naive(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        n: usize,
        heads: usize,
        hd: usize,
    ) -> Vec<f32> {
        let st = heads * hd;
        let mut out = vec![0f32; n * st];
        for h in 0..heads {
            for i in 0..n {
                let s: Vec<f64> = (0..n)
                    .map(|j| {
                        (0..hd)
                            .map(|d| q[i * st + h * hd + d] as f64 * k[j * st + h * hd + d] as f64)
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - mx).exp()).collect();
                let z: f64 = e.iter().sum();
                for d in 0..hd {
                    out[i * st + h * hd + d] = ((0..n)
                        .map(|j| e[j] * v[j * st + h * hd + d] as f64)
                        .sum::<f64>()
                        / z) as f32;
                }
            }
        }
        out
    }

    #[test]
    fn blockwise_attention_matches_naive() {
        for &(n, heads, hd) in &[(1, 1, 4), (37, 2, 8), (130, 3, 16)] {
            let q: Vec<f32> = lcg(n * heads * hd, 1).iter().map(|x| x * 3.0).collect();
            let k = lcg(n * heads * hd, 2);
            let v = lcg(n * heads * hd, 3);
            let mut out = vec![0f32; n * heads * hd];
            attention(&q, &k, &v, n, heads, hd, &mut out);
            let want = attention_naive(&q, &k, &v, n, heads, hd);
            let err = out
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(err < 1e-5, "n={n} heads={heads} hd={hd}: max err {err}");
        }
    }

    #[test]
    fn rope_rotates_pairs() {
        let mut x = vec![1.0f32, 0.0, 0.0, 2.0];
        let th = 0.3f32;
        rope_interleaved(&mut x, 1, 1, 4, &[(th.cos(), th.sin()), (1.0, 0.0)]);
        assert!((x[0] - th.cos()).abs() < 1e-7 && (x[1] - th.sin()).abs() < 1e-7);
        assert_eq!(&x[2..], &[0.0, 2.0]);
    }

    #[test]
    fn norms() {
        let x = [3.0f32, 4.0];
        let mut o = [0f32; 2];
        rms_norm(&x, 2, &[1.0, 2.0], 0.0, &mut o);
        let r = (12.5f32).sqrt();
        assert!((o[0] - 3.0 / r).abs() < 1e-6 && (o[1] - 8.0 / r).abs() < 1e-6);
        layer_norm_plain(&x, 2, 0.0, &mut o);
        assert!((o[0] + 1.0).abs() < 1e-6 && (o[1] - 1.0).abs() < 1e-6);
    }
}
