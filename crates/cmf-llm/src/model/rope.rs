//! Rotary position embedding: the inverse frequencies of each scaling variant. The frequency formulas follow transformers `modeling_rope_utils.py`
//! (`_compute_default_rope_parameters`, `_compute_linear_scaling_rope_parameters`,
//! `_compute_dynamic_ntk_parameters`, `_compute_llama3_parameters`, `_compute_yarn_parameters`),
//! including its float32 rounding: inv_freq is stored as f32 and the angle is the f32 product
//! `pos · inv_freq`, as the `inv_freq @ position_ids` matmul computes it.
//!
//! The rotation itself (rotate-half over the first `rotary_dim` elements of each head) is
//! `cmf_kernels::ops::rope` with a `RopeTable` built from these frequencies.

use std::f64::consts::PI;

#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor` (inv_freq / factor).
    Linear {
        factor: f64,
    },
    /// NTK-aware base growth once the sequence exceeds `max_position_embeddings`.
    Dynamic {
        factor: f64,
        max_position_embeddings: usize,
    },
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    Yarn {
        factor: f64,
        original_max_position_embeddings: f64,
        beta_fast: f64,
        beta_slow: f64,
        /// Multiplies cos and sin (transformers' `attention_scaling`).
        attention_factor: f64,
        truncate: bool,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    pub theta: f64,
    /// Rotated elements per head (head_dim · partial_rotary_factor), even.
    pub rotary_dim: usize,
    pub scaling: RopeScaling,
}

/// Frequencies for one model. `inv_freq` has `rotary_dim / 2` entries.
#[derive(Debug, Clone)]
pub struct Rope {
    pub config: RopeConfig,
    inv_freq: Vec<f32>,
    attention_scaling: f32,
}

impl Rope {
    pub fn new(config: &RopeConfig) -> Rope {
        let (inv_freq, attention_scaling) = compute_inv_freq(config, None);
        Rope {
            config: config.clone(),
            inv_freq,
            attention_scaling,
        }
    }

    pub fn rotary_dim(&self) -> usize {
        self.config.rotary_dim
    }

    /// Inverse frequencies for a forward pass whose last position is `seq_len − 1`. Only the
    /// dynamic variant depends on it (transformers `dynamic_rope_update`: recomputed when the
    /// sequence outgrows `max_position_embeddings`; keys already cached keep their rotation).
    pub fn inv_freq_for(&self, seq_len: usize) -> std::borrow::Cow<'_, [f32]> {
        match self.config.scaling {
            RopeScaling::Dynamic {
                max_position_embeddings,
                ..
            } if seq_len > max_position_embeddings => {
                std::borrow::Cow::Owned(compute_inv_freq(&self.config, Some(seq_len)).0)
            }
            _ => std::borrow::Cow::Borrowed(&self.inv_freq),
        }
    }

    /// Multiplies cos and sin (YaRN's attention factor; 1 otherwise).
    pub fn attention_scaling(&self) -> f32 {
        self.attention_scaling
    }
}

/// Returns (inv_freq, attention_scaling). `seq_len` only matters for the dynamic variant.
fn compute_inv_freq(cfg: &RopeConfig, seq_len: Option<usize>) -> (Vec<f32>, f32) {
    let dim = cfg.rotary_dim;
    let base_freqs = |base: f64| -> Vec<f32> {
        (0..dim / 2)
            .map(|i| {
                let e = (2 * i) as f32 / dim as f32;
                1.0f32 / (base.powf(e as f64) as f32)
            })
            .collect()
    };
    match cfg.scaling {
        RopeScaling::None => (base_freqs(cfg.theta), 1.0),
        RopeScaling::Linear { factor } => (
            base_freqs(cfg.theta)
                .into_iter()
                .map(|f| f / factor as f32)
                .collect(),
            1.0,
        ),
        RopeScaling::Dynamic {
            factor,
            max_position_embeddings,
        } => {
            let max = max_position_embeddings as f64;
            let len = seq_len.unwrap_or(0).max(max_position_embeddings) as f64;
            let base = cfg.theta
                * ((factor * len / max) - (factor - 1.0)).powf(dim as f64 / (dim as f64 - 2.0));
            (base_freqs(base), 1.0)
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings: old,
        } => {
            let low_wavelen = old / low_freq_factor;
            let high_wavelen = old / high_freq_factor;
            let f = base_freqs(cfg.theta)
                .into_iter()
                .map(|inv| {
                    let inv = inv as f64;
                    let wavelen = 2.0 * PI / inv;
                    if wavelen < high_wavelen {
                        inv
                    } else if wavelen > low_wavelen {
                        inv / factor
                    } else {
                        let smooth = (old / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * inv / factor + smooth * inv
                    }
                })
                .map(|x| x as f32)
                .collect();
            (f, 1.0)
        }
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings: orig,
            beta_fast,
            beta_slow,
            attention_factor,
            truncate,
        } => {
            let base = cfg.theta;
            let d = dim as f64;
            let correction_dim =
                |rot: f64| (d * (orig / (rot * 2.0 * PI)).ln()) / (2.0 * base.ln());
            let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
            if truncate {
                low = low.floor();
                high = high.ceil();
            }
            let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
            if low == high {
                high += 0.001; // transformers: prevent singularity
            }
            let f = (0..dim / 2)
                .map(|i| {
                    let pos_freq = base.powf((2 * i) as f64 / d);
                    let extrapolation = 1.0 / pos_freq;
                    let interpolation = 1.0 / (factor * pos_freq);
                    let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                    let extra_factor = 1.0 - ramp;
                    (interpolation * (1.0 - extra_factor) + extrapolation * extra_factor) as f32
                })
                .collect();
            (f, attention_factor as f32)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(scaling: RopeScaling) -> RopeConfig {
        RopeConfig {
            theta: 10000.0,
            rotary_dim: 8,
            scaling,
        }
    }

    #[test]
    fn default_frequencies() {
        let r = Rope::new(&cfg(RopeScaling::None));
        let f = r.inv_freq_for(1);
        assert_eq!(f.len(), 4);
        assert_eq!(f[0], 1.0);
        assert!((f[1] - 0.1).abs() < 1e-7);
        assert!((f[3] - 1e-3).abs() < 1e-9);
    }

    #[test]
    fn llama3_keeps_high_and_divides_low_frequencies() {
        let mut c = cfg(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64.0,
        });
        c.rotary_dim = 32;
        let plain = Rope::new(&RopeConfig {
            scaling: RopeScaling::None,
            ..c.clone()
        });
        let scaled = Rope::new(&c);
        let (p, s) = (plain.inv_freq_for(1), scaled.inv_freq_for(1));
        assert_eq!(p[0], s[0]); // wavelength 2π < 16: untouched
        assert!((s[15] - p[15] / 8.0).abs() < 1e-12); // wavelength ≫ 64: divided by factor
    }

    #[test]
    fn dynamic_only_changes_past_max_positions() {
        let r = Rope::new(&cfg(RopeScaling::Dynamic {
            factor: 2.0,
            max_position_embeddings: 16,
        }));
        let plain = Rope::new(&cfg(RopeScaling::None));
        assert_eq!(r.inv_freq_for(16)[..], plain.inv_freq_for(1)[..]);
        assert!(r.inv_freq_for(64)[3] < plain.inv_freq_for(1)[3]);
    }
}
