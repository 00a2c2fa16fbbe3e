//! Rotary position embeddings from precomputed cos/sin tables.
//!
//! The caller supplies positions and inverse frequencies (rope scaling variants only change
//! those and the `attention_scaling` factor), or the angles themselves (Z-Image's 3-axis RoPE).

use crate::simd::{multiversion, Fma};

/// Which dimensions form the rotated pairs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// (i, i + rot/2): transformers' `rotate_half` (Llama, Qwen, Mistral).
    RotateHalf,
    /// (2i, 2i + 1): complex-multiplication form (Flux, Z-Image).
    Interleaved,
}

/// cos/sin per (row, pair): `rows × half`, half = number of rotated pairs (rot_dim / 2).
#[derive(Clone, Debug)]
pub struct RopeTable {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    /// As transformers computes it: angle = f32(pos · inv_freq[i]) (an f32 product), then
    /// cos/sin of that angle, times `attention_scaling` (1.0 unless the rope type sets it).
    pub fn new(positions: &[f32], inv_freq: &[f32], attention_scaling: f32) -> RopeTable {
        let half = inv_freq.len();
        let mut t = RopeTable {
            half,
            cos: Vec::with_capacity(positions.len() * half),
            sin: Vec::with_capacity(positions.len() * half),
        };
        for &p in positions {
            for &f in inv_freq {
                let a = (p * f) as f64;
                t.cos.push(a.cos() as f32 * attention_scaling);
                t.sin.push(a.sin() as f32 * attention_scaling);
            }
        }
        t
    }

    /// From angles `rows × half` given in f64 (e.g. Z-Image's per-axis frequencies concatenated).
    pub fn from_angles(angles: &[f64], half: usize) -> RopeTable {
        assert!(
            half > 0 && angles.len().is_multiple_of(half),
            "RopeTable::from_angles: {} angles are not rows of {half}",
            angles.len()
        );
        RopeTable {
            half,
            cos: angles.iter().map(|a| a.cos() as f32).collect(),
            sin: angles.iter().map(|a| a.sin() as f32).collect(),
        }
    }

    /// From cos and sin tables `rows × half`, as [`RopeTable::from_angles`] would make them.
    pub fn from_cos_sin(cos: Vec<f32>, sin: Vec<f32>, half: usize) -> RopeTable {
        assert!(
            half > 0 && cos.len() == sin.len() && cos.len().is_multiple_of(half),
            "RopeTable::from_cos_sin: {} cos and {} sin values are not rows of {half}",
            cos.len(),
            sin.len()
        );
        RopeTable { half, cos, sin }
    }

    /// The cos and sin tables, `rows × half` each.
    pub fn into_cos_sin(self) -> (Vec<f32>, Vec<f32>) {
        (self.cos, self.sin)
    }

    /// Number of rows (positions).
    pub fn rows(&self) -> usize {
        self.cos.len() / self.half
    }

    /// Rotated pairs per head.
    pub fn half(&self) -> usize {
        self.half
    }

    pub fn cos(&self, row: usize) -> &[f32] {
        &self.cos[row * self.half..(row + 1) * self.half]
    }

    pub fn sin(&self, row: usize) -> &[f32] {
        &self.sin[row * self.half..(row + 1) * self.half]
    }
}

#[inline(always)]
fn rope_body<F: Fma>(
    x: &mut [f32],
    n_tokens: usize,
    head_dim: usize,
    style: RopeStyle,
    table: &RopeTable,
    first_row: usize,
) {
    let half = table.half;
    assert!(
        2 * half <= head_dim,
        "rope: {half} pairs do not fit a head of {head_dim}"
    );
    assert!(
        n_tokens > 0 && x.len().is_multiple_of(n_tokens * head_dim),
        "rope: x is not n_tokens × heads × head_dim"
    );
    assert!(
        first_row + n_tokens <= table.rows(),
        "rope: table has {} rows, need {}",
        table.rows(),
        first_row + n_tokens
    );
    let per_token = x.len() / n_tokens;
    for (t, tok) in x.chunks_mut(per_token).enumerate() {
        let (cos, sin) = (table.cos(first_row + t), table.sin(first_row + t));
        for head in tok.chunks_mut(head_dim) {
            match style {
                RopeStyle::RotateHalf => {
                    let (a, b) = head[..2 * half].split_at_mut(half);
                    for i in 0..half {
                        let (u, v) = (a[i], b[i]);
                        a[i] = u * cos[i] - v * sin[i];
                        b[i] = v * cos[i] + u * sin[i];
                    }
                }
                RopeStyle::Interleaved => {
                    for (i, p) in head[..2 * half].chunks_exact_mut(2).enumerate() {
                        let (u, v) = (p[0], p[1]);
                        p[0] = u * cos[i] - v * sin[i];
                        p[1] = v * cos[i] + u * sin[i];
                    }
                }
            }
        }
    }
}
multiversion!(
    /// Rotates `x[n_tokens, n_heads, head_dim]` in place; token t uses table row `first_row + t`.
    /// The first 2·half dims of each head rotate (partial rotary leaves the rest).
    pub fn rope / rope_with = rope_body;
    (x: &mut [f32], n_tokens: usize, head_dim: usize, style: RopeStyle, table: &RopeTable, first_row: usize));
