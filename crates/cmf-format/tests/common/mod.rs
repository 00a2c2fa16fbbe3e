//! Shared fixtures for the integration tests.
#![allow(dead_code)]

use cmf_format::{Arch, Dtype, Header, LayerType, QuantType, TokenizerConfig};

pub const CHAT_TEMPLATE: &str =
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}";
pub const TOKENIZER_JSON: &[u8] =
    br#"{"version":"1.0","model":{"type":"BPE","vocab":{"a":0,"b":1},"merges":[]}}"#;

pub fn arch() -> Arch {
    let mut a = Arch {
        arch_name: "llama".into(),
        hidden_size: 64,
        intermediate_size: 128,
        num_layers: 2,
        num_attention_heads: 4,
        num_kv_heads: 2,
        head_dim: 16,
        vocab_size: 96,
        layer_types: vec![LayerType::FullAttention, LayerType::SlidingAttention],
        rms_norm_eps: 1e-5,
        rope_theta: 500_000.0,
        sliding_window: Some(128),
        max_position_embeddings: 2048,
        ..Arch::default()
    };
    a.extra.insert(
        "rope_scaling".into(),
        serde_json::json!({"rope_type": "llama3", "factor": 8.0}),
    );
    a.extra
        .insert("attention_bias".into(), serde_json::json!(false));
    a
}

pub fn header() -> Header {
    let mut h = Header::new(arch(), QuantType::Q8Row);
    h.tokenizer_config = Some(TokenizerConfig {
        chat_template: Some(CHAT_TEMPLATE.into()),
        eos_token_ids: vec![2, 7],
        bos_token_id: Some(1),
        pad_token_id: None,
        ..Default::default()
    });
    h.provenance = Some(serde_json::json!({"tool": "cmf-format tests"}));
    h
}

/// Deterministic pseudo-random values in about [-scale, scale].
pub fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// One tensor per codec that both implementations share, with shapes each codec accepts.
pub fn tensor_set() -> Vec<(String, Dtype, Vec<usize>)> {
    vec![
        ("model.embed_tokens.weight".into(), Dtype::F16, vec![96, 64]),
        ("model.norm.weight".into(), Dtype::F32, vec![64]),
        (
            "model.layers.0.input_layernorm.weight".into(),
            Dtype::Bf16,
            vec![64],
        ),
        (
            "model.layers.0.self_attn.q_proj.weight".into(),
            Dtype::Q8Row,
            vec![64, 64],
        ),
        (
            "model.layers.0.self_attn.k_proj.weight".into(),
            Dtype::Q8_2f,
            vec![32, 64],
        ),
        (
            "model.layers.0.mlp.gate_proj.weight".into(),
            Dtype::Q4Block,
            vec![128, 64],
        ),
        (
            "model.layers.0.mlp.up_proj.weight".into(),
            Dtype::Q4Tiled,
            vec![128, 64],
        ),
        (
            "model.layers.0.mlp.down_proj.weight".into(),
            Dtype::Q4Tp,
            vec![64, 128],
        ),
        (
            "model.layers.1.odd.weight".into(),
            Dtype::Q4Block,
            vec![3, 7],
        ),
        ("lm_head.weight".into(), Dtype::Q4Tp, vec![96, 64]),
    ]
}
