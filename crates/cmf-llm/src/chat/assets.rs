//! What a CMF file carries for text I/O: the tokenizer (vocab section), the chat template and
//! special tokens (header `tokenizer_config`), the end-of-sequence ids.

use super::{ChatTemplate, SpecialTokens, Tokenizer};
use crate::error::{LlmError, Result};
use cmf_format::{CmfModel, TokenizerConfig};

/// End-of-turn markers llama.cpp also treats as end of generation when they are special tokens
/// of the vocabulary (`llama-vocab.cpp`: the EOG set is completed by token text), so a file
/// whose header lists only `<|endoftext|>` still stops at the end of an assistant turn.
const END_OF_TURN_TEXTS: [&str; 8] = [
    "<|im_end|>",
    "<|eot_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "</s>",
];

pub struct TextAssets {
    pub tokenizer: Tokenizer,
    pub template: ChatTemplate,
    /// Whether the template came from the file (false: the ChatML fallback).
    pub file_has_template: bool,
    pub eos_ids: Vec<u32>,
    pub bos_id: Option<u32>,
}

impl TextAssets {
    pub fn from_cmf(file: &CmfModel) -> Result<TextAssets> {
        let path = file.path().display().to_string();
        let vocab = file.vocab().ok_or_else(|| {
            LlmError::Tokenizer(format!(
                "{path}: the file has no vocab section (tokenizer.json)"
            ))
        })?;
        let cfg = file.header().tokenizer_config.clone().unwrap_or_default();
        TextAssets::from_parts(&path, vocab, &cfg)
    }

    /// The assets from a `tokenizer.json` and a tokenizer config; errors start with `origin`
    /// (the file they come from). The template is rendered once to prove it stays within its
    /// limits, the tokenizer run once to prove it does not fail (see [`Tokenizer::from_bytes`]).
    pub fn from_parts(origin: &str, vocab: &[u8], cfg: &TokenizerConfig) -> Result<TextAssets> {
        let path = origin;
        let tokenizer = Tokenizer::from_bytes(vocab)
            .map_err(|e| LlmError::Tokenizer(format!("{path}: {e}")))?;
        let text_of = |key: &str, id: Option<u32>| -> Option<String> {
            cfg.extra
                .get(key)
                .and_then(|v| v.as_str().map(str::to_string))
                .or_else(|| id.and_then(|i| tokenizer.id_to_token(i)))
        };
        let special = SpecialTokens {
            bos_token: text_of("bos_token", cfg.bos_token_id),
            eos_token: text_of("eos_token", cfg.eos_token_ids.first().copied()),
            unk_token: text_of("unk_token", None),
            pad_token: text_of("pad_token", cfg.pad_token_id),
        };
        let (template, file_has_template) = match cfg.chat_template.as_deref() {
            Some(src) if !src.trim().is_empty() => {
                let t = ChatTemplate::new(src, special)
                    .map_err(|e| LlmError::Template(format!("{path}: {e}")))?
                    .with_origin(path);
                t.check_limits().map_err(|e| match e {
                    LlmError::TemplateLimit(m) => LlmError::TemplateLimit(format!("{path}: {m}")),
                    other => other,
                })?;
                (t, true)
            }
            _ => (ChatTemplate::chatml(special).with_origin(path), false),
        };
        let eos_ids = end_of_sequence_ids(&tokenizer, &cfg.eos_token_ids);
        Ok(TextAssets {
            tokenizer,
            template,
            file_has_template,
            eos_ids,
            bos_id: cfg.bos_token_id,
        })
    }
}

/// The header's ids plus the vocabulary's end-of-turn special tokens.
pub fn end_of_sequence_ids(tokenizer: &Tokenizer, header_ids: &[u32]) -> Vec<u32> {
    let mut ids = header_ids.to_vec();
    for text in END_OF_TURN_TEXTS {
        if let Some(id) = tokenizer.special_token_id(text) {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
    }
    ids
}
