//! From a parsed request to the work the inference worker runs: the prompt's token ids (the
//! model's chat template and tokenizer, as `cmf run` uses them) and the generation config, with
//! the checks that need the token count: the prompt must leave room in the context, and
//! `max_tokens` must fit in what is left (OpenAI's rule: prompt + max_tokens ≤ context).

use crate::error::ApiError;
use crate::request::{GenRequest, PromptInput};
use cmf_llm::chat::TextAssets;
use cmf_llm::generate::GenerationConfig;
use cmf_llm::LlmError;

/// What a request may use of the model.
#[derive(Debug, Clone, Copy)]
pub struct PromptLimits {
    /// Tokens one request may occupy, prompt and answer together.
    pub ctx: usize,
    /// `max_tokens` when the request gives none (then capped by what the context leaves).
    pub max_tokens_default: usize,
    /// Rows of the model's embedding table: token ids must be below it.
    pub vocab_size: usize,
}

#[derive(Debug, Clone)]
pub struct Prepared {
    pub ids: Vec<u32>,
    pub gen: GenerationConfig,
}

/// Renders and tokenizes the prompt and fixes the token budget. `seed` is used when the request
/// has none.
pub fn prepare(
    assets: &TextAssets,
    req: &GenRequest,
    limits: PromptLimits,
    seed: u64,
) -> Result<Prepared, ApiError> {
    let (ids, what) = match &req.prompt {
        PromptInput::Chat(messages) => {
            // The template may refuse a conversation (e.g. roles that do not alternate) through
            // raise_exception; that is the client's to fix.
            let text = assets
                .template
                .render(messages, true)
                .map_err(|e| ApiError::field("messages", template_msg(e)))?;
            (encode(assets, &text, false)?, "messages")
        }
        PromptInput::Text(text) => (encode(assets, text, true)?, "prompt"),
        PromptInput::Tokens(ids) => {
            if let Some((i, id)) = ids
                .iter()
                .enumerate()
                .find(|(_, &id)| id as usize >= limits.vocab_size)
            {
                return Err(ApiError::field(
                    format!("prompt[{i}]"),
                    format!(
                        "token id {id} is outside the vocabulary (size {})",
                        limits.vocab_size
                    ),
                ));
            }
            (ids.clone(), "prompt")
        }
    };
    if ids.is_empty() {
        return Err(ApiError::field(
            what,
            "the prompt is empty (it has no tokens)",
        ));
    }
    let n = ids.len();
    if n >= limits.ctx {
        return Err(ApiError::field(
            what,
            format!(
                "the prompt is {n} tokens; the context holds {} and at least one token must be left for the answer",
                limits.ctx
            ),
        )
        .with_code("context_length_exceeded"));
    }
    let room = limits.ctx - n;
    let max_tokens = match req.max_tokens {
        Some(m) if m > room => {
            return Err(ApiError::field(
                "max_tokens",
                format!(
                    "the prompt is {n} tokens and {m} more were asked for: {} exceeds the context of {} tokens (at most {room} are left)",
                    n + m,
                    limits.ctx
                ),
            )
            .with_code("context_length_exceeded"))
        }
        Some(m) => m,
        None => limits.max_tokens_default.min(room),
    };
    let mut sampling = req.sampling.clone();
    sampling.seed = req.seed.unwrap_or(seed);
    Ok(Prepared {
        ids,
        gen: GenerationConfig {
            max_tokens,
            sampling,
            stop_strings: req.stop.clone(),
            eos_ids: assets.eos_ids.clone(),
        },
    })
}

fn encode(assets: &TextAssets, text: &str, add_special: bool) -> Result<Vec<u32>, ApiError> {
    assets
        .tokenizer
        .encode(text, add_special)
        .map_err(|e| ApiError::internal(format!("tokenizing the prompt failed: {e}")))
}

fn template_msg(e: LlmError) -> String {
    format!("the model's chat template refused the conversation: {e}")
}
