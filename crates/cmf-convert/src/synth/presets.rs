//! The `cmf synth` presets: real model geometries (from each model's published `config.json`).

use cmf_format::{Arch, Header, LayerType, Moe, NormStyle, QuantType, TokenizerConfig};
use serde_json::Map;

use super::{tokenizer, Init, SynthArgs, SynthSpec, SynthTensor};
use crate::error::Result;

pub struct Preset {
    pub name: &'static str,
    pub description: &'static str,
    pub build: fn(&SynthArgs) -> Result<SynthSpec>,
}

/// Add a family here (e.g. `z-image-turbo`): `build` returns its header, tokenizer and tensors.
pub const PRESETS: &[Preset] = &[
    Preset {
        name: "tiny",
        description: "2-layer llama, hidden 64, vocab 512 (tests)",
        build: |a| llm(a, &TINY),
    },
    Preset {
        name: "smollm2-135m",
        description: "SmolLM2-135M geometry (llama)",
        build: |a| llm(a, &SMOLLM2_135M),
    },
    Preset {
        name: "qwen3-0.6b",
        description: "Qwen3-0.6B geometry",
        build: |a| llm(a, &QWEN3_0_6B),
    },
    Preset {
        name: "qwen3-8b",
        description: "Qwen3-8B geometry",
        build: |a| llm(a, &QWEN3_8B),
    },
    Preset {
        name: "llama3-8b",
        description: "Llama-3.1-8B geometry",
        build: |a| llm(a, &LLAMA3_8B),
    },
    Preset {
        name: "qwen3-30b-a3b",
        description: "Qwen3-30B-A3B geometry (MoE: 128 experts of width 768, top 8)",
        build: |a| llm(a, &QWEN3_30B_A3B),
    },
    Preset {
        name: "qwen3-moe-1b",
        description: "Qwen3-MoE of ~1B parameters (16 layers, hidden 1024, 64 experts of width 256, top 8) for CPU timing",
        build: |a| llm(a, &QWEN3_MOE_1B),
    },
    Preset {
        name: "z-image-turbo",
        description: "Z-Image-Turbo pack (DiT 6.15B, Qwen3-4B encoder to layer 35, FLUX VAE decoder f32); use --quant q8_2f",
        build: super::zimage::z_image_turbo,
    },
];

pub fn find_preset(name: &str) -> Option<&'static Preset> {
    PRESETS.iter().find(|p| p.name == name)
}

/// A decoder-only LLM geometry.
pub struct LlmGeometry {
    pub arch_name: &'static str,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub rope_theta: f64,
    pub rms_norm_eps: f64,
    pub max_position: usize,
    pub tied: bool,
    /// Routed experts in every layer (Qwen3-MoE), or a dense MLP.
    pub moe: Option<MoeGeometry>,
}

/// The experts of a MoE geometry (softmax top-k routing, renormalised as Qwen3-MoE does).
pub struct MoeGeometry {
    pub experts: usize,
    pub top_k: usize,
    pub width: usize,
}

