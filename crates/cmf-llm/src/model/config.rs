//! Model geometry and options, read from the CMF header's `arch` object or from a Hugging Face
//! `config.json` (the Z-Image pack stores its text encoder's config as the `te.config_json` blob).
//!
//! Both spellings are accepted for every field (`num_layers` / `num_hidden_layers`,
//! `num_kv_heads` / `num_key_value_heads`, `rope_scaling` / `rope_parameters`, …) so the same
//! parser serves converted files, GGUF imports and embedded HF configs. Unknown fields are
//! ignored; features this runtime does not implement (non-SiLU activations, linear-attention
//! layers outside Qwen3-Next, router variants other than softmax top-k) are refused with the
//! field named. Mixture-of-experts geometry is parsed in [`super::moe::MoeConfig`].

use super::moe::MoeConfig;
use super::rope::{RopeConfig, RopeScaling};
use crate::error::{config_err, LlmError, Result};
use cmf_format::limits;
use cmf_kernels::ops::NormStyle;
use cmf_kernels::GdnGeometry;
use serde_json::{Map, Value};

/// The decoder families this runtime implements. They share one graph; the differences
/// (biases, q/k norm) are chosen by which tensors the file carries, as the CMF spec says, and
/// the MoE families replace some layers' MLP with routed experts. Qwen3-Next adds GatedDeltaNet
/// layers, an output-gated attention and `(1 + w)` norms (and experts with a shared expert).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    /// Qwen2-MoE: softmax top-k experts plus a sigmoid-gated shared expert.
    Qwen2Moe,
    /// Qwen3-MoE: softmax top-k experts.
    Qwen3Moe,
    /// Qwen3-Next: GatedDeltaNet + gated attention, Qwen2-MoE's feed-forward.
    Qwen3Next,
}

impl Family {
    fn from_name(name: &str) -> Option<Family> {
        match name.to_ascii_lowercase().as_str() {
            "llama" | "llamaforcausallm" => Some(Family::Llama),
            "mistral" | "mistralforcausallm" => Some(Family::Mistral),
            "qwen2" | "qwen2forcausallm" => Some(Family::Qwen2),
            "qwen3" | "qwen3forcausallm" => Some(Family::Qwen3),
            "qwen2_moe" | "qwen2moe" | "qwen2moeforcausallm" => Some(Family::Qwen2Moe),
            "qwen3_moe" | "qwen3moe" | "qwen3moeforcausallm" => Some(Family::Qwen3Moe),
            "qwen3_next" | "qwen3next" | "qwen3nextforcausallm" => Some(Family::Qwen3Next),
            _ => None,
        }
    }

    /// Whether the family's layers may carry routed experts.
    pub fn is_moe(self) -> bool {
        matches!(self, Family::Qwen2Moe | Family::Qwen3Moe)
    }
}

#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub family: Family,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub max_position_embeddings: usize,
    pub rope: RopeConfig,
    /// Per layer: the attention window (keys at positions > q − window are visible), or None.
    pub sliding_window: Vec<Option<usize>>,
    /// lm_head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Per layer: what mixes the tokens (attention or a GatedDeltaNet).
    pub mixers: Vec<Mixer>,
    /// How every RMSNorm weight applies: x̂·w, or x̂·(1 + w) (Qwen3-Next's zero-centred norms).
    pub norm_style: NormStyle,
    /// Attention output gate: q_proj emits [query | gate] per head and the attention output is
    /// multiplied by sigmoid(gate) before o_proj (Qwen3-Next).
    pub attn_output_gate: bool,
    /// GatedDeltaNet geometry; present when some layer is a GDN mixer.
    pub gdn: Option<GdnGeometry>,
    /// Routed experts and which layers use them (MoE families only).
    pub moe: Option<MoeConfig>,
}

/// The token mixer of one decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mixer {
    /// Causal softmax attention over the KV cache (full or sliding window).
    Attention,
    /// GatedDeltaNet linear attention with a per-sequence recurrent state (`model::gdn`).
    GatedDeltaNet,
}

