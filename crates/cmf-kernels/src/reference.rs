//! Scalar reference kernels: decode one row to f32, then a plain dot product.
//! Slow on purpose and obviously right; every optimised kernel is tested against these.

use crate::Weight;
use cmf_format::Dtype;
use half::{bf16, f16};

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32()
}

/// Decodes row `r` of `w` into `out[cols]`.
pub fn decode_row(w: &Weight, r: usize, out: &mut [f32]) {
    let (rows, cols, d) = (w.rows, w.cols, w.data);
    assert_eq!(out.len(), cols);
    match w.dtype {
        Dtype::F32 => {
            for (c, o) in out.iter_mut().enumerate() {
                let i = (r * cols + c) * 4;
                *o = f32::from_le_bytes([d[i], d[i + 1], d[i + 2], d[i + 3]]);
            }
        }
        Dtype::F16 => out
            .iter_mut()
            .enumerate()
            .for_each(|(c, o)| *o = f16_at(d, r * cols + c)),
        Dtype::Bf16 => out.iter_mut().enumerate().for_each(|(c, o)| {
            let i = (r * cols + c) * 2;
            *o = bf16::from_le_bytes([d[i], d[i + 1]]).to_f32()
        }),
        Dtype::Q8Row => {
            let s = f16_at(&d[rows * cols..], r);
            for (c, o) in out.iter_mut().enumerate() {
                *o = d[r * cols + c] as i8 as f32 * s;
            }
        }
        Dtype::Q8_2f => {
            let s = f16_at(&d[rows * cols..], r);
            let col = &d[rows * cols + rows * 2..];
            for (c, o) in out.iter_mut().enumerate() {
                *o = d[r * cols + c] as i8 as f32 * s * f16_at(col, c);
            }
        }
        Dtype::Q4Block => {
            let n = rows * cols;
            let scales = &d[n.div_ceil(32) * 16..];
            for (c, o) in out.iter_mut().enumerate() {
                let k = r * cols + c;
                let byte = d[k / 2];
                let q = if k.is_multiple_of(2) {
                    byte & 15
                } else {
                    byte >> 4
                };
                *o = (q as f32 - 8.0) * f16_at(scales, k / 32);
            }
        }
        Dtype::Q4Tiled => {
            let tiles = cols / 32;
            for (c, o) in out.iter_mut().enumerate() {
                let t = &d[(r * tiles + c / 32) * 18..][..18];
                let byte = t[2 + (c % 32) / 2];
                let q = if c % 2 == 0 { byte & 15 } else { byte >> 4 };
                *o = (q as f32 - 8.0) * f16_at(t, 0);
            }
        }
        Dtype::Q4Tp => {
            // [nibbles rows·gpr·16][rows × (f16 lo, f16 step)][rows × ⌈gpr·5/8⌉ 5-bit codes]
            let gpr = cols / 32;
            let (params, codes) = crate::codec::q4tp_planes(d, rows, gpr);
            let ladder = crate::codec::q4tp_ladder(params, r);
            let stride = crate::codec::q4tp_code_stride(gpr);
            for (c, o) in out.iter_mut().enumerate() {
                let g = c / 32;
                let s = ladder[crate::codec::q4tp_code(&codes[r * stride..(r + 1) * stride], g)];
                let byte = d[(r * gpr + g) * 16 + (c % 32) / 2];
                let q = if c % 2 == 0 { byte & 15 } else { byte >> 4 };
                *o = (q as f32 - 8.0) * s;
            }
        }
        other => panic!("reference::decode_row: codec {other} is not a matrix codec"),
    }
}

pub fn matvec(w: &Weight, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), w.cols);
    assert_eq!(y.len(), w.rows);
    let mut row = vec![0f32; w.cols];
    for (r, yr) in y.iter_mut().enumerate() {
        decode_row(w, r, &mut row);
        *yr = row.iter().zip(x).map(|(a, b)| a * b).sum();
    }
}

