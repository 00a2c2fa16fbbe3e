//! GGUF tensor names → Hugging Face checkpoint names, and the Q/K row permutation.
//!
//! Names: llama.cpp's tensor map for the llama, qwen2, qwen3, qwen3moe and qwen3next architectures
//! (`gguf-py/gguf/tensor_mapping.py`, `MODEL_TENSOR` ↔ the Hugging Face names that converter
//! reads), inverted. llama.cpp stacks a MoE layer's experts into one 3-D tensor per projection
//! (`ffn_{gate,up,down}_exps`, numpy shape [experts, rows, cols]); the importer splits them back
//! into the hub's per-expert tensors.
//!
//! Permutation: for the llama architecture llama.cpp's converter reorders the rows of q_proj
//! and k_proj (weights and biases) so that its RoPE can rotate adjacent pairs
//! (`conversion/llama.py`, `LlamaModel.permute`):
//! `w.reshape(n_head, 2, head_dim / 2, ...).swapaxes(1, 2)`, i.e. GGUF row `h·hd + 2i + t` holds
//! Hugging Face row `h·hd + t·hd/2 + i`. qwen2/qwen3 are converted without it.

/// The Hugging Face name of a GGUF tensor, or `None` when it has no counterpart.
pub fn hf_name(gguf: &str) -> Option<String> {
    let direct = match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(d) = direct {
        return Some(d.to_owned());
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, tail) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    // qwen3next's GatedDeltaNet scalars: `A_log` has no suffix, `dt_bias` became a bias.
    match tail {
        "ssm_a" => return Some(format!("model.layers.{layer}.linear_attn.A_log")),
        "ssm_dt.bias" => return Some(format!("model.layers.{layer}.linear_attn.dt_bias")),
        _ => {}
    }
    let (base, suffix) = tail.rsplit_once('.')?;
    if suffix != "weight" && suffix != "bias" {
        return None;
    }
    let hf = match base {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        "ffn_gate_inp" => "mlp.gate",
        "post_attention_norm" => "post_attention_layernorm",
        "ffn_gate_shexp" => "mlp.shared_expert.gate_proj",
        "ffn_up_shexp" => "mlp.shared_expert.up_proj",
        "ffn_down_shexp" => "mlp.shared_expert.down_proj",
        "ffn_gate_inp_shexp" => "mlp.shared_expert_gate",
        "ssm_in" => "linear_attn.in_proj_qkvz",
        "ssm_ba" => "linear_attn.in_proj_ba",
        "ssm_conv1d" => "linear_attn.conv1d",
        "ssm_norm" => "linear_attn.norm",
        "ssm_out" => "linear_attn.out_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{suffix}"))
}

/// A stacked expert tensor (`blk.N.ffn_{gate,up,down}_exps.weight`, numpy shape [E, rows, cols]):
/// its layer and the per-expert Hugging Face leaf (`gate_proj`, `up_proj`, `down_proj`).
pub fn expert_stack(gguf: &str) -> Option<(usize, &'static str)> {
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, tail) = rest.split_once('.')?;
    let leaf = match tail {
        "ffn_gate_exps.weight" => "gate_proj",
        "ffn_up_exps.weight" => "up_proj",
        "ffn_down_exps.weight" => "down_proj",
        _ => return None,
    };
    Some((layer.parse().ok()?, leaf))
}

/// The Hugging Face name of expert `e`'s slice of a stacked expert tensor.
pub fn expert_name(layer: usize, e: usize, leaf: &str) -> String {
    format!("model.layers.{layer}.mlp.experts.{e}.{leaf}.weight")
}

/// For an output (Hugging Face) row of a permuted projection, the GGUF row holding it.
pub fn unpermuted_source_row(row: usize, head_dim: usize) -> usize {
    let half = head_dim / 2;
    let (h, rem) = (row / head_dim, row % head_dim);
    let (t, i) = (rem / half, rem % half);
    h * head_dim + 2 * i + t
}

/// Which heads count applies when a tensor needs un-permuting: `Some(n_head)` for q, `Some(n_kv)`
/// for k, `None` otherwise.
pub fn permuted_heads(gguf: &str, n_head: usize, n_kv: usize) -> Option<usize> {
    let tail = gguf.strip_prefix("blk.")?.split_once('.')?.1;
    match tail {
        "attn_q.weight" | "attn_q.bias" => Some(n_head),
        "attn_k.weight" | "attn_k.bias" => Some(n_kv),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(
            hf_name("blk.12.attn_q.bias").as_deref(),
            Some("model.layers.12.self_attn.q_proj.bias")
        );
        assert_eq!(
            hf_name("blk.0.ffn_down.weight").as_deref(),
            Some("model.layers.0.mlp.down_proj.weight")
        );
        assert_eq!(hf_name("output.weight").as_deref(), Some("lm_head.weight"));
        assert_eq!(hf_name("rope_freqs.weight"), None);
        assert_eq!(
            hf_name("blk.2.ffn_gate_inp.weight").as_deref(),
            Some("model.layers.2.mlp.gate.weight")
        );
        assert_eq!(hf_name("blk.2.ffn_up_exps.weight"), None);
        assert_eq!(
            expert_stack("blk.2.ffn_down_exps.weight"),
            Some((2, "down_proj"))
        );
        assert_eq!(
            expert_name(2, 5, "down_proj"),
            "model.layers.2.mlp.experts.5.down_proj.weight"
        );
        assert_eq!(hf_name("blk.x.attn_q.weight"), None);
        assert_eq!(
            hf_name("blk.4.ssm_a").as_deref(),
            Some("model.layers.4.linear_attn.A_log")
        );
        assert_eq!(
            hf_name("blk.4.ssm_dt.bias").as_deref(),
            Some("model.layers.4.linear_attn.dt_bias")
        );
        assert_eq!(
            hf_name("blk.4.ffn_gate_inp_shexp.weight").as_deref(),
            Some("model.layers.4.mlp.shared_expert_gate.weight")
        );
        assert_eq!(
            hf_name("blk.4.ssm_in.weight").as_deref(),
            Some("model.layers.4.linear_attn.in_proj_qkvz.weight")
        );
        assert_eq!(
            hf_name("blk.4.attn_qkv.weight"),
            None,
            "regrouped: see qwen3next"
        );
        assert_eq!(permuted_heads("blk.3.attn_k.weight", 9, 3), Some(3));
        assert_eq!(permuted_heads("blk.3.attn_v.weight", 9, 3), None);
    }

    /// The inverse of llama.cpp's forward permutation, written the way the converter does it.
    #[test]
    fn unpermute_inverts_the_converter() {
        let (n_head, hd) = (3, 8);
        let hf: Vec<usize> = (0..n_head * hd).collect();
        // reshape(n_head, 2, hd/2).swapaxes(1, 2).reshape(-1)
        let mut gguf = vec![0; hf.len()];
        for h in 0..n_head {
            for i in 0..hd / 2 {
                for t in 0..2 {
                    gguf[h * hd + i * 2 + t] = hf[h * hd + t * hd / 2 + i];
                }
            }
        }
        let back: Vec<usize> = (0..hf.len())
            .map(|r| gguf[unpermuted_source_row(r, hd)])
            .collect();
        assert_eq!(back, hf);
    }
}
