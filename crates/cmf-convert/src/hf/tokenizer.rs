//! The tokenizer bundle of a Hugging Face directory: `tokenizer.json` (stored verbatim in the
//! CMF vocab section), the chat template and the special token ids.
//!
//! Sources, in the order transformers uses them:
//! - chat template: `chat_template.jinja` if present (transformers ≥ 4.50 saves it there), else
//!   `tokenizer_config.json` `chat_template` (a string, or a list of `{name, template}` of which
//!   `default` is taken);
//! - EOS ids: `generation_config.json` `eos_token_id` (int or list) first — it is what
//!   `generate` stops on — then `config.json`'s, then `tokenizer_config.json` `eos_token`;
//! - BOS / PAD: `tokenizer_config.json` tokens resolved to ids through `tokenizer.json`, else
//!   `generation_config.json` / `config.json` ids.

use std::path::Path;

use cmf_format::TokenizerConfig;
use serde_json::{Map, Value};

use super::config::{token_ids, HfConfig};
use crate::error::{ConvertError, Result};

pub struct HfTokenizer {
    /// `tokenizer.json`, byte for byte.
    pub tokenizer_json: Vec<u8>,
    pub config: TokenizerConfig,
}

fn read_json(path: &Path) -> Result<Option<Value>> {
    match cmf_format::regular::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|cause| ConvertError::Json {
                path: path.into(),
                cause,
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(ConvertError::io(path, e)),
    }
}

/// token text → id via `added_tokens` first, then the model vocab.
fn token_id(tokenizer: &Value, text: &str) -> Option<u32> {
    let added = tokenizer.get("added_tokens").and_then(Value::as_array);
    if let Some(id) = added
        .into_iter()
        .flatten()
        .find(|t| t.get("content").and_then(Value::as_str) == Some(text))
        .and_then(|t| t.get("id")?.as_u64())
    {
        return Some(id as u32);
    }
    tokenizer
        .get("model")?
        .get("vocab")?
        .get(text)?
        .as_u64()
        .map(|id| id as u32)
}

/// A special token in tokenizer_config.json: a string, `{"content": ...}`, or null.
fn special_text<'a>(cfg: &'a Map<String, Value>, key: &str) -> Option<&'a str> {
    match cfg.get(key)? {
        Value::String(s) => Some(s),
        Value::Object(o) => o.get("content")?.as_str(),
        _ => None,
    }
}

pub fn read(dir: &Path, model: &HfConfig) -> Result<HfTokenizer> {
    let tok_path = dir.join("tokenizer.json");
    let tokenizer_json = cmf_format::regular::read(&tok_path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            ConvertError::unsupported(
                &tok_path,
                "missing: a fast tokenizer (tokenizer.json) is required",
            )
        } else {
            ConvertError::io(&tok_path, e)
        }
    })?;
    let tokenizer: Value =
        serde_json::from_slice(&tokenizer_json).map_err(|cause| ConvertError::Json {
            path: tok_path.clone(),
            cause,
        })?;
    if tokenizer.get("model").and_then(|m| m.get("type")).is_none() {
        return Err(ConvertError::field(
            &tok_path,
            "model.type",
            "missing: not a tokenizers tokenizer.json",
        ));
    }

    let cfg_path = dir.join("tokenizer_config.json");
    let cfg_json = read_json(&cfg_path)?.unwrap_or(Value::Object(Map::new()));
    let cfg = cfg_json
        .as_object()
        .ok_or_else(|| ConvertError::field(&cfg_path, "(top level)", "expected an object"))?;
    let resolve = |key: &str| -> Result<Option<u32>> {
        match special_text(cfg, key) {
            None => Ok(None),
            Some(text) => token_id(&tokenizer, text).map(Some).ok_or_else(|| {
                ConvertError::field(
                    &cfg_path,
                    key,
                    format!("token {text:?} is not in tokenizer.json"),
                )
            }),
        }
    };

    let template_file = dir.join("chat_template.jinja");
    let chat_template = match cmf_format::regular::read_to_string(&template_file) {
        Ok(t) => Some(t),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => match cfg.get("chat_template") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template")?.as_str())
                .map(str::to_owned),
            Some(_) => {
                return Err(ConvertError::field(
                    &cfg_path,
                    "chat_template",
                    "expected a string or a list",
                ))
            }
        },
        Err(e) => return Err(ConvertError::io(&template_file, e)),
    };

    let gen_path = dir.join("generation_config.json");
    let gen = read_json(&gen_path)?;
    let gen_ids = |key: &str| token_ids(&gen_path, key, gen.as_ref().and_then(|g| g.get(key)));

    let mut eos = gen_ids("eos_token_id")?;
    eos.extend(&model.eos_token_ids);
    eos.extend(resolve("eos_token")?);
    let mut seen = std::collections::HashSet::new();
    eos.retain(|id| seen.insert(*id));

    let bos = match resolve("bos_token")? {
        Some(b) => Some(b),
        None => gen_ids("bos_token_id")?
            .first()
            .copied()
            .or(model.bos_token_id),
    };
    let pad = match resolve("pad_token")? {
        Some(p) => Some(p),
        None => gen_ids("pad_token_id")?
            .first()
            .copied()
            .or(model.pad_token_id),
    };

    let mut extra = Map::new();
    if let Some(b) = cfg.get("add_bos_token").and_then(Value::as_bool) {
        extra.insert("add_bos_token".into(), b.into());
    }
    if let Some(b) = cfg.get("add_eos_token").and_then(Value::as_bool) {
        extra.insert("add_eos_token".into(), b.into());
    }
    Ok(HfTokenizer {
        tokenizer_json,
        config: TokenizerConfig {
            chat_template,
            eos_token_ids: eos,
            bos_token_id: bos,
            pad_token_id: pad,
            extra,
        },
    })
}