impl ModelConfig {
    /// Parses an `arch` object (CMF header) or a `config.json` object (Hugging Face).
    pub fn from_json(v: &Value) -> Result<ModelConfig> {
        let obj = v
            .as_object()
            .ok_or_else(|| config_err("arch", "is not a JSON object"))?;
        let f = Fields(obj);

        let name = f.str_any(&["arch_name", "model_type"])?;
        let family = Family::from_name(&name).ok_or_else(|| {
            LlmError::Unsupported(format!(
                "architecture `{name}` (this runtime implements llama, mistral, qwen2, qwen3, \
                 qwen2_moe, qwen3_moe, qwen3_next)"
            ))
        })?;
        let has_experts = match family {
            Family::Qwen3Next => {
                obj.get("moe").is_some_and(|m| !m.is_null())
                    || f.opt_usize(&["num_experts"])?.unwrap_or(0) > 0
            }
            _ => family.is_moe(),
        };
        if !has_experts {
            f.refuse_present(
                "moe",
                "mixture-of-experts layers need a qwen2_moe / qwen3_moe / qwen3_next arch",
            )?;
        }
        let norm_style = match obj.get("norm_style").and_then(Value::as_str) {
            None if family == Family::Qwen3Next => NormStyle::OnePlus,
            None => NormStyle::Plain,
            Some(s) if s.eq_ignore_ascii_case("qwen") && family != Family::Qwen3Next => {
                NormStyle::Plain
            }
            Some(s) if s.eq_ignore_ascii_case("gemma") && family == Family::Qwen3Next => {
                NormStyle::OnePlus
            }
            Some(s) => {
                return Err(config_err(
                    "norm_style",
                    format!("`{s}` does not match architecture `{name}`"),
                ))
            }
        };
        if let Some(act) = obj.get("hidden_act").and_then(Value::as_str) {
            if act != "silu" {
                return Err(config_err(
                    "hidden_act",
                    format!("`{act}` is not supported (only `silu`)"),
                ));
            }
        }

        let hidden_size = f.usize_any(&["hidden_size"])?;
        let num_heads = f.usize_any(&["num_attention_heads"])?;
        let num_kv_heads = f
            .opt_usize(&["num_kv_heads", "num_key_value_heads"])?
            .unwrap_or(num_heads);
        let head_dim = match f.opt_usize(&["head_dim"])? {
            Some(d) => d,
            None if num_heads > 0 => hidden_size / num_heads,
            None => 0,
        };
        let cfg_num_layers = f.usize_any(&["num_layers", "num_hidden_layers"])?;
        let max_pos = f.opt_usize(&["max_position_embeddings"])?.unwrap_or(4096);

        let intermediate_size = f.usize_any(&["intermediate_size"])?;
        let vocab_size = f.usize_any(&["vocab_size"])?;
        // Every size is checked before anything is allocated by it (the KV cache, the layer
        // tables, the RoPE tables).
        for (field, val, max) in [
            ("hidden_size", hidden_size, limits::MAX_HIDDEN),
            ("num_attention_heads", num_heads, limits::MAX_HEADS),
            ("num_kv_heads", num_kv_heads, limits::MAX_HEADS),
            ("head_dim", head_dim, limits::MAX_HEAD_DIM),
            ("num_layers", cfg_num_layers, limits::MAX_LAYERS),
            (
                "intermediate_size",
                intermediate_size,
                limits::MAX_INTERMEDIATE,
            ),
            ("vocab_size", vocab_size, limits::MAX_VOCAB),
            ("max_position_embeddings", max_pos, limits::MAX_POSITIONS),
        ] {
            limits::check_size(field, val, max).map_err(|(k, m)| config_err(&k, m))?;
        }
        let rms_norm_eps = f.opt_f64(&["rms_norm_eps"])?.unwrap_or(1e-6);
        limits::check_float("rms_norm_eps", rms_norm_eps, 0.0, 1.0)
            .map_err(|(k, m)| config_err(&k, m))?;
        if num_heads % num_kv_heads != 0 {
            return Err(config_err(
                "num_kv_heads",
                format!("{num_kv_heads} does not divide num_attention_heads {num_heads}"),
            ));
        }

        let rope = parse_rope(&f, head_dim, max_pos)?;
        let sliding_window = parse_sliding_window(&f, family, cfg_num_layers)?;
        let mixers = parse_mixers(&f, family, cfg_num_layers)?;
        let gdn = match mixers.contains(&Mixer::GatedDeltaNet) {
            true => Some(parse_gdn(&f)?),
            false => None,
        };
        let moe = match has_experts {
            true => Some(MoeConfig::from_json(obj, family, cfg_num_layers)?),
            false => None,
        };

        Ok(ModelConfig {
            family,
            hidden_size,
            intermediate_size,
            num_layers: cfg_num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size,
            rms_norm_eps: rms_norm_eps as f32,
            max_position_embeddings: max_pos,
            rope,
            sliding_window,
            tie_word_embeddings: f.opt_bool("tie_word_embeddings")?.unwrap_or(false),
            mixers,
            norm_style,
            attn_output_gate: family == Family::Qwen3Next,
            gdn,
            moe,
        })
    }

    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

/// RoPE base, partial rotary fraction and scaling. Sources, in order: the HF 5.x
/// `rope_parameters` dict, the 4.x `rope_scaling` dict, the CMF `yarn` block, top-level
/// `rope_theta` / `partial_rotary_factor`.
fn parse_rope(f: &Fields, head_dim: usize, max_pos: usize) -> Result<RopeConfig> {
    let params =
        f.0.get("rope_parameters")
            .or_else(|| f.0.get("rope_scaling"))
            .filter(|v| !v.is_null());
    let params = match params {
        Some(Value::Object(m)) => Some(Fields(m)),
        Some(_) => return Err(config_err("rope_scaling", "is not an object")),
        None => None,
    };
    let theta = match params
        .as_ref()
        .map(|p| p.opt_f64(&["rope_theta"]))
        .transpose()?
        .flatten()
    {
        Some(t) => t,
        None => f.opt_f64(&["rope_theta"])?.unwrap_or(10000.0),
    };
    limits::check_float("rope_theta", theta, 0.0, 1e12).map_err(|(k, m)| config_err(&k, m))?;
    let partial = match params
        .as_ref()
        .map(|p| p.opt_f64(&["partial_rotary_factor"]))
        .transpose()?
        .flatten()
    {
        Some(p) => p,
        None => f.opt_f64(&["partial_rotary_factor"])?.unwrap_or(1.0),
    };
    if !(partial > 0.0 && partial <= 1.0) {
        return Err(config_err(
            "partial_rotary_factor",
            format!("{partial} is outside (0, 1]"),
        ));
    }
    // transformers: dim = int(head_dim * partial_rotary_factor)
    let rotary_dim = (head_dim as f64 * partial) as usize;
    if rotary_dim == 0 || rotary_dim % 2 == 1 {
        return Err(config_err(
            "partial_rotary_factor",
            format!("gives an odd or empty rotary dim {rotary_dim}"),
        ));
    }

    let mut scaling = RopeScaling::None;
    if let Some(p) = &params {
        let kind = p
            .opt_str(&["rope_type", "type"])?
            .unwrap_or_else(|| "default".into());
        scaling = match kind.as_str() {
            "default" => RopeScaling::None,
            "linear" => RopeScaling::Linear {
                factor: p.f64_any(&["factor"], "rope_scaling.factor")?,
            },
            "dynamic" => RopeScaling::Dynamic {
                factor: p.f64_any(&["factor"], "rope_scaling.factor")?,
                max_position_embeddings: max_pos,
            },
            "llama3" => RopeScaling::Llama3 {
                factor: p.f64_any(&["factor"], "rope_scaling.factor")?,
                low_freq_factor: p.f64_any(&["low_freq_factor"], "rope_scaling.low_freq_factor")?,
                high_freq_factor: p
                    .f64_any(&["high_freq_factor"], "rope_scaling.high_freq_factor")?,
                original_max_position_embeddings: p.f64_any(
                    &["original_max_position_embeddings"],
                    "rope_scaling.original_max_position_embeddings",
                )?,
            },
            "yarn" => yarn_from(p, max_pos)?,
            other => {
                return Err(config_err(
                    "rope_scaling.rope_type",
                    format!("`{other}` is not implemented"),
                ));
            }
        };
    } else if let Some(Value::Object(y)) = f.0.get("yarn") {
        scaling = yarn_from(&Fields(y), max_pos)?;
    }
    Ok(RopeConfig {
        theta,
        rotary_dim,
        scaling,
    })
}

/// transformers `_compute_yarn_parameters`: factor defaults to max_pos / original when absent.
fn yarn_from(p: &Fields, max_pos: usize) -> Result<RopeScaling> {
    let original = p.f64_any(
        &["original_max_position_embeddings"],
        "rope_scaling.original_max_position_embeddings",
    )?;
    let factor = p.opt_f64(&["factor"])?.unwrap_or(max_pos as f64 / original);
    limits::check_float("rope_scaling.factor", factor, 0.0, f64::INFINITY)
        .map_err(|(k, m)| config_err(&k, m))?;
    let get_mscale = |scale: f64, m: f64| {
        if scale <= 1.0 {
            1.0
        } else {
            0.1 * m * scale.ln() + 1.0
        }
    };
    let attention_factor = match p.opt_f64(&["attention_factor"])? {
        Some(a) => a,
        None => match (p.opt_f64(&["mscale"])?, p.opt_f64(&["mscale_all_dim"])?) {
            (Some(m), Some(ma)) if m != 0.0 && ma != 0.0 => {
                get_mscale(factor, m) / get_mscale(factor, ma)
            }
            _ => get_mscale(factor, 1.0),
        },
    };
    // `or 32` / `or 1` in transformers: a zero value also takes the default.
    let nz = |v: Option<f64>, d: f64| v.filter(|x| *x != 0.0).unwrap_or(d);
    Ok(RopeScaling::Yarn {
        factor,
        original_max_position_embeddings: original,
        beta_fast: nz(p.opt_f64(&["beta_fast"])?, 32.0),
        beta_slow: nz(p.opt_f64(&["beta_slow"])?, 1.0),
        attention_factor,
        truncate: p.opt_bool("truncate")?.unwrap_or(true),
    })
}

/// Per layer: attention or GatedDeltaNet, from `layer_types` (`linear_attention` /
/// `LinearAttention` is a GDN mixer, accepted for Qwen3-Next only).
fn parse_mixers(f: &Fields, family: Family, n: usize) -> Result<Vec<Mixer>> {
    let Some(Value::Array(types)) = f.0.get("layer_types") else {
        if family == Family::Qwen3Next {
            return Err(config_err(
                "layer_types",
                "is missing (Qwen3-Next lists each layer's mixer)",
            ));
        }
        return Ok(vec![Mixer::Attention; n]);
    };
    if types.is_empty() {
        return Ok(vec![Mixer::Attention; n]);
    }
    types
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let t = t.as_str().unwrap_or_default();
            match (t.to_ascii_lowercase().replace('_', "").as_str(), family) {
                ("linearattention", Family::Qwen3Next) => Ok(Mixer::GatedDeltaNet),
                ("linearattention", _) => Err(LlmError::Unsupported(format!(
                    "layer {i} has type `{t}`: linear attention is implemented for qwen3_next only"
                ))),
                _ => Ok(Mixer::Attention),
            }
        })
        .collect()
}

