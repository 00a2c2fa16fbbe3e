//! Row operations the decoder needs: RMSNorm, SwiGLU, softmax.
//!
//! Interim plain-Rust versions: the kernels engineer owns the long-term implementations in
//! `cmf-kernels` (row ops with SIMD dispatch). When those land on main these functions are
//! replaced by calls into `cmf_kernels`, so there is one implementation of each op.

/// y = x / sqrt(mean(x²) + eps) · w, per row of `w.len()` elements.
/// transformers `LlamaRMSNorm.forward` (variance in f32, then multiply by the weight).
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, y: &mut [f32]) {
    let d = w.len();
    for (xr, yr) in x.chunks_exact(d).zip(y.chunks_exact_mut(d)) {
        let ss: f32 = xr.iter().map(|v| v * v).sum();
        let inv = 1.0 / (ss / d as f32 + eps).sqrt();
        for ((o, a), g) in yr.iter_mut().zip(xr).zip(w) {
            *o = g * (a * inv);
        }
    }
}

/// In-place RMSNorm of each `w.len()`-wide slice of `x` (Qwen3 per-head q/k norm).
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let d = w.len();
    for xr in x.chunks_exact_mut(d) {
        let ss: f32 = xr.iter().map(|v| v * v).sum();
        let inv = 1.0 / (ss / d as f32 + eps).sqrt();
        for (a, g) in xr.iter_mut().zip(w) {
            *a = g * (*a * inv);
        }
    }
}

/// gate ← silu(gate) · up (LlamaMLP: down_proj(act_fn(gate_proj(x)) * up_proj(x))).
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// In-place softmax; returns nothing, `x` sums to 1 afterwards.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    x.iter_mut().for_each(|v| *v *= inv);
}

pub fn add_inplace(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_unit_rows() {
        let x = [3.0, 4.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0];
        let mut y = [0.0; 8];
        rms_norm(&x, &[1.0, 1.0, 2.0, 1.0], 0.0, &mut y);
        assert!((y[0] - 3.0 / 2.5).abs() < 1e-6 && (y[1] - 4.0 / 2.5).abs() < 1e-6);
        assert_eq!(&y[4..], &[1.0, 1.0, 2.0, 1.0]);
    }

    #[test]
    fn softmax_sums_to_one() {
        let mut x = [1.0, 2.0, 3.0, -1e9];
        softmax(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(x[2] > x[1] && x[3] == 0.0);
    }
}
