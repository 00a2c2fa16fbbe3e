//! Hugging Face `config.json` → CMF [`Arch`] for the llama, qwen2, qwen3, mistral, qwen2_moe,
//! qwen3_moe and qwen3_next families (MoE fields: [`super::moe`]; the hybrid fields of
//! qwen3_next: [`super::qwen3_next`]).
//!
//! Defaults and derived fields follow transformers 5.x (`models/<family>/configuration_<family>.py`):
//! - `num_key_value_heads` defaults to `num_attention_heads`; `head_dim` to hidden / heads.
//! - RoPE: the legacy layout (`rope_theta` + `rope_scaling`) and the transformers-5 layout
//!   (`rope_parameters` holding `rope_theta`, `rope_type` and the scaling fields) are both read.
//!   A scaling dict whose type is not `default` is kept verbatim as `arch.rope_scaling` (the
//!   Hugging Face dict; the engine implements the types); `yarn` also fills `arch.yarn`.
//! - Sliding window: Mistral uses `sliding_window` on every layer (absent key = 4096, the
//!   config class default; `null` = none). Qwen2/Qwen3 use it only when `use_sliding_window` is
//!   true, on layers `i >= max_window_layers` unless `layer_types` lists them. Llama has none.

use std::path::Path;

use cmf_format::{limits, Arch, LayerType, NormStyle, Yarn};
use serde_json::{Map, Value};

use super::qwen3_next::{self, Qwen3Next};
use crate::error::{ConvertError, Result};

pub const FAMILIES: &[&str] = &[
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "qwen2_moe",
    "qwen3_moe",
    "qwen3_next",
];

/// Typed access to config fields with errors naming the file and field.
pub(crate) struct Fields<'a> {
    pub file: &'a Path,
    pub obj: &'a Map<String, Value>,
}

impl<'a> Fields<'a> {
    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    fn bad(&self, key: &str, what: &str) -> ConvertError {
        ConvertError::field(
            self.file,
            key,
            format!("expected {what}, found {}", self.obj[key]),
        )
    }

    pub fn usize_opt(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|u| Some(u as usize))
                .ok_or_else(|| self.bad(key, "a non-negative integer")),
        }
    }

    pub fn usize_req(&self, key: &str) -> Result<usize> {
        match self.usize_opt(key)? {
            Some(0) => Err(ConvertError::field(self.file, key, "must be positive")),
            Some(v) => Ok(v),
            None => Err(ConvertError::field(self.file, key, "missing")),
        }
    }

    pub fn f64_opt(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.bad(key, "a number")),
        }
    }

    pub fn bool_opt(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.bad(key, "true or false")),
        }
    }

    pub fn str_opt(&self, key: &str) -> Result<Option<&'a str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.bad(key, "a string")),
        }
    }
}

/// The parsed config: the CMF architecture plus what the converter needs to check tensors.
#[derive(Debug, Clone)]
pub struct HfConfig {
    pub arch: Arch,
    /// q/k/v projections carry biases (qwen2 always; llama/qwen3 with `attention_bias`).
    pub attention_bias: bool,
    pub mlp_bias: bool,
    /// Per layer: routed experts (true) or a dense MLP; empty for dense families.
    pub sparse_layers: Vec<bool>,
    /// `eos_token_id` / `bos_token_id` / `pad_token_id` from config.json (fallbacks for the
    /// tokenizer files).
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    pub pad_token_id: Option<u32>,
    /// The GatedDeltaNet geometry and sparse-layer plan of a qwen3_next checkpoint.
    pub qwen3_next: Option<Qwen3Next>,
}

/// An id or a list of ids (`eos_token_id` may be either).
pub(crate) fn token_ids(file: &Path, key: &str, v: Option<&Value>) -> Result<Vec<u32>> {
    let one = |v: &Value| {
        v.as_u64()
            .and_then(|u| u32::try_from(u).ok())
            .ok_or_else(|| {
                ConvertError::field(file, key, format!("expected a token id, found {v}"))
            })
    };
    match v {
        None | Some(Value::Null) => Ok(vec![]),
        Some(Value::Array(items)) => items.iter().map(one).collect(),
        Some(v) => Ok(vec![one(v)?]),
    }
}

