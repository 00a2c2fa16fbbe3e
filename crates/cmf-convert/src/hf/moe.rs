//! Mixture-of-experts fields of a Hugging Face `config.json` (`qwen2_moe`, `qwen3_moe`,
//! `qwen3_next`) → the CMF
//! header's `moe` descriptor (`cortiq_core::types::MoeConfig`), and which layers are sparse.
//!
//! The descriptor carries only what `cortiq-core` 0.8.54 defines: `num_experts`, `top_k`,
//! `moe_intermediate_size`, `norm_topk_prob` and, for Qwen2-MoE, the shared expert's width. A
//! CMF reader tells a sparse layer from a dense one by its router tensor
//! (`model.layers.{i}.mlp.gate.weight`), so `decoder_sparse_step` / `mlp_only_layers` decide
//! here which tensors the checkpoint must hold and need not be stored.

use cmf_format::{limits, Moe};
use serde_json::{Map, Value};

use super::config::Fields;
use crate::error::{ConvertError, Result};

/// The descriptor and the per-layer plan (true = routed experts, false = dense MLP).
pub(crate) fn parse(f: &Fields, model_type: &str, num_layers: usize) -> Result<(Moe, Vec<bool>)> {
    let num_experts = match f.usize_opt("num_experts")? {
        Some(n) => n,
        None => f.usize_req("num_local_experts")?,
    };
    let top_k = f.usize_req("num_experts_per_tok")?;
    let width = f.usize_req("moe_intermediate_size")?;
    let shared = match model_type {
        "qwen2_moe" | "qwen3_next" => Some(f.usize_req("shared_expert_intermediate_size")?),
        _ => None,
    };
    let field = |k: &str, m: String| ConvertError::field(f.file, k, m);
    limits::check_size("num_experts", num_experts, limits::MAX_EXPERTS)
        .map_err(|(k, m)| field(&k, m))?;
    limits::check_size("num_experts_per_tok", top_k, num_experts).map_err(|(k, m)| field(&k, m))?;
    limits::check_size("moe_intermediate_size", width, limits::MAX_INTERMEDIATE)
        .map_err(|(k, m)| field(&k, m))?;
    if let Some(s) = shared {
        limits::check_size(
            "shared_expert_intermediate_size",
            s,
            limits::MAX_INTERMEDIATE,
        )
        .map_err(|(k, m)| field(&k, m))?;
    }
    let moe = Moe {
        num_experts,
        top_k,
        moe_intermediate_size: width,
        // The config classes' defaults: Qwen3NextConfig true, the MoE families false.
        norm_topk_prob: f
            .bool_opt("norm_topk_prob")?
            .unwrap_or(model_type == "qwen3_next"),
        shared_expert_intermediate_size: shared,
        extra: Map::new(),
    };
    Ok((moe, sparse_layers(f, num_layers)?))
}

/// transformers `Qwen3MoeDecoderLayer.__init__`: layer i is sparse unless it is listed in
/// `mlp_only_layers` or `(i + 1) % decoder_sparse_step != 0`.
fn sparse_layers(f: &Fields, n: usize) -> Result<Vec<bool>> {
    let step = f.usize_opt("decoder_sparse_step")?.unwrap_or(1);
    if step == 0 {
        return Err(ConvertError::field(
            f.file,
            "decoder_sparse_step",
            "must be at least 1",
        ));
    }
    let dense: Vec<usize> = match f.get("mlp_only_layers") {
        None => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_u64()
                    .map(|i| i as usize)
                    .filter(|&i| i < n)
                    .ok_or_else(|| {
                        ConvertError::field(
                            f.file,
                            "mlp_only_layers",
                            format!("entry {v} is not a layer index below {n}"),
                        )
                    })
            })
            .collect::<Result<_>>()?,
        Some(_) => {
            return Err(ConvertError::field(
                f.file,
                "mlp_only_layers",
                "expected a list of layer indices",
            ))
        }
    };
    Ok((0..n)
        .map(|i| !dense.contains(&i) && (i + 1) % step == 0)
        .collect())
}

/// Tensors a sparse layer `p` needs: (name, shape).
pub(crate) fn required(moe: &Moe, h: usize, p: &str) -> Vec<(String, Vec<usize>)> {
    let (e, f) = (moe.num_experts, moe.moe_intermediate_size);
    let mut v = vec![(format!("{p}.mlp.gate.weight"), vec![e, h])];
    for x in 0..e {
        v.extend(mlp(&format!("{p}.mlp.experts.{x}"), h, f));
    }
    if let Some(s) = moe.shared_expert_intermediate_size {
        v.extend(mlp(&format!("{p}.mlp.shared_expert"), h, s));
        v.push((format!("{p}.mlp.shared_expert_gate.weight"), vec![1, h]));
    }
    v
}

/// gate / up [f, h], down [h, f] under `base`.
pub(crate) fn mlp(base: &str, h: usize, f: usize) -> [(String, Vec<usize>); 3] {
    [
        (format!("{base}.gate_proj.weight"), vec![f, h]),
        (format!("{base}.up_proj.weight"), vec![f, h]),
        (format!("{base}.down_proj.weight"), vec![h, f]),
    ]
}
