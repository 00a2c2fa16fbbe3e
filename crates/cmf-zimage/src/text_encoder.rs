//! Prompt → caption features: the Qwen3 chat template, the tokenizer from the pack's vocab
//! section, and the Qwen3 encoder (cmf-llm) up to `hidden_states[-2]`.
//!
//! Reference: `ZImagePipeline._encode_prompt` (diffusers 0.42.1): the prompt becomes
//! `apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
//! enable_thinking=True)`, is tokenized with truncation to `max_sequence_length` (512) tokens, runs
//! through the text encoder with `output_hidden_states=True`, and the real (unpadded) rows of
//! `hidden_states[-2]` are the caption: the raw output of the second-to-last decoder layer, no final
//! norm. Right padding with a causal model does not change the real rows, so we run the unpadded ids.
//!
//! Pack layout (the reference's `imagine-pack`): `te.embed_tokens.weight`, `te.layers.{i}.*` for
//! the layers that are needed only, `te.config_json` with `num_hidden_layers` = layers stored and
//! `final_norm: false`. cmf-llm names tensors `model.*`; [`PackSource`] maps the two.

use crate::tensors::TensorSource;
use crate::ZimageError;
use cmf_llm::{Model, ModelConfig};
use std::sync::{Arc, OnceLock};

/// The Qwen3 template's output for one user message with a generation prompt and thinking on;
/// used when the pack stores no template (packs from the reference CLI store none).
pub fn default_template(prompt: &str) -> String {
    format!("<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n")
}

/// Token ids of one templated prompt.
#[derive(Clone, Debug)]
pub struct PromptTokens {
    pub ids: Vec<u32>,
    /// Tokens before truncation (more than `ids.len()` when the prompt was cut).
    pub full_len: usize,
}

impl PromptTokens {
    pub fn truncated(&self) -> bool {
        self.full_len > self.ids.len()
    }
}

/// Names `te.model.X` (cmf-llm's spelling) as `te.X` (the pack's).
struct PackSource<'a> {
    src: &'a dyn TensorSource,
}

impl<'a> cmf_llm::TensorSource<'a> for PackSource<'a> {
    fn tensor(&self, name: &str) -> Option<cmf_llm::TensorRef<'a>> {
        let name = match name.strip_prefix("te.model.") {
            Some(rest) => format!("te.{rest}"),
            None => name.to_string(),
        };
        let t = self.src.tensor(&name)?;
        Some(cmf_llm::TensorRef {
            dtype: t.dtype,
            shape: t.shape.to_vec(),
            data: t.data,
        })
    }
}

pub struct TextEncoder<'a> {
    model: Model<'a>,
    /// Parsed on first use (or handed over with [`TextEncoder::set_tokenizer`]): parsing the
    /// 11 MB Qwen3 tokenizer.json takes ~0.5 s, which the pipeline overlaps with the upload.
    tokenizer: OnceLock<Arc<tokenizers::Tokenizer>>,
    vocab: &'a [u8],
    template: Option<String>,
    /// `hidden_states[tap]` is the caption (the number of decoder layers to run).
    tap: usize,
    origin: String,
}

