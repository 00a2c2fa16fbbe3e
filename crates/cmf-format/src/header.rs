//! The header JSON (spec §2): architecture, tokenizer/chat bundle, provenance, shard
//! coordinates and section hashes.
//!
//! Field names and required fields follow `cortiq_core::format::CmfHeader` and
//! `cortiq_core::types::ModelArch` (0.8.54), so a header we write opens there. Every type
//! keeps the fields it does not model in a flattened `extra` map: they survive a read/write
//! round trip, and converters can carry e.g. `rope_scaling` (the Hugging Face dict) or
//! `attention_bias` without a change here. The reference reader ignores unknown fields.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Top-level header object.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Header {
    /// Always `"cmf"`.
    #[serde(default = "default_format")]
    pub format: String,
    /// Always 2 for files this crate writes.
    pub version: u32,
    pub arch: Arch,
    /// File-wide default codec, informational only: the directory's per-tensor dtype is the
    /// truth. Required by the reference reader, which knows only these values.
    pub quant_type: QuantType,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer_config: Option<TokenizerConfig>,
    /// Free-form: source model, converter, options.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provenance: Option<Value>,
    /// `Some` in every file of a shard set (spec §10).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<ShardInfo>,
    /// hex hash64 of the optional sections (masks / vocab / index); set by the writer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub section_hashes: Option<SectionHashes>,
    /// Fields this crate does not model (skills, calibration, ...), kept verbatim.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

fn default_format() -> String {
    "cmf".into()
}

impl Header {
    /// A version-2 header with no tokenizer bundle, provenance or extras.
    pub fn new(arch: Arch, quant_type: QuantType) -> Header {
        Header {
            format: default_format(),
            version: 2,
            arch,
            quant_type,
            tokenizer_config: None,
            provenance: None,
            shard: None,
            section_hashes: None,
            extra: Map::new(),
        }
    }

    /// What the writer refuses to put in a file: things that would make the reference reader
    /// refuse it or an engine misread it. Returns the offending field and why.
    pub fn check_writable(&self) -> Result<(), (String, String)> {
        // What we write must read back: catches e.g. an `extra` key that duplicates a typed
        // field (serialized twice, refused as a duplicate field on reading).
        let json = serde_json::to_vec(self).map_err(|e| ("header".to_string(), e.to_string()))?;
        if let Err(e) = serde_json::from_slice::<Header>(&json) {
            return Err(("header".into(), format!("does not read back: {e}")));
        }
        if self.format != "cmf" {
            return Err((
                "format".into(),
                format!("must be \"cmf\", is {:?}", self.format),
            ));
        }
        if self.version != 2 {
            return Err(("version".into(), format!("must be 2, is {}", self.version)));
        }
        let a = &self.arch;
        if a.layer_types.len() != a.num_layers {
            return Err((
                "arch.layer_types".into(),
                format!(
                    "has {} entries but arch.num_layers is {}",
                    a.layer_types.len(),
                    a.num_layers
                ),
            ));
        }
        // The reference reader validates these records and refuses a file that carries one
        // without the feature bit it implies; this crate writes neither.
        for key in [
            "anchor_core",
            "block_diffusion",
            "prism_hadamard",
            "linear_core",
        ] {
            if a.extra.get(key).is_some_and(|v| !v.is_null()) {
                return Err((
                    format!("arch.{key}"),
                    "is not supported by this writer".into(),
                ));
            }
        }
        if a.layer_types.contains(&LayerType::BoundedAttention) {
            return Err((
                "arch.layer_types".into(),
                "BoundedAttention needs arch.anchor_core, not supported".into(),
            ));
        }
        if a.arch_name.starts_with("cortiq-decision-") {
            return Err((
                "arch.arch_name".into(),
                "decision profiles need the DECISION feature bit".into(),
            ));
        }
        for key in ["genome", "skills", "router", "lineage", "segments"] {
            if self
                .extra
                .get(key)
                .is_some_and(|v| !v.is_null() && v.as_array().is_none_or(|a| !a.is_empty()))
            {
                return Err((
                    key.into(),
                    "skill/genome records are not supported by this writer".into(),
                ));
            }
        }
        Ok(())
    }
}

/// `quant_type` values the reference reader accepts (`cortiq_core::types::QuantType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum QuantType {
    #[serde(rename = "Q8_ROW")]
    Q8Row,
    #[serde(rename = "Q4_BLOCK")]
    Q4Block,
    #[serde(rename = "Q8_2F")]
    Q8_2f,
    #[serde(rename = "VBIT")]
    Vbit,
    BF16,
    F16,
    F32,
}

/// RMS-norm weight semantics: `qwen` (Llama, Qwen, Mistral) applies `x̂·w`, `gemma` `x̂·(1+w)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NormStyle {
    #[default]
    Qwen,
    Gemma,
}

/// Per-layer operator tags, spelled as `cortiq_core::types::LayerType` serializes them. An
/// unknown tag is a header error in both readers: a newer operator must not be run as an older
/// one. The reference opens a file whatever the tags are (it checks `layer_types.len() ==
/// num_layers` only for linear-core/anchor files); our writer always checks the length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LayerType {
    /// Standard (GQA) causal attention over the whole context.
    FullAttention,
    /// Causal attention restricted to `arch.sliding_window`.
    SlidingAttention,
    LinearAttention,
    ShortConv,
    Kda,
    /// Bounded anchor attention; requires `arch.anchor_core` and a feature bit.
    BoundedAttention,
}