pub fn parse_config(file: &Path, json: &Value) -> Result<HfConfig> {
    let obj = json
        .as_object()
        .ok_or_else(|| ConvertError::field(file, "(top level)", "expected a JSON object"))?;
    let f = Fields { file, obj };
    let model_type = f
        .str_opt("model_type")?
        .ok_or_else(|| ConvertError::field(file, "model_type", "missing"))?;
    if !FAMILIES.contains(&model_type) {
        return Err(ConvertError::unsupported(
            file,
            format!(
                "model_type '{model_type}' is not supported (supported: {})",
                FAMILIES.join(", ")
            ),
        ));
    }
    let hidden = f.usize_req("hidden_size")?;
    let heads = f.usize_req("num_attention_heads")?;
    let kv_heads = f.usize_opt("num_key_value_heads")?.unwrap_or(heads);
    if kv_heads == 0 || heads % kv_heads != 0 {
        return Err(ConvertError::field(
            file,
            "num_key_value_heads",
            format!("{kv_heads} does not divide num_attention_heads = {heads}"),
        ));
    }
    let head_dim = match f.usize_opt("head_dim")? {
        Some(d) if d > 0 => d,
        _ if hidden % heads == 0 => hidden / heads,
        _ => {
            return Err(ConvertError::field(
                file,
                "head_dim",
                format!("missing, and hidden_size {hidden} is not a multiple of num_attention_heads {heads}"),
            ))
        }
    };
    let num_layers = f.usize_req("num_hidden_layers")?;
    // Checked before the per-layer tables below are sized by it.
    limits::check_size("num_hidden_layers", num_layers, limits::MAX_LAYERS)
        .map_err(|(k, m)| ConvertError::field(file, k, m))?;
    let hidden_act = f.str_opt("hidden_act")?.unwrap_or("silu");
    if hidden_act != "silu" {
        return Err(ConvertError::unsupported(
            file,
            format!("hidden_act '{hidden_act}' (only silu is supported)"),
        ));
    }

    let Rope {
        theta: rope_theta,
        scaling: rope_scaling,
        partial_rotary_factor,
    } = rope(&f)?;
    let yarn = match &rope_scaling {
        Some(s) if s.get("rope_type").and_then(Value::as_str) == Some("yarn") => {
            Some(yarn_profile(file, s)?)
        }
        _ => None,
    };

    let mut extra = Map::new();
    let (sliding_window, layer_types, hybrid) = match model_type {
        "qwen3_next" => {
            let (types, q) = qwen3_next::parse(&f, num_layers, &mut extra)?;
            (None, types, Some(q))
        }
        _ => {
            let (window, types) = sliding(&f, model_type, num_layers)?;
            (window, types, None)
        }
    };

    let attention_bias = match model_type {
        "qwen2" => true,
        // Qwen2MoeConfig.qkv_bias (default true).
        "qwen2_moe" => f.bool_opt("qkv_bias")?.unwrap_or(true),
        "mistral" => false,
        _ => f.bool_opt("attention_bias")?.unwrap_or(false),
    };
    let mlp_bias = model_type == "llama" && f.bool_opt("mlp_bias")?.unwrap_or(false);

    if let Some(s) = rope_scaling {
        extra.insert("rope_scaling".into(), Value::Object(s));
    }
    extra.insert("attention_bias".into(), attention_bias.into());
    if mlp_bias {
        extra.insert("mlp_bias".into(), true.into());
    }
    extra.insert("hidden_act".into(), hidden_act.into());
    // Qwen3-Next without experts (`num_experts` 0) has dense MLPs only.
    let has_experts = match model_type {
        "qwen3_next" => f.usize_opt("num_experts")?.unwrap_or(0) > 0,
        _ => model_type.ends_with("_moe"),
    };
    let (moe, sparse_layers) = match has_experts {
        true => {
            let (m, plan) = super::moe::parse(&f, model_type, num_layers)?;
            (Some(m), plan)
        }
        false => (None, vec![false; num_layers]),
    };

    let arch = Arch {
        arch_name: model_type.to_owned(),
        hidden_size: hidden,
        intermediate_size: f.usize_req("intermediate_size")?,
        num_layers,
        num_attention_heads: heads,
        num_kv_heads: kv_heads,
        head_dim,
        vocab_size: f.usize_req("vocab_size")?,
        layer_types,
        rms_norm_eps: f.f64_opt("rms_norm_eps")?.unwrap_or(1e-6),
        // Qwen3-Next's RMSNorms scale by (1 + w).
        norm_style: match hybrid {
            Some(_) => NormStyle::Gemma,
            None => NormStyle::Qwen,
        },
        rope_theta,
        tie_word_embeddings: f.bool_opt("tie_word_embeddings")?.unwrap_or(false),
        partial_rotary_factor,
        sliding_window,
        max_position_embeddings: f.usize_opt("max_position_embeddings")?.unwrap_or(4096),
        yarn,
        moe,
        extra,
    };
    limits::check_arch(&arch).map_err(|(k, m)| {
        // The config.json spelling of the field.
        let k = match k.as_str() {
            "num_layers" => "num_hidden_layers",
            "num_kv_heads" => "num_key_value_heads",
            k => k,
        };
        ConvertError::field(file, k, m)
    })?;
    Ok(HfConfig {
        arch,
        attention_bias,
        mlp_bias,
        sparse_layers,
        eos_token_ids: token_ids(file, "eos_token_id", f.get("eos_token_id"))?,
        bos_token_id: token_ids(file, "bos_token_id", f.get("bos_token_id"))?
            .first()
            .copied(),
        pad_token_id: token_ids(file, "pad_token_id", f.get("pad_token_id"))?
            .first()
            .copied(),
        qwen3_next: hybrid,
    })
}