pub const TINY: LlmGeometry = LlmGeometry {
    arch_name: "llama",
    hidden: 64,
    intermediate: 128,
    layers: 2,
    heads: 4,
    kv_heads: 2,
    head_dim: 16,
    vocab: 512,
    rope_theta: 10_000.0,
    rms_norm_eps: 1e-5,
    max_position: 2048,
    tied: false,
    moe: None,
};
/// HuggingFaceTB/SmolLM2-135M-Instruct config.json.
pub const SMOLLM2_135M: LlmGeometry = LlmGeometry {
    arch_name: "llama",
    hidden: 576,
    intermediate: 1536,
    layers: 30,
    heads: 9,
    kv_heads: 3,
    head_dim: 64,
    vocab: 49152,
    rope_theta: 100_000.0,
    rms_norm_eps: 1e-5,
    max_position: 8192,
    tied: true,
    moe: None,
};
/// Qwen/Qwen3-0.6B config.json.
pub const QWEN3_0_6B: LlmGeometry = LlmGeometry {
    arch_name: "qwen3",
    hidden: 1024,
    intermediate: 3072,
    layers: 28,
    heads: 16,
    kv_heads: 8,
    head_dim: 128,
    vocab: 151_936,
    rope_theta: 1_000_000.0,
    rms_norm_eps: 1e-6,
    max_position: 40_960,
    tied: true,
    moe: None,
};
/// Qwen/Qwen3-8B config.json.
pub const QWEN3_8B: LlmGeometry = LlmGeometry {
    arch_name: "qwen3",
    hidden: 4096,
    intermediate: 12_288,
    layers: 36,
    heads: 32,
    kv_heads: 8,
    head_dim: 128,
    vocab: 151_936,
    rope_theta: 1_000_000.0,
    rms_norm_eps: 1e-6,
    max_position: 40_960,
    tied: false,
    moe: None,
};
/// meta-llama/Llama-3.1-8B config.json (without its llama3 RoPE scaling, which does not change
/// the cost of a forward pass).
pub const LLAMA3_8B: LlmGeometry = LlmGeometry {
    arch_name: "llama",
    hidden: 4096,
    intermediate: 14_336,
    layers: 32,
    heads: 32,
    kv_heads: 8,
    head_dim: 128,
    vocab: 128_256,
    rope_theta: 500_000.0,
    rms_norm_eps: 1e-5,
    max_position: 8192,
    tied: false,
    moe: None,
};

/// Qwen/Qwen3-30B-A3B config.json.
pub const QWEN3_30B_A3B: LlmGeometry = LlmGeometry {
    arch_name: "qwen3_moe",
    hidden: 2048,
    intermediate: 6144,
    layers: 48,
    heads: 32,
    kv_heads: 4,
    head_dim: 128,
    vocab: 151_936,
    rope_theta: 1_000_000.0,
    rms_norm_eps: 1e-6,
    max_position: 40_960,
    tied: false,
    moe: Some(MoeGeometry {
        experts: 128,
        top_k: 8,
        width: 768,
    }),
};
/// A Qwen3-MoE of ~1.0B parameters (0.30B used per token, 0.16B of it the tied lm_head): the
/// 30B-A3B layout scaled down so a CPU decodes it at interactive speed.
pub const QWEN3_MOE_1B: LlmGeometry = LlmGeometry {
    arch_name: "qwen3_moe",
    hidden: 1024,
    intermediate: 3072,
    layers: 16,
    heads: 16,
    kv_heads: 4,
    head_dim: 64,
    vocab: 151_936,
    rope_theta: 1_000_000.0,
    rms_norm_eps: 1e-6,
    max_position: 40_960,
    tied: true,
    moe: Some(MoeGeometry {
        experts: 64,
        top_k: 8,
        width: 256,
    }),
};

const STD: f32 = 0.02;

/// The tensors of a llama/qwen3 decoder, in model order, with Hugging Face names.
pub fn llm_tensors(g: &LlmGeometry) -> Vec<SynthTensor> {
    let t = |name: String, shape: Vec<usize>, init| SynthTensor {
        name,
        shape,
        init,
        dtype: None,
    };
    let normal = Init::Normal { std: STD };
    let (h, q, kv, hd) = (
        g.hidden,
        g.heads * g.head_dim,
        g.kv_heads * g.head_dim,
        g.head_dim,
    );
    let mut v = vec![t(
        "model.embed_tokens.weight".into(),
        vec![g.vocab, h],
        normal,
    )];
    for i in 0..g.layers {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        v.push(t(p("input_layernorm.weight"), vec![h], Init::Const(1.0)));
        v.push(t(p("self_attn.q_proj.weight"), vec![q, h], normal));
        v.push(t(p("self_attn.k_proj.weight"), vec![kv, h], normal));
        v.push(t(p("self_attn.v_proj.weight"), vec![kv, h], normal));
        if g.arch_name.starts_with("qwen3") {
            v.push(t(p("self_attn.q_norm.weight"), vec![hd], Init::Const(1.0)));
            v.push(t(p("self_attn.k_norm.weight"), vec![hd], Init::Const(1.0)));
        }
        v.push(t(p("self_attn.o_proj.weight"), vec![h, q], normal));
        v.push(t(
            p("post_attention_layernorm.weight"),
            vec![h],
            Init::Const(1.0),
        ));
        let mlp = |base: String, f: usize| {
            [
                t(format!("{base}.gate_proj.weight"), vec![f, h], normal),
                t(format!("{base}.up_proj.weight"), vec![f, h], normal),
                t(format!("{base}.down_proj.weight"), vec![h, f], normal),
            ]
        };
        match &g.moe {
            Some(m) => {
                v.push(t(p("mlp.gate.weight"), vec![m.experts, h], normal));
                for e in 0..m.experts {
                    v.extend(mlp(p(&format!("mlp.experts.{e}")), m.width));
                }
            }
            None => v.extend(mlp(p("mlp"), g.intermediate)),
        }
    }
    v.push(t("model.norm.weight".into(), vec![h], Init::Const(1.0)));
    if !g.tied {
        v.push(t("lm_head.weight".into(), vec![g.vocab, h], normal));
    }
    v
}