impl<'a> TextEncoder<'a> {
    /// `config` is `te.config_json`, `vocab` the tokenizer.json bytes, `template` the Jinja chat
    /// template if the pack has one.
    /// `cached`: the tokenizer parsed by an earlier load of the same pack; without it the
    /// vocab is parsed on first use.
    pub fn load(
        src: &'a dyn TensorSource,
        config: &serde_json::Value,
        vocab: &'a [u8],
        template: Option<String>,
        cached: Option<Arc<tokenizers::Tokenizer>>,
    ) -> Result<TextEncoder<'a>, ZimageError> {
        let origin = src.origin();
        let bad = |field: &str, why: String| ZimageError::Config {
            origin: origin.clone(),
            blob: "te.config_json".into(),
            field: field.into(),
            why,
        };
        let stored = config
            .get("num_hidden_layers")
            .and_then(|v| v.as_u64())
            .ok_or_else(|| bad("num_hidden_layers", "missing or not an integer".into()))?
            as usize;
        // A pack made for Z-Image stores only the layers before the tap and says so; a whole
        // Qwen3 (final norm included) taps one layer before its last.
        let pruned = config.get("final_norm").and_then(|v| v.as_bool()) == Some(false);
        let tap = if pruned {
            stored
        } else {
            stored.saturating_sub(1)
        };
        if tap == 0 {
            return Err(bad(
                "num_hidden_layers",
                format!("{stored} layers leave no hidden_states[-2]"),
            ));
        }
        // cmf-llm binds the final norm only when every layer is bound: describe the source model
        // (tap + 1 layers) and bind the first `tap`.
        let mut cfg_json = config.clone();
        cfg_json["num_hidden_layers"] = serde_json::json!(tap + 1);
        if let Some(obj) = cfg_json.as_object_mut() {
            obj.remove("layer_types");
        }
        let cfg = ModelConfig::from_json(&cfg_json).map_err(|e| bad("(config)", e.to_string()))?;
        let model =
            Model::from_source_layers(&PackSource { src }, cfg, "te.", tap).map_err(|e| {
                ZimageError::Tensor {
                    origin: origin.clone(),
                    name: "te.*".into(),
                    why: e.to_string(),
                }
            })?;
        let tokenizer = OnceLock::new();
        if let Some(t) = cached {
            let _ = tokenizer.set(t);
        }
        Ok(TextEncoder {
            model,
            tokenizer,
            vocab,
            template,
            tap,
            origin,
        })
    }

    /// The parsed tokenizer (parsing the vocab now if nobody has yet).
    pub fn tokenizer(&self) -> Result<Arc<tokenizers::Tokenizer>, ZimageError> {
        if let Some(t) = self.tokenizer.get() {
            return Ok(t.clone());
        }
        let t = Arc::new(parse_tokenizer(self.vocab, &self.origin)?);
        Ok(self.tokenizer.get_or_init(|| t).clone())
    }

    /// Whether the tokenizer is parsed (or was handed over).
    pub fn has_tokenizer(&self) -> bool {
        self.tokenizer.get().is_some()
    }

    /// Hands over a tokenizer parsed elsewhere from the same vocab (ignored if one is set).
    pub fn set_tokenizer(&self, t: Arc<tokenizers::Tokenizer>) {
        let _ = self.tokenizer.set(t);
    }

    /// The vocab bytes (tokenizer.json), to parse on another thread.
    pub fn vocab(&self) -> &'a [u8] {
        self.vocab
    }

    /// Width of the caption features (the encoder's hidden size).
    pub fn hidden_size(&self) -> usize {
        self.model.config.hidden_size
    }

    /// The templated prompt.
    pub fn templated(&self, prompt: &str) -> Result<String, ZimageError> {
        match &self.template {
            None => Ok(default_template(prompt)),
            Some(t) => render_template(t, prompt).map_err(|why| ZimageError::Tokenizer {
                origin: self.origin.clone(),
                why: format!("chat template: {why}"),
            }),
        }
    }

    /// Templated and tokenized, truncated to `max_tokens` as diffusers does (the first tokens are kept).
    pub fn tokenize(&self, prompt: &str, max_tokens: usize) -> Result<PromptTokens, ZimageError> {
        let text = self.templated(prompt)?;
        let enc = self
            .tokenizer()?
            .encode(text, true)
            .map_err(|e| ZimageError::Tokenizer {
                origin: self.origin.clone(),
                why: e.to_string(),
            })?;
        let mut ids = enc.get_ids().to_vec();
        let full_len = ids.len();
        ids.truncate(max_tokens);
        Ok(PromptTokens { ids, full_len })
    }

    /// `hidden_states[-2]` for `ids`: `[ids.len(), hidden]`.
    pub fn encode(&self, ids: &[u32]) -> Result<Vec<f32>, ZimageError> {
        if ids.is_empty() {
            return Err(ZimageError::Tokenizer {
                origin: self.origin.clone(),
                why: "the prompt has no tokens".into(),
            });
        }
        self.model
            .hidden_states(ids, self.tap)
            .map_err(|e| ZimageError::Tokenizer {
                origin: self.origin.clone(),
                why: format!("text encoder: {e}"),
            })
    }
}

impl TextEncoder<'_> {
    /// The encoder's layers resident on `gpu`'s device, or None when it refuses.
    pub fn on_device(
        &self,
        gpu: &cmf_gpu::Gpu,
        max_tokens: usize,
    ) -> Option<cmf_llm::gpu::GpuEncoder> {
        if !gpu.is_active() {
            return None;
        }
        cmf_llm::gpu::GpuEncoder::load(gpu, &self.model, max_tokens)
    }

    /// [`TextEncoder::encode`] on the device, else (on any refusal) on the CPU; says which.
    pub fn encode_with(
        &self,
        dev: &mut Option<cmf_llm::gpu::GpuEncoder>,
        ids: &[u32],
    ) -> Result<(Vec<f32>, bool), ZimageError> {
        if let Some(d) = dev.as_mut() {
            if !ids.is_empty() {
                if let Ok(h) = d.hidden_states(&self.model, ids) {
                    return Ok((h, true));
                }
            }
            *dev = None;
        }
        Ok((self.encode(ids)?, false))
    }
}

/// A tokenizer.json.
pub fn parse_tokenizer(vocab: &[u8], origin: &str) -> Result<tokenizers::Tokenizer, ZimageError> {
    tokenizers::Tokenizer::from_bytes(vocab).map_err(|e| ZimageError::Tokenizer {
        origin: origin.to_string(),
        why: e.to_string(),
    })
}

/// Renders a Hugging Face chat template (Jinja) for one user message with
/// `add_generation_prompt=True, enable_thinking=True`, as `apply_chat_template` does.
pub fn render_template(template: &str, prompt: &str) -> Result<String, String> {
    let mut env = minijinja::Environment::new();
    // Hugging Face renders with trim_blocks and lstrip_blocks, and Python string methods.
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_template("chat", template)
        .map_err(|e| e.to_string())?;
    let ctx = minijinja::context! {
        messages => vec![minijinja::context! { role => "user", content => prompt }],
        add_generation_prompt => true,
        enable_thinking => true,
    };
    env.get_template("chat")
        .and_then(|t| t.render(ctx))
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minimal_template_renders_like_the_default() {
        let t = "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";
        assert_eq!(
            render_template(t, "a fox").unwrap(),
            default_template("a fox")
        );
    }
}