pub fn matmul(w: &Weight, x: &[f32], n: usize, y: &mut [f32]) {
    assert_eq!(x.len(), n * w.cols);
    assert_eq!(y.len(), n * w.rows);
    let mut row = vec![0f32; w.cols];
    for r in 0..w.rows {
        decode_row(w, r, &mut row);
        for t in 0..n {
            y[t * w.rows + r] = row
                .iter()
                .zip(&x[t * w.cols..(t + 1) * w.cols])
                .map(|(a, b)| a * b)
                .sum();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Row ops, in f64 where a sum is involved. Shapes as in `crate::ops`.

/// erf(x) in f64: Taylor series for |x| ≤ 3, continued fraction for erfc beyond (≈1e-14).
pub fn erf(x: f64) -> f64 {
    if x.abs() > 3.0 {
        return x.signum() * (1.0 - erfc(x.abs()));
    }
    // erf(x) = 2/√π Σ (−1)^n x^(2n+1) / (n! (2n+1))
    let mut term = x; // (−1)^n x^(2n+1) / n!
    let mut sum = x;
    for n in 1..200 {
        term *= -x * x / n as f64;
        let add = term / (2 * n + 1) as f64;
        sum += add;
        if add.abs() < 1e-17 * sum.abs() {
            break;
        }
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

/// erfc(x) in f64 (continued fraction for x > 3, 1 − erf otherwise).
pub fn erfc(x: f64) -> f64 {
    if x <= 3.0 {
        return 1.0 - erf(x);
    }
    // erfc(x) = e^(−x²)/√π · 1/(x + (1/2)/(x + 1/(x + (3/2)/(x + 2/(x + …))))), evaluated bottom-up.
    let mut f = x;
    for k in (1..60).rev() {
        f = x + (k as f64 / 2.0) / f;
    }
    (-x * x).exp() / std::f64::consts::PI.sqrt() / f
}

/// RMSNorm over rows of `w.len()`: x̂ = x / sqrt(mean(x²) + eps); out = x̂·w (`one_plus`: x̂·(1+w)).
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, one_plus: bool, out: &mut [f32]) {
    let d = w.len();
    for (xr, or) in x.chunks(d).zip(out.chunks_mut(d)) {
        let ms = xr.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / d as f64;
        let inv = 1.0 / (ms + eps as f64).sqrt();
        for i in 0..d {
            let g = if one_plus {
                1.0 + w[i] as f64
            } else {
                w[i] as f64
            };
            or[i] = (xr[i] as f64 * inv * g) as f32;
        }
    }
}

/// LayerNorm over rows of `d`: (x − mean)/sqrt(var + eps), then ·w + b when given.
pub fn layer_norm(
    x: &[f32],
    d: usize,
    w: Option<&[f32]>,
    b: Option<&[f32]>,
    eps: f32,
    out: &mut [f32],
) {
    for (xr, or) in x.chunks(d).zip(out.chunks_mut(d)) {
        let mean = xr.iter().map(|v| *v as f64).sum::<f64>() / d as f64;
        let var = xr.iter().map(|v| (*v as f64 - mean).powi(2)).sum::<f64>() / d as f64;
        let inv = 1.0 / (var + eps as f64).sqrt();
        for i in 0..d {
            let mut v = (xr[i] as f64 - mean) * inv;
            if let Some(w) = w {
                v *= w[i] as f64;
            }
            if let Some(b) = b {
                v += b[i] as f64;
            }
            or[i] = v as f32;
        }
    }
}

/// GroupNorm of one NCHW sample `x[c, hw]` with `groups` groups and per-channel affine.
#[allow(clippy::too_many_arguments)]
pub fn group_norm(
    x: &[f32],
    channels: usize,
    hw: usize,
    groups: usize,
    w: &[f32],
    b: &[f32],
    eps: f32,
    out: &mut [f32],
) {
    let cpg = channels / groups;
    for g in 0..groups {
        let xs = &x[g * cpg * hw..(g + 1) * cpg * hw];
        let n = xs.len() as f64;
        let mean = xs.iter().map(|v| *v as f64).sum::<f64>() / n;
        let var = xs.iter().map(|v| (*v as f64 - mean).powi(2)).sum::<f64>() / n;
        let inv = 1.0 / (var + eps as f64).sqrt();
        for c in g * cpg..(g + 1) * cpg {
            for i in 0..hw {
                out[c * hw + i] =
                    ((x[c * hw + i] as f64 - mean) * inv * w[c] as f64 + b[c] as f64) as f32;
            }
        }
    }
}

/// Softmax over rows of `d`.
pub fn softmax(x: &[f32], d: usize, out: &mut [f32]) {
    for (xr, or) in x.chunks(d).zip(out.chunks_mut(d)) {
        let m = xr.iter().fold(f64::NEG_INFINITY, |m, v| m.max(*v as f64));
        let s: f64 = xr.iter().map(|v| (*v as f64 - m).exp()).sum();
        for (o, v) in or.iter_mut().zip(xr) {
            *o = ((*v as f64 - m).exp() / s) as f32;
        }
    }
}

pub fn silu(x: f32) -> f32 {
    let x = x as f64;
    (x / (1.0 + (-x).exp())) as f32
}

/// GELU, exact (erf) form: x·Φ(x).
pub fn gelu_erf(x: f32) -> f32 {
    let x = x as f64;
    (0.5 * x * erfc(-x / std::f64::consts::SQRT_2)) as f32
}

/// GELU, tanh form: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))).
pub fn gelu_tanh(x: f32) -> f32 {
    let x = x as f64;
    let u = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
    (0.5 * x * (1.0 + u.tanh())) as f32
}

/// RoPE on one token's heads `x[n_heads·head_dim]`, in place. `angles[half]` (θ_i for pair i),
/// `rot` = 2·half leading dims rotate. `interleaved`: pairs (2i, 2i+1); else (i, i + half).
pub fn rope(x: &mut [f32], head_dim: usize, angles: &[f64], interleaved: bool) {
    let half = angles.len();
    for head in x.chunks_mut(head_dim) {
        for (i, &a) in angles.iter().enumerate() {
            let (s, c) = a.sin_cos();
            let (j, k) = if interleaved {
                (2 * i, 2 * i + 1)
            } else {
                (i, i + half)
            };
            let (u, v) = (head[j] as f64, head[k] as f64);
            head[j] = (u * c - v * s) as f32;
            head[k] = (v * c + u * s) as f32;
        }
    }
}

/// Attention, naively: q `[nq, n_heads, hd]`, k/v `[len, n_kv, hd]` f32, f64 softmax. Causal query
/// t sits at position `q_pos0 + t`; the window keeps keys pos − window < k ≤ pos.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    len: usize,
    n_heads: usize,
    n_kv: usize,
    hd: usize,
    scale: f32,
    causal: bool,
    q_pos0: usize,
    window: Option<usize>,
    key_mask: Option<&[bool]>,
    out: &mut [f32],
) {
    let nq = q.len() / (n_heads * hd);
    let group = n_heads / n_kv;
    for t in 0..nq {
        for h in 0..n_heads {
            let kvh = h / group;
            let qv = &q[(t * n_heads + h) * hd..][..hd];
            let pos = q_pos0 + t;
            let visible = |j: usize| {
                let c = !causal || j <= pos;
                let w = match (causal, window) {
                    (true, Some(w)) => j + w > pos,
                    _ => true,
                };
                c && w && key_mask.is_none_or(|m| m[j])
            };
            let scores: Vec<f64> = (0..len)
                .map(|j| {
                    if !visible(j) {
                        return f64::NEG_INFINITY;
                    }
                    let kv = &k[(j * n_kv + kvh) * hd..][..hd];
                    qv.iter()
                        .zip(kv)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
                        * scale as f64
                })
                .collect();
            let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let o = &mut out[(t * n_heads + h) * hd..][..hd];
            if m == f64::NEG_INFINITY {
                o.fill(0.0);
                continue;
            }
            let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let l: f64 = w.iter().sum();
            for (d, od) in o.iter_mut().enumerate() {
                *od = ((0..len)
                    .map(|j| w[j] * v[(j * n_kv + kvh) * hd + d] as f64)
                    .sum::<f64>()
                    / l) as f32;
            }
        }
    }
}

/// Convolution, naively (NCHW, stride 1, "same" padding k/2), f64 sums.
#[allow(clippy::too_many_arguments)]
pub fn conv2d(
    x: &[f32],
    c_in: usize,
    h: usize,
    w: usize,
    weight: &[f32],
    c_out: usize,
    k: usize,
    bias: Option<&[f32]>,
    out: &mut [f32],
) {
    let pad = (k / 2) as isize;
    for co in 0..c_out {
        for oy in 0..h {
            for ox in 0..w {
                let mut s = bias.map_or(0.0, |b| b[co] as f64);
                for ci in 0..c_in {
                    for ky in 0..k {
                        for kx in 0..k {
                            let (iy, ix) = (
                                oy as isize + ky as isize - pad,
                                ox as isize + kx as isize - pad,
                            );
                            if iy >= 0 && iy < h as isize && ix >= 0 && ix < w as isize {
                                let wv = weight[((co * c_in + ci) * k + ky) * k + kx] as f64;
                                s += wv * x[(ci * h + iy as usize) * w + ix as usize] as f64;
                            }
                        }
                    }
                }
                out[(co * h + oy) * w + ox] = s as f32;
            }
        }
    }
}
