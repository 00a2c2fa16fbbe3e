//! Qwen3-Next (`model_type: qwen3_next`): the hybrid layout's config fields and tensors.
//!
//! Layers are GatedDeltaNet mixers (`layer_types` entry `linear_attention`, tensors under
//! `linear_attn.`) or output-gated attention (`full_attention`: `q_proj` emits a query and a
//! gate per head, so it has twice the query rows). The feed-forward blocks are the Qwen2-MoE
//! sparse block with a shared expert or dense MLPs, as for the MoE families ([`super::moe`]).
//! The header keeps the `linear_*` geometry in `arch` and marks the `(1 + w)` RMSNorms as
//! `norm_style: gemma`.

use cmf_format::LayerType;
use serde_json::{Map, Value};

use super::config::Fields;
use crate::error::{ConvertError, Result};

/// The hybrid geometry the converter checks tensors against.
#[derive(Debug, Clone)]
pub struct Qwen3Next {
    pub k_heads: usize,
    pub v_heads: usize,
    pub k_head_dim: usize,
    pub v_head_dim: usize,
    pub conv_kernel: usize,
}

/// `linear_*` keys carried into the header verbatim.
const GDN_KEYS: [&str; 5] = [
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
];

/// Reads the hybrid fields; returns the per-layer types and adds the header extras to `extra`.
pub(crate) fn parse(
    f: &Fields,
    num_layers: usize,
    extra: &mut Map<String, Value>,
) -> Result<(Vec<LayerType>, Qwen3Next)> {
    let types = match f.get("layer_types") {
        Some(Value::Array(items)) if items.len() == num_layers => items
            .iter()
            .map(|t| match t.as_str() {
                Some("linear_attention") => Ok(LayerType::LinearAttention),
                Some("full_attention") => Ok(LayerType::FullAttention),
                _ => Err(ConvertError::field(
                    f.file,
                    "layer_types",
                    format!(
                        "unknown layer type {t} (qwen3_next: linear_attention, full_attention)"
                    ),
                )),
            })
            .collect::<Result<Vec<_>>>()?,
        Some(Value::Array(items)) => {
            return Err(ConvertError::field(
                f.file,
                "layer_types",
                format!(
                    "has {} entries for num_hidden_layers = {num_layers}",
                    items.len()
                ),
            ))
        }
        _ => {
            return Err(ConvertError::field(
                f.file,
                "layer_types",
                "missing (qwen3_next lists each layer's mixer)",
            ))
        }
    };
    let mut dims = [0usize; 5];
    for (d, key) in dims.iter_mut().zip(GDN_KEYS) {
        *d = match key {
            "linear_conv_kernel_dim" => f.usize_opt(key)?.unwrap_or(4),
            _ => f.usize_req(key)?,
        };
        if *d == 0 || *d > 4096 {
            return Err(ConvertError::field(
                f.file,
                key,
                format!("{d} is outside 1..=4096"),
            ));
        }
        extra.insert(key.into(), (*d).into());
    }
    let [k_heads, v_heads, k_head_dim, v_head_dim, conv_kernel] = dims;
    if v_heads % k_heads != 0 {
        return Err(ConvertError::field(
            f.file,
            "linear_num_value_heads",
            format!("{v_heads} is not a multiple of linear_num_key_heads {k_heads}"),
        ));
    }

    Ok((
        types,
        Qwen3Next {
            k_heads,
            v_heads,
            k_head_dim,
            v_head_dim,
            conv_kernel,
        },
    ))
}

impl Qwen3Next {
    fn key_dim(&self) -> usize {
        self.k_heads * self.k_head_dim
    }

    fn value_dim(&self) -> usize {
        self.v_heads * self.v_head_dim
    }

    /// The GDN tensors of layer prefix `p` (`model.layers.{i}`) with their shapes.
    pub fn gdn_tensors(&self, p: &str, hidden: usize) -> Vec<(String, Vec<usize>)> {
        let (kd, vd, nv) = (self.key_dim(), self.value_dim(), self.v_heads);
        let a = |s: &str| format!("{p}.linear_attn.{s}");
        vec![
            (a("in_proj_qkvz.weight"), vec![2 * kd + 2 * vd, hidden]),
            (a("in_proj_ba.weight"), vec![2 * nv, hidden]),
            (a("conv1d.weight"), vec![2 * kd + vd, 1, self.conv_kernel]),
            (a("A_log"), vec![nv]),
            (a("dt_bias"), vec![nv]),
            (a("norm.weight"), vec![self.v_head_dim]),
            (a("out_proj.weight"), vec![hidden, vd]),
        ]
    }
}

/// Tensors kept in f32 whatever the codec: the GDN's decay and gate inputs (`in_proj_ba`, a few
/// rows whose error moves every token's decay), its conv taps, `A_log` and `dt_bias`.
pub fn keeps_f32(name: &str) -> bool {
    [
        ".linear_attn.in_proj_ba.weight",
        ".linear_attn.conv1d.weight",
        ".linear_attn.A_log",
        ".linear_attn.dt_bias",
    ]
    .iter()
    .any(|s| name.ends_with(s))
}

#[cfg(test)]
mod tests {
    use super::super::config::parse_config;
    use cmf_format::{LayerType, NormStyle};
    use serde_json::{json, Value};
    use std::path::Path;

    fn base() -> Value {
        json!({"model_type": "qwen3_next", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "vocab_size": 100, "layer_types": ["linear_attention", "full_attention"],
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
            "linear_value_head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [0], "rope_parameters": {"rope_type": "default",
            "rope_theta": 10000.0, "partial_rotary_factor": 0.25}})
    }

    #[test]
    fn hybrid_arch_fields() {
        let c = parse_config(Path::new("config.json"), &base()).unwrap();
        let a = &c.arch;
        assert_eq!(
            a.layer_types,
            [LayerType::LinearAttention, LayerType::FullAttention]
        );
        assert_eq!(a.norm_style, NormStyle::Gemma);
        assert_eq!(a.partial_rotary_factor, 0.25);
        assert_eq!(a.extra["linear_conv_kernel_dim"], 4);
        let moe = a.moe.as_ref().unwrap();
        assert_eq!(moe.shared_expert_intermediate_size, Some(48));
        assert!(moe.norm_topk_prob, "Qwen3NextConfig's default");
        assert_eq!(c.sparse_layers, [false, true]);
    }

    #[test]
    fn refusals_name_the_field() {
        let err = |v: Value| {
            parse_config(Path::new("config.json"), &v)
                .unwrap_err()
                .to_string()
        };
        let mut v = base();
        v.as_object_mut().unwrap().remove("layer_types");
        assert!(err(v).contains("layer_types"));
        let mut v = base();
        v["layer_types"] = json!(["linear_attention", "sliding_attention"]);
        assert!(err(v).contains("layer_types"));
        let mut v = base();
        v["linear_num_value_heads"] = json!(3);
        assert!(err(v).contains("linear_num_value_heads"));
        let mut v = base();
        v.as_object_mut().unwrap().remove("linear_key_head_dim");
        assert!(err(v).contains("linear_key_head_dim"));
    }
}