/// RoPE settings read from either config layout.
struct Rope {
    theta: f64,
    /// The Hugging Face scaling dict, unless its type is `default`.
    scaling: Option<Map<String, Value>>,
    partial_rotary_factor: f32,
}

fn rope(f: &Fields) -> Result<Rope> {
    let params = match f.get("rope_parameters") {
        None => None,
        Some(Value::Object(m)) => Some(m),
        Some(_) => {
            return Err(ConvertError::field(
                f.file,
                "rope_parameters",
                "expected an object",
            ))
        }
    };
    // Per-layer-type parameters (`{"full_attention": {...}}`) are a Gemma-style layout.
    if params
        .is_some_and(|p| p.contains_key("full_attention") || p.contains_key("sliding_attention"))
    {
        return Err(ConvertError::unsupported(
            f.file,
            "per-layer-type rope_parameters are not supported",
        ));
    }
    let theta = match params
        .and_then(|p| p.get("rope_theta"))
        .filter(|v| !v.is_null())
    {
        Some(v) => v.as_f64().ok_or_else(|| {
            ConvertError::field(f.file, "rope_parameters.rope_theta", "expected a number")
        })?,
        None => f.f64_opt("rope_theta")?.unwrap_or(10_000.0),
    };
    if theta.is_nan() || theta <= 0.0 {
        return Err(ConvertError::field(
            f.file,
            "rope_theta",
            format!("must be positive, found {theta}"),
        ));
    }
    let scaling = match (params, f.get("rope_scaling")) {
        (Some(p), _) => Some(p.clone()),
        (None, Some(Value::Object(m))) => Some(m.clone()),
        (None, Some(_)) => {
            return Err(ConvertError::field(
                f.file,
                "rope_scaling",
                "expected an object or null",
            ))
        }
        (None, None) => None,
    };
    let scaling = scaling.and_then(|mut s| {
        // Older configs spell the key `type`.
        if !s.contains_key("rope_type") {
            if let Some(t) = s.get("type").cloned() {
                s.insert("rope_type".into(), t);
            }
        }
        s.remove("rope_theta");
        let ty = s
            .get("rope_type")
            .and_then(Value::as_str)
            .unwrap_or("default");
        (ty != "default").then_some(s)
    });
    if let Some(s) = &scaling {
        let ty = s.get("rope_type").and_then(Value::as_str).unwrap_or("");
        const KNOWN: &[&str] = &["linear", "dynamic", "yarn", "llama3", "longrope"];
        if !KNOWN.contains(&ty) {
            return Err(ConvertError::field(
                f.file,
                "rope_scaling.rope_type",
                format!("unknown RoPE type '{ty}'"),
            ));
        }
    }
    let partial = match params
        .and_then(|p| p.get("partial_rotary_factor"))
        .and_then(Value::as_f64)
    {
        Some(p) => p,
        None => f.f64_opt("partial_rotary_factor")?.unwrap_or(1.0),
    };
    if !(partial > 0.0 && partial <= 1.0) {
        return Err(ConvertError::field(
            f.file,
            "partial_rotary_factor",
            format!("must be in (0, 1], found {partial}"),
        ));
    }
    Ok(Rope {
        theta,
        scaling,
        partial_rotary_factor: partial as f32,
    })
}