pub fn llm_arch(g: &LlmGeometry) -> Arch {
    let mut extra = Map::new();
    extra.insert("attention_bias".into(), false.into());
    extra.insert("hidden_act".into(), "silu".into());
    Arch {
        arch_name: g.arch_name.into(),
        hidden_size: g.hidden,
        intermediate_size: g.intermediate,
        num_layers: g.layers,
        num_attention_heads: g.heads,
        num_kv_heads: g.kv_heads,
        head_dim: g.head_dim,
        vocab_size: g.vocab,
        layer_types: vec![LayerType::FullAttention; g.layers],
        rms_norm_eps: g.rms_norm_eps,
        norm_style: NormStyle::Qwen,
        rope_theta: g.rope_theta,
        tie_word_embeddings: g.tied,
        partial_rotary_factor: 1.0,
        sliding_window: None,
        max_position_embeddings: g.max_position,
        yarn: None,
        moe: g.moe.as_ref().map(|m| Moe {
            num_experts: m.experts,
            top_k: m.top_k,
            moe_intermediate_size: m.width,
            norm_topk_prob: true,
            shared_expert_intermediate_size: None,
            extra: Map::new(),
        }),
        extra,
    }
}

fn llm(args: &SynthArgs, g: &LlmGeometry) -> Result<SynthSpec> {
    let tok = tokenizer::for_vocab(g.vocab, args.tokenizer)?;
    let mut header = Header::new(llm_arch(g), QuantType::Q8Row);
    header.tokenizer_config = Some(TokenizerConfig {
        chat_template: Some(tokenizer::CHATML_TEMPLATE.into()),
        eos_token_ids: tok.eos_token_ids,
        bos_token_id: None,
        pad_token_id: tok.pad_token_id,
        extra: Map::new(),
    });
    Ok(SynthSpec {
        header,
        tokenizer_json: Some(tok.json),
        tensors: llm_tensors(g),
        blobs: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parameter counts of the real models (their model cards / safetensors totals).
    #[test]
    fn geometries_have_the_published_parameter_counts() {
        let count = |g: &LlmGeometry| {
            llm_tensors(g)
                .iter()
                .map(|t| t.shape.iter().product::<usize>())
                .sum::<usize>()
        };
        assert_eq!(count(&SMOLLM2_135M), 134_515_008);
        assert_eq!(count(&QWEN3_0_6B), 596_049_920);
        assert_eq!(count(&QWEN3_8B), 8_190_735_360);
        assert_eq!(count(&LLAMA3_8B), 8_030_261_248);
        // Qwen3-30B-A3B's model card: 30.5B parameters in all.
        let n = count(&QWEN3_30B_A3B);
        assert!((30_450_000_000..30_550_000_000).contains(&n), "{n}");
        let n = count(&QWEN3_MOE_1B);
        assert!((950_000_000..1_050_000_000).contains(&n), "{n}");
    }
}