/// The `linear_*` fields of a GatedDeltaNet model.
fn parse_gdn(f: &Fields) -> Result<GdnGeometry> {
    let g = GdnGeometry {
        num_k_heads: f.usize_any(&["linear_num_key_heads"])?,
        num_v_heads: f.usize_any(&["linear_num_value_heads"])?,
        k_head_dim: f.usize_any(&["linear_key_head_dim"])?,
        v_head_dim: f.usize_any(&["linear_value_head_dim"])?,
        conv_kernel: f.opt_usize(&["linear_conv_kernel_dim"])?.unwrap_or(4),
    };
    for (field, val, max) in [
        ("linear_num_key_heads", g.num_k_heads, limits::MAX_HEADS),
        ("linear_num_value_heads", g.num_v_heads, limits::MAX_HEADS),
        ("linear_key_head_dim", g.k_head_dim, limits::MAX_HEAD_DIM),
        ("linear_value_head_dim", g.v_head_dim, limits::MAX_HEAD_DIM),
        ("linear_conv_kernel_dim", g.conv_kernel, 64),
    ] {
        limits::check_size(field, val, max).map_err(|(k, m)| config_err(&k, m))?;
    }
    if !g.num_v_heads.is_multiple_of(g.num_k_heads) {
        return Err(config_err(
            "linear_num_value_heads",
            format!(
                "{} is not a multiple of linear_num_key_heads {}",
                g.num_v_heads, g.num_k_heads
            ),
        ));
    }
    Ok(g)
}