fn yarn_profile(file: &Path, s: &Map<String, Value>) -> Result<Yarn> {
    let num = |k: &str| s.get(k).and_then(Value::as_f64);
    let factor = num("factor")
        .ok_or_else(|| ConvertError::field(file, "rope_scaling.factor", "missing for yarn"))?;
    let orig = num("original_max_position_embeddings").ok_or_else(|| {
        ConvertError::field(
            file,
            "rope_scaling.original_max_position_embeddings",
            "missing for yarn",
        )
    })?;
    Ok(Yarn {
        factor: factor as f32,
        original_max_position_embeddings: orig as usize,
        beta_fast: num("beta_fast").unwrap_or(32.0) as f32,
        beta_slow: num("beta_slow").unwrap_or(1.0) as f32,
        attention_factor: num("attention_factor").unwrap_or(1.0) as f32,
        extra: Map::new(),
    })
}

fn sliding(
    f: &Fields,
    model_type: &str,
    num_layers: usize,
) -> Result<(Option<usize>, Vec<LayerType>)> {
    let window = match model_type {
        "mistral" => match f.obj.get("sliding_window") {
            None => Some(4096),
            Some(Value::Null) => None,
            Some(_) => f.usize_opt("sliding_window")?,
        },
        "qwen2" | "qwen3" | "qwen2_moe" | "qwen3_moe"
            if f.bool_opt("use_sliding_window")?.unwrap_or(false) =>
        {
            Some(f.usize_opt("sliding_window")?.unwrap_or(4096))
        }
        _ => None,
    };
    let Some(window) = window else {
        return Ok((None, vec![LayerType::FullAttention; num_layers]));
    };
    if window == 0 {
        return Err(ConvertError::field(
            f.file,
            "sliding_window",
            "must be positive",
        ));
    }
    let types = match (model_type, f.get("layer_types")) {
        ("mistral", _) => vec![LayerType::SlidingAttention; num_layers],
        (_, Some(Value::Array(items))) => {
            if items.len() != num_layers {
                return Err(ConvertError::field(
                    f.file,
                    "layer_types",
                    format!(
                        "has {} entries for num_hidden_layers = {num_layers}",
                        items.len()
                    ),
                ));
            }
            items
                .iter()
                .map(|t| match t.as_str() {
                    Some("full_attention") => Ok(LayerType::FullAttention),
                    Some("sliding_attention") => Ok(LayerType::SlidingAttention),
                    _ => Err(ConvertError::field(
                        f.file,
                        "layer_types",
                        format!("unknown layer type {t}"),
                    )),
                })
                .collect::<Result<_>>()?
        }
        _ => {
            let first_sliding = f.usize_opt("max_window_layers")?.unwrap_or(28);
            (0..num_layers)
                .map(|i| {
                    if i >= first_sliding {
                        LayerType::SlidingAttention
                    } else {
                        LayerType::FullAttention
                    }
                })
                .collect()
        }
    };
    let any_sliding = types.contains(&LayerType::SlidingAttention);
    Ok((any_sliding.then_some(window), types))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<HfConfig> {
        parse_config(Path::new("config.json"), &v)
    }

    fn base(model_type: &str) -> Value {
        json!({"model_type": model_type, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "vocab_size": 100})
    }

    #[test]
    fn defaults() {
        let c = parse(base("llama")).unwrap();
        assert_eq!(
            (c.arch.num_kv_heads, c.arch.head_dim, c.arch.rope_theta),
            (4, 16, 10_000.0)
        );
        assert_eq!(c.arch.sliding_window, None);
        assert!(!c.attention_bias);
        assert!(parse(base("qwen2")).unwrap().attention_bias);
        // Mistral without the key: the config class default 4096 on every layer.
        let m = parse(base("mistral")).unwrap();
        assert_eq!(m.arch.sliding_window, Some(4096));
        assert_eq!(m.arch.layer_types, vec![LayerType::SlidingAttention; 2]);
    }

    #[test]
    fn qwen_sliding_rules() {
        let mut v = base("qwen2");
        v["sliding_window"] = json!(32);
        assert_eq!(
            parse(v.clone()).unwrap().arch.sliding_window,
            None,
            "use_sliding_window is false"
        );
        v["use_sliding_window"] = json!(true);
        v["max_window_layers"] = json!(1);
        let c = parse(v).unwrap();
        assert_eq!(c.arch.sliding_window, Some(32));
        assert_eq!(
            c.arch.layer_types,
            vec![LayerType::FullAttention, LayerType::SlidingAttention]
        );
    }

    #[test]
    fn rope_layouts() {
        let mut v = base("qwen3");
        v["rope_parameters"] = json!({"rope_theta": 1e6, "rope_type": "default"});
        let c = parse(v).unwrap();
        assert_eq!(c.arch.rope_theta, 1e6);
        assert!(!c.arch.extra.contains_key("rope_scaling"));
        let mut v = base("llama");
        v["rope_theta"] = json!(5e5);
        v["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        let c = parse(v).unwrap();
        assert_eq!(c.arch.rope_theta, 5e5);
        assert_eq!(c.arch.extra["rope_scaling"]["factor"], 8.0);
        let mut v = base("qwen3");
        v["rope_scaling"] =
            json!({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768});
        let c = parse(v).unwrap();
        assert_eq!(c.arch.yarn.as_ref().unwrap().factor, 4.0);
        assert_eq!(c.arch.extra["rope_scaling"]["rope_type"], "yarn");
    }

    #[test]
    fn errors_name_the_field() {
        let mut v = base("llama");
        v.as_object_mut().unwrap().remove("hidden_size");
        assert!(parse(v)
            .unwrap_err()
            .to_string()
            .contains("'hidden_size': missing"));
        let e = parse(base("gpt2")).unwrap_err().to_string();
        assert!(e.contains("model_type 'gpt2' is not supported"), "{e}");
        let mut v = base("llama");
        v["num_key_value_heads"] = json!(3);
        assert!(parse(v)
            .unwrap_err()
            .to_string()
            .contains("num_key_value_heads"));
        let mut v = base("llama");
        v["vocab_size"] = json!("many");
        assert!(parse(v)
            .unwrap_err()
            .to_string()
            .contains("'vocab_size': expected a non-negative integer"));
    }
}
