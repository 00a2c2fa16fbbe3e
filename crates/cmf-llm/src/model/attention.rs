//! Causal grouped-query attention of new queries over the KV cache.
//!
//! Interim plain-Rust version (f32, one query row at a time, exact softmax). The kernels
//! engineer owns the long-term decode attention and blockwise prefill attention in
//! `cmf-kernels`; this file shrinks to a call into them when they land.
//!
//! Numerics follow transformers `eager_attention_forward`: scores = q·k · head_dim^-0.5, masked
//! causally (and to the sliding window: key j is visible from query p when j > p − window, see
//! `masking_utils.sliding_window_overlay`), softmax in f32, weighted sum of values.

use rayon::prelude::*;

/// Geometry of one attention call.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Position of the first new query (= cached positions before this pass).
    pub start: usize,
    pub window: Option<usize>,
}

/// Work (query rows × visible keys × heads) below which threads cost more than they save.
const PARALLEL_MIN_WORK: usize = 1 << 15;

/// q: [n, heads·hd] new queries; k, v: [start + n, kv_heads·hd] cache rows (new rows included);
/// out: [n, heads·hd].
pub fn attend(s: AttnShape, q: &[f32], k: &[f32], v: &[f32], out: &mut [f32]) {
    let (hd, qd) = (s.head_dim, s.heads * s.head_dim);
    let n = q.len() / qd;
    let total = s.start + n;
    let work = n * total * s.heads;
    // One task = one (query row, head) pair; its output slice is a head_dim chunk of `out`.
    let task = |(idx, o): (usize, &mut [f32]), scores: &mut Vec<f32>| {
        let (i, h) = (idx / s.heads, idx % s.heads);
        attend_one(s, i, h, &q[i * qd + h * hd..][..hd], k, v, o, scores);
    };
    if work < PARALLEL_MIN_WORK {
        let mut scores = Vec::with_capacity(total);
        out.chunks_mut(hd)
            .enumerate()
            .for_each(|t| task(t, &mut scores));
    } else {
        out.par_chunks_mut(hd)
            .enumerate()
            .for_each_init(|| Vec::with_capacity(total), |sc, t| task(t, sc));
    }
}

/// Query row `i` (position start + i), head `h`.
#[allow(clippy::too_many_arguments)]
fn attend_one(
    s: AttnShape,
    i: usize,
    h: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &mut [f32],
    scores: &mut Vec<f32>,
) {
    let hd = s.head_dim;
    let kv_dim = s.kv_heads * hd;
    let g = h / (s.heads / s.kv_heads);
    let pos = s.start + i;
    let first = match s.window {
        Some(w) => (pos + 1).saturating_sub(w),
        None => 0,
    };
    let scale = 1.0 / (hd as f32).sqrt();
    scores.clear();
    for j in first..=pos {
        scores.push(dot(q, &k[j * kv_dim + g * hd..][..hd]) * scale);
    }
    let len = scores.len();
    cmf_kernels::ops::softmax(scores, len);
    out.fill(0.0);
    for (p, j) in scores.iter().zip(first..=pos) {
        let vr = &v[j * kv_dim + g * hd..][..hd];
        out.iter_mut().zip(vr).for_each(|(o, x)| *o += p * x);
    }
}

/// Dot product with 8 independent accumulators so the compiler can keep it in vector registers.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Attention of one query over two keys, computed by hand.
    #[test]
    fn two_keys_by_hand() {
        let s = AttnShape {
            heads: 1,
            kv_heads: 1,
            head_dim: 2,
            start: 1,
            window: None,
        };
        let q = [1.0, 0.0];
        let k = [0.0, 0.0, 2.0f32.sqrt(), 0.0]; // scores 0 and 1 after the 1/√2 scale
        let v = [1.0, 0.0, 0.0, 1.0];
        let mut out = [0.0; 2];
        attend(s, &q, &k, &v, &mut out);
        let e = std::f32::consts::E;
        assert!((out[0] - 1.0 / (1.0 + e)).abs() < 1e-6);
        assert!((out[1] - e / (1.0 + e)).abs() < 1e-6);
    }

    /// Window 1 sees only the query's own position; GQA maps heads 0,1 to kv head 0.
    #[test]
    fn window_and_groups() {
        let s = AttnShape {
            heads: 2,
            kv_heads: 1,
            head_dim: 1,
            start: 2,
            window: Some(1),
        };
        let q = [5.0, -5.0];
        let k = [1.0, 2.0, 3.0];
        let v = [10.0, 20.0, 30.0];
        let mut out = [0.0; 2];
        attend(s, &q, &k, &v, &mut out);
        assert_eq!(out, [30.0, 30.0]);
    }

    /// The parallel path gives the same numbers as the sequential one.
    #[test]
    fn parallel_matches_sequential() {
        let (heads, kv_heads, hd, n) = (4, 2, 16, 64);
        let r = |i: usize| ((i * 7919 % 1000) as f32 / 500.0) - 1.0;
        let q: Vec<f32> = (0..n * heads * hd).map(r).collect();
        let k: Vec<f32> = (0..n * kv_heads * hd).map(|i| r(i + 3)).collect();
        let v: Vec<f32> = (0..n * kv_heads * hd).map(|i| r(i + 11)).collect();
        let s = AttnShape {
            heads,
            kv_heads,
            head_dim: hd,
            start: 0,
            window: None,
        };
        let mut par = vec![0.0; q.len()];
        attend(s, &q, &k, &v, &mut par);
        let mut seq = vec![0.0; q.len()];
        for i in 0..n {
            let si = AttnShape { start: i, ..s };
            let qd = heads * hd;
            attend(
                si,
                &q[i * qd..(i + 1) * qd],
                &k[..(i + 1) * kv_heads * hd],
                &v[..(i + 1) * kv_heads * hd],
                &mut seq[i * qd..(i + 1) * qd],
            );
        }
        assert_eq!(par, seq);
    }
}