/// Which layers use a sliding window. transformers: Mistral applies `sliding_window` to every
/// layer whatever `layer_types` says; Qwen2/Qwen3 only to layers whose `layer_types` entry is `sliding_attention` (the config
/// sets `sliding_window` to null unless `use_sliding_window`). A CMF `layer_types` list
/// (`FullAttention` / `SlidingAttention`) is read the same way.
fn parse_sliding_window(f: &Fields, family: Family, n: usize) -> Result<Vec<Option<usize>>> {
    let window = f.opt_usize(&["sliding_window"])?.filter(|w| *w > 0);
    if family == Family::Mistral {
        // MistralAttention passes `config.sliding_window` to every layer; layer_types is ignored.
        return Ok(vec![window; n]);
    }
    if f.opt_bool("use_sliding_window")? == Some(false) {
        return Ok(vec![None; n]);
    }
    let types = match f.0.get("layer_types") {
        Some(Value::Array(a)) if !a.is_empty() => Some(a),
        _ => None,
    };
    let Some(types) = types else {
        // Qwen2Config.__post_init__: layers from `max_window_layers` on slide when enabled.
        if f.opt_bool("use_sliding_window")? == Some(true) {
            let first = f.opt_usize(&["max_window_layers"])?.unwrap_or(n);
            return Ok((0..n)
                .map(|i| if i >= first { window } else { None })
                .collect());
        }
        return Ok(vec![None; n]);
    };
    if types.len() != n {
        return Err(config_err(
            "layer_types",
            format!("has {} entries for {n} layers", types.len()),
        ));
    }
    types
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let t = t
                .as_str()
                .ok_or_else(|| config_err("layer_types", format!("entry {i} is not a string")))?;
            match t.to_ascii_lowercase().replace('_', "").as_str() {
                // A GDN layer has no window; `parse_mixers` decides whether it is allowed.
                "fullattention" | "linearattention" => Ok(None),
                "slidingattention" => match window {
                    Some(w) => Ok(Some(w)),
                    None => Err(config_err(
                        "sliding_window",
                        format!("layer {i} is sliding but no window is set"),
                    )),
                },
                _ => Err(LlmError::Unsupported(format!(
                    "layer {i} has type `{t}` (only full/sliding attention)"
                ))),
            }
        })
        .collect()
}

