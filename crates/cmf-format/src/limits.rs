//! Sane bounds on the sizes and hyper-parameters a model description may claim. Importers check
//! a source's numbers against them before allocating anything sized by those numbers, and the
//! runtime checks a file's header again, so a hostile `config.json`, GGUF or CMF header is an
//! error naming the field instead of a terabyte allocation or a model that computes NaN.
//!
//! The bounds are an order of magnitude above the largest published dense models (126 layers,
//! hidden 16 384, intermediate 53 248, vocabularies of 262 144 entries, 10 M-token contexts).

use crate::header::Arch;

pub const MAX_LAYERS: usize = 1 << 10;
pub const MAX_HIDDEN: usize = 1 << 18;
pub const MAX_INTERMEDIATE: usize = 1 << 20;
pub const MAX_HEADS: usize = 1 << 12;
pub const MAX_HEAD_DIM: usize = 1 << 12;
pub const MAX_VOCAB: usize = 1 << 23;
pub const MAX_POSITIONS: usize = 1 << 28;
/// Experts per MoE layer (published models route over at most a few hundred).
pub const MAX_EXPERTS: usize = 1 << 12;

/// `value` for `field`, refused when 0 or above `max`.
pub fn check_size(field: &str, value: usize, max: usize) -> Result<(), (String, String)> {
    if value == 0 || value > max {
        return Err((field.to_string(), format!("{value} is outside 1..={max}")));
    }
    Ok(())
}

/// A float hyper-parameter that must be finite and inside `(lo, hi)` (exclusive, as for a norm
/// epsilon or a RoPE base).
pub fn check_float(field: &str, value: f64, lo: f64, hi: f64) -> Result<(), (String, String)> {
    if !value.is_finite() || value <= lo || value >= hi {
        return Err((
            field.to_string(),
            format!("{value} must be a finite number in ({lo}, {hi})"),
        ));
    }
    Ok(())
}

/// Every size and float of `arch` against the bounds above; `Err((field, message))`.
pub fn check_arch(a: &Arch) -> Result<(), (String, String)> {
    check_size("hidden_size", a.hidden_size, MAX_HIDDEN)?;
    check_size("intermediate_size", a.intermediate_size, MAX_INTERMEDIATE)?;
    check_size("num_layers", a.num_layers, MAX_LAYERS)?;
    check_size("num_attention_heads", a.num_attention_heads, MAX_HEADS)?;
    check_size("num_kv_heads", a.num_kv_heads, MAX_HEADS)?;
    check_size("head_dim", a.head_dim, MAX_HEAD_DIM)?;
    check_size("vocab_size", a.vocab_size, MAX_VOCAB)?;
    check_size(
        "max_position_embeddings",
        a.max_position_embeddings,
        MAX_POSITIONS,
    )?;
    if let Some(m) = &a.moe {
        check_size("moe.num_experts", m.num_experts, MAX_EXPERTS)?;
        check_size("moe.top_k", m.top_k, m.num_experts.min(MAX_EXPERTS))?;
        check_size(
            "moe.moe_intermediate_size",
            m.moe_intermediate_size,
            MAX_INTERMEDIATE,
        )?;
        if let Some(w) = m.shared_expert_intermediate_size {
            check_size("moe.shared_expert_intermediate_size", w, MAX_INTERMEDIATE)?;
        }
    }
    check_float("rms_norm_eps", a.rms_norm_eps, 0.0, 1.0)?;
    check_float("rope_theta", a.rope_theta, 0.0, 1e12)?;
    check_float(
        "partial_rotary_factor",
        f64::from(a.partial_rotary_factor),
        0.0,
        1.0 + f64::EPSILON,
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_name_the_field() {
        let ok = Arch {
            hidden_size: 64,
            intermediate_size: 128,
            num_layers: 2,
            num_attention_heads: 4,
            num_kv_heads: 2,
            head_dim: 16,
            vocab_size: 100,
            max_position_embeddings: 128,
            ..Arch::default()
        };
        check_arch(&ok).unwrap();
        let bad = |f: fn(&mut Arch)| {
            let mut a = ok.clone();
            f(&mut a);
            check_arch(&a).unwrap_err().0
        };
        assert_eq!(bad(|a| a.num_layers = 1 << 40), "num_layers");
        assert_eq!(bad(|a| a.vocab_size = 0), "vocab_size");
        assert_eq!(bad(|a| a.rms_norm_eps = f64::NAN), "rms_norm_eps");
        assert_eq!(bad(|a| a.rms_norm_eps = -1e-6), "rms_norm_eps");
        assert_eq!(bad(|a| a.rope_theta = f64::INFINITY), "rope_theta");
        assert_eq!(bad(|a| a.rope_theta = -10.0), "rope_theta");
    }
}