/// Model architecture (`cortiq_core::types::ModelArch` field names). Fields without a serde
/// default are required by the reference reader.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Arch {
    /// e.g. `llama`, `qwen2`, `qwen3`, `mistral`, `z-image`.
    pub arch_name: String,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_attention_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    /// One tag per layer.
    pub layer_types: Vec<LayerType>,
    pub rms_norm_eps: f64,
    #[serde(default)]
    pub norm_style: NormStyle,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Fraction of `head_dim` that RoPE rotates.
    #[serde(default = "default_one")]
    pub partial_rotary_factor: f32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<usize>,
    pub max_position_embeddings: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub yarn: Option<Yarn>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<Moe>,
    /// Everything else (`rope_scaling`, `attention_bias`, `hidden_act`, `linear_*`, ...).
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

fn default_rope_theta() -> f64 {
    10_000.0
}

fn default_one() -> f32 {
    1.0
}

impl Default for Arch {
    /// Serde's defaults for the optional fields; zeros and empties for the required ones.
    fn default() -> Arch {
        Arch {
            arch_name: String::new(),
            hidden_size: 0,
            intermediate_size: 0,
            num_layers: 0,
            num_attention_heads: 0,
            num_kv_heads: 0,
            head_dim: 0,
            vocab_size: 0,
            layer_types: Vec::new(),
            rms_norm_eps: 1e-6,
            norm_style: NormStyle::Qwen,
            rope_theta: default_rope_theta(),
            tie_word_embeddings: false,
            partial_rotary_factor: 1.0,
            sliding_window: None,
            max_position_embeddings: 0,
            yarn: None,
            moe: None,
            extra: Map::new(),
        }
    }
}

/// Global YaRN RoPE profile (`cortiq_core::types::YarnConfig`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Yarn {
    pub factor: f32,
    pub original_max_position_embeddings: usize,
    #[serde(default = "default_beta_fast")]
    pub beta_fast: f32,
    #[serde(default = "default_one")]
    pub beta_slow: f32,
    #[serde(default = "default_one")]
    pub attention_factor: f32,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

fn default_beta_fast() -> f32 {
    32.0
}

/// Mixture-of-experts FFN descriptor (`cortiq_core::types::MoeConfig`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Moe {
    pub num_experts: usize,
    pub top_k: usize,
    pub moe_intermediate_size: usize,
    #[serde(default)]
    pub norm_topk_prob: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared_expert_intermediate_size: Option<usize>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// Chat template and special tokens (spec §6.1, `cortiq_core::format::TokenizerBundle`).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct TokenizerConfig {
    /// Jinja chat template (Hugging Face semantics).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template: Option<String>,
    /// Every id that ends generation.
    #[serde(default)]
    pub eos_token_ids: Vec<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bos_token_id: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pad_token_id: Option<u32>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// Shard coordinates, 1-based: this file is shard `no` of `count`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardInfo {
    pub no: usize,
    pub count: usize,
}

/// hex-encoded hash64 (16 lower-case digits) of the optional sections.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SectionHashes {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub masks: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vocab: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<String>,
}

/// How the writer spells a section hash: 16 lower-case hex digits.
pub fn hash_hex(h: u64) -> String {
    format!("{h:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_fields_survive_a_round_trip() {
        let json = r#"{"format":"cmf","version":2,"quant_type":"Q8_ROW","skills":[],"calibration":{"temperature":1.5},
            "arch":{"arch_name":"llama","hidden_size":64,"intermediate_size":128,"num_layers":2,
            "num_attention_heads":4,"num_kv_heads":2,"head_dim":16,"vocab_size":100,
            "layer_types":["FullAttention","SlidingAttention"],"rms_norm_eps":1e-5,"max_position_embeddings":512,
            "rope_scaling":{"rope_type":"llama3","factor":8.0},"attention_bias":true,"linear_conv_kernel_dim":null},
            "tokenizer_config":{"chat_template":"{{ x }}","eos_token_ids":[2],"add_bos":true}}"#;
        let h: Header = serde_json::from_str(json).unwrap();
        assert_eq!(h.arch.rope_theta, 10_000.0);
        assert_eq!(h.arch.extra["rope_scaling"]["rope_type"], "llama3");
        assert_eq!(h.arch.extra["attention_bias"], true);
        assert_eq!(h.tokenizer_config.as_ref().unwrap().extra["add_bos"], true);
        assert_eq!(h.extra["calibration"]["temperature"], 1.5);
        let again: Header = serde_json::from_str(&serde_json::to_string(&h).unwrap()).unwrap();
        assert_eq!(again, h);
        assert!(h.check_writable().is_ok());
    }

    #[test]
    fn errors_name_the_field() {
        let json = r#"{"version":2,"quant_type":"Q8_ROW","arch":{"arch_name":"x"}}"#;
        let e = serde_json::from_str::<Header>(json)
            .unwrap_err()
            .to_string();
        assert!(e.contains("hidden_size"), "{e}");
        let json = r#"{"version":2,"quant_type":"Q7","arch":{}}"#;
        let e = serde_json::from_str::<Header>(json)
            .unwrap_err()
            .to_string();
        assert!(e.contains("Q7"), "{e}");
    }

    #[test]
    fn writer_checks() {
        let mut h = Header::new(
            Arch {
                num_layers: 2,
                ..Arch::default()
            },
            QuantType::F16,
        );
        assert_eq!(h.check_writable().unwrap_err().0, "arch.layer_types");
        h.arch.layer_types = vec![LayerType::FullAttention; 2];
        assert!(h.check_writable().is_ok());
        h.extra
            .insert("skills".into(), serde_json::json!([{"id": "x"}]));
        assert_eq!(h.check_writable().unwrap_err().0, "skills");
        h.extra.clear();
        h.arch
            .extra
            .insert("hidden_size".into(), serde_json::json!(5));
        let (field, why) = h.check_writable().unwrap_err();
        assert_eq!(field, "header");
        assert!(why.contains("duplicate field"), "{why}");
    }
}