/// Typed access to a JSON object, accepting alternative spellings of a field.
pub(super) struct Fields<'a>(pub(super) &'a Map<String, Value>);

impl Fields<'_> {
    fn find<'k>(&self, keys: &[&'k str]) -> Option<(&'k str, &Value)> {
        keys.iter()
            .find_map(|k| self.0.get(*k).filter(|v| !v.is_null()).map(|v| (*k, v)))
    }

    pub(super) fn opt_usize(&self, keys: &[&str]) -> Result<Option<usize>> {
        match self.find(keys) {
            None => Ok(None),
            Some((k, v)) => v
                .as_u64()
                .and_then(|x| usize::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| config_err(k, format!("expected a non-negative integer, got {v}"))),
        }
    }

    pub(super) fn usize_any(&self, keys: &[&str]) -> Result<usize> {
        self.opt_usize(keys)?
            .ok_or_else(|| config_err(keys[0], "is missing"))
    }

    pub(super) fn opt_f64(&self, keys: &[&str]) -> Result<Option<f64>> {
        match self.find(keys) {
            None => Ok(None),
            Some((k, v)) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| config_err(k, format!("expected a number, got {v}"))),
        }
    }

    /// A required RoPE scaling parameter: all of them are positive (factors, frequencies,
    /// context lengths), and a non-positive one gives NaN or infinite frequencies.
    fn f64_any(&self, keys: &[&str], label: &str) -> Result<f64> {
        let v = self
            .opt_f64(keys)?
            .ok_or_else(|| config_err(label, "is missing"))?;
        limits::check_float(label, v, 0.0, f64::INFINITY).map_err(|(k, m)| config_err(&k, m))?;
        Ok(v)
    }

    pub(super) fn opt_str(&self, keys: &[&str]) -> Result<Option<String>> {
        match self.find(keys) {
            None => Ok(None),
            Some((k, v)) => v
                .as_str()
                .map(|s| Some(s.to_string()))
                .ok_or_else(|| config_err(k, "expected a string")),
        }
    }

    fn str_any(&self, keys: &[&str]) -> Result<String> {
        self.opt_str(keys)?
            .ok_or_else(|| config_err(keys[0], "is missing"))
    }

    pub(super) fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.0.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| config_err(key, "expected true or false")),
        }
    }

    pub(super) fn refuse_present(&self, key: &str, why: &str) -> Result<()> {
        match self.0.get(key) {
            None | Some(Value::Null) => Ok(()),
            Some(_) => Err(LlmError::Unsupported(format!("`{key}`: {why}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::moe::Routing;
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({"arch_name": "llama", "hidden_size": 64, "intermediate_size": 128, "num_layers": 2,
               "num_attention_heads": 4, "num_kv_heads": 2, "vocab_size": 100, "rms_norm_eps": 1e-5,
               "max_position_embeddings": 256, "layer_types": ["FullAttention", "FullAttention"]})
    }

    #[test]
    fn cmf_arch_fields() {
        let c = ModelConfig::from_json(&base()).unwrap();
        assert_eq!((c.head_dim, c.num_kv_heads, c.rope.rotary_dim), (16, 2, 16));
        assert_eq!(c.rope.theta, 10000.0);
        assert_eq!(c.sliding_window, vec![None, None]);
    }

    #[test]
    fn hf_spellings_and_rope_parameters() {
        let v = json!({"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 32,
            "vocab_size": 10, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}});
        let c = ModelConfig::from_json(&v).unwrap();
        assert_eq!(c.family, Family::Qwen3);
        assert_eq!(c.rope.theta, 5e5);
        assert!(matches!(c.rope.scaling, RopeScaling::Linear { factor } if factor == 2.0));
    }

    #[test]
    fn refusals_name_the_field() {
        let mut v = base();
        v["arch_name"] = json!("gemma3");
        assert!(ModelConfig::from_json(&v)
            .unwrap_err()
            .to_string()
            .contains("gemma3"));
        let mut v = base();
        v["num_kv_heads"] = json!(3);
        assert!(ModelConfig::from_json(&v)
            .unwrap_err()
            .to_string()
            .contains("num_kv_heads"));
        let mut v = base();
        v.as_object_mut().unwrap().remove("hidden_size");
        assert!(ModelConfig::from_json(&v)
            .unwrap_err()
            .to_string()
            .contains("hidden_size"));
        let mut v = base();
        v["rope_scaling"] = json!({"rope_type": "su"});
        assert!(ModelConfig::from_json(&v)
            .unwrap_err()
            .to_string()
            .contains("rope_type"));
    }

    #[test]
    fn hostile_sizes_and_floats_are_refused_before_use() {
        let refused = |key: &str, val: Value| {
            let mut v = base();
            v[key] = val.clone();
            let e = ModelConfig::from_json(&v).expect_err(key).to_string();
            assert!(e.contains(key), "{key} = {val}: {e}");
        };
        refused("num_layers", json!(1u64 << 40));
        refused("vocab_size", json!(1u64 << 40));
        refused("max_position_embeddings", json!(1u64 << 40));
        refused("rms_norm_eps", json!(-1e-5));
        refused("rms_norm_eps", json!(0.0));
        refused("rope_theta", json!(-10000.0));
        refused("rope_theta", json!(0.0));
        let mut v = base();
        v["rope_scaling"] = json!({"rope_type": "linear", "factor": -2.0});
        let e = ModelConfig::from_json(&v).unwrap_err().to_string();
        assert!(e.contains("rope_scaling.factor"), "{e}");
    }

    fn qwen3_next() -> Value {
        json!({"model_type": "qwen3_next", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "vocab_size": 100, "layer_types": ["linear_attention", "full_attention"],
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
            "linear_value_head_dim": 16, "num_experts": 4, "mlp_only_layers": [0, 1],
            "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48, "partial_rotary_factor": 0.25})
    }

    #[test]
    fn qwen3_next_hybrid_fields_and_refusals() {
        let c = ModelConfig::from_json(&qwen3_next()).unwrap();
        assert_eq!(c.mixers, [Mixer::GatedDeltaNet, Mixer::Attention]);
        assert_eq!(
            c.gdn.unwrap().conv_kernel,
            4,
            "transformers' default kernel"
        );
        assert_eq!(c.norm_style, NormStyle::OnePlus);
        let err = |v: Value| ModelConfig::from_json(&v).unwrap_err().to_string();
        // Layers off mlp_only_layers route to experts, with Qwen2-MoE's shared expert.
        let mut v = qwen3_next();
        v["mlp_only_layers"] = json!([0]);
        let moe = ModelConfig::from_json(&v).unwrap().moe.unwrap();
        assert_eq!(moe.sparse_layers, Some(vec![false, true]));
        assert_eq!(moe.shared_expert_width, Some(48));
        let mut v = qwen3_next();
        v["linear_num_value_heads"] = json!(3);
        assert!(err(v).contains("linear_num_value_heads"));
        let mut v = qwen3_next();
        v.as_object_mut().unwrap().remove("linear_key_head_dim");
        assert!(err(v).contains("linear_key_head_dim"));
        let mut v = qwen3_next();
        v["norm_style"] = json!("qwen");
        assert!(err(v).contains("norm_style"));
        // Linear attention is a Qwen3-Next layer kind only.
        let mut v = qwen3_next();
        v["model_type"] = json!("qwen3");
        assert!(err(v).contains("linear_attention"));
    }

    #[test]
    fn sliding_window_per_family() {
        let mut v = base();
        v["arch_name"] = json!("mistral");
        v["sliding_window"] = json!(8);
        v.as_object_mut().unwrap().remove("layer_types");
        assert_eq!(
            ModelConfig::from_json(&v).unwrap().sliding_window,
            vec![Some(8), Some(8)]
        );
        v["arch_name"] = json!("qwen2");
        v["layer_types"] = json!(["full_attention", "sliding_attention"]);
        assert_eq!(
            ModelConfig::from_json(&v).unwrap().sliding_window,
            vec![None, Some(8)]
        );
        v["use_sliding_window"] = json!(false);
        assert_eq!(
            ModelConfig::from_json(&v).unwrap().sliding_window,
            vec![None, None]
        );
    }

    #[test]
    fn moe_geometry_from_the_cmf_descriptor_or_hf_fields() {
        let mut v = base();
        v["arch_name"] = json!("qwen3_moe");
        v["moe"] = json!({"num_experts": 8, "top_k": 2, "moe_intermediate_size": 32,
                          "norm_topk_prob": true});
        let m = ModelConfig::from_json(&v).unwrap().moe.unwrap();
        assert_eq!((m.num_experts, m.top_k, m.expert_width), (8, 2, 32));
        assert_eq!(
            m.routing,
            Routing::SoftmaxTopK {
                norm_topk_prob: true
            }
        );
        assert_eq!((m.shared_expert_width, m.sparse_layers), (None, None));

        v["moe"]["router_sigmoid"] = json!(true);
        let e = ModelConfig::from_json(&v).unwrap_err().to_string();
        assert!(e.contains("moe.router_sigmoid"), "{e}");
        v["moe"] = json!({"num_experts": 8, "top_k": 9, "moe_intermediate_size": 32});
        let e = ModelConfig::from_json(&v).unwrap_err().to_string();
        assert!(e.contains("num_experts_per_tok"), "{e}");
        v["moe"] = json!({"num_experts": 8, "moe_intermediate_size": 32});
        let e = ModelConfig::from_json(&v).unwrap_err().to_string();
        assert!(e.contains("moe.top_k"), "{e}");

        let mut v = base();
        v["arch_name"] = json!("qwen2_moe");
        v["num_experts"] = json!(4);
        v["num_experts_per_tok"] = json!(2);
        v["moe_intermediate_size"] = json!(16);
        let e = ModelConfig::from_json(&v).unwrap_err().to_string();
        assert!(e.contains("shared_expert_intermediate_size"), "{e}");
        v["shared_expert_intermediate_size"] = json!(24);
        v["mlp_only_layers"] = json!([0]);
        let m = ModelConfig::from_json(&v).unwrap().moe.unwrap();
        assert_eq!(m.shared_expert_width, Some(24));
        assert_eq!(m.sparse_layers, Some(vec![false, true]));

        let mut v = base();
        v["moe"] = json!({"num_experts": 8, "top_k": 2, "moe_intermediate_size": 32});
        let e = ModelConfig::from_json(&v).unwrap_err().to_string();
        assert!(e.contains("`moe`"), "{e}");
    }
}
