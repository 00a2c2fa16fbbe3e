//! From a parsed request to the work the inference worker runs: the prompt's token ids (the
//! model's chat template and tokenizer, as `cmf run` uses them) and the generation config, with
//! the checks that need the token count: the prompt must leave room in the context, and
//! `max_tokens` must fit in what is left (OpenAI's rule: prompt + max_tokens ≤ context).

use crate::error::ApiError;
use crate::generation::JobOptions;
use crate::guidance::Guidance;
use crate::request::{ChatPrompt, GenRequest, PromptInput};
use crate::tools::{ToolChoice, ToolFormat};
use cmf_llm::chat::TextAssets;
use cmf_llm::constraint::Grammar;
use cmf_llm::generate::GenerationConfig;
use cmf_llm::logits::LogitBias;
use cmf_llm::LlmError;
use minijinja::Value as TmplValue;

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

pub struct Prepared {
    pub ids: Vec<u32>,
    pub gen: GenerationConfig,
    pub options: JobOptions,
    /// Parse the answer for tool calls in this format (the request has tools and allows calls).
    pub tool_format: Option<ToolFormat>,
    /// Completions' `echo`: the prompt's text, shown before the answer.
    pub echo_text: Option<String>,
}

/// Renders and tokenizes the prompt and fixes the token budget. `seed` is used when the request
/// has none.
pub fn prepare(
    assets: &TextAssets,
    guidance: &Guidance,
    req: &GenRequest,
    limits: PromptLimits,
    seed: u64,
) -> Result<Prepared, ApiError> {
    let (ids, what) = match &req.prompt {
        PromptInput::Chat(chat) => {
            let text = render_chat(assets, chat)?;
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
    let mut sampling = req.sampling;
    sampling.seed = req.seed.unwrap_or(seed);
    if let Some(&(id, _)) = req
        .logit_bias
        .iter()
        .find(|(id, _)| *id as usize >= limits.vocab_size)
    {
        return Err(ApiError::field(
            format!("logit_bias.{id}"),
            format!(
                "token id {id} is outside the vocabulary (size {})",
                limits.vocab_size
            ),
        ));
    }
    let tools: &[serde_json::Value] = match &req.prompt {
        PromptInput::Chat(c) => &c.tools,
        _ => &[],
    };
    let format = guidance.tool_format;
    let (grammar, param) = match (&req.json_schema, &req.tool_choice) {
        (Some(schema), _) => (Some(Grammar::JsonSchema(schema.clone())), "response_format"),
        (None, ToolChoice::Required) => (
            Some(Grammar::Lark(format.grammar(
                tools,
                None,
                req.parallel_tool_calls,
            ))),
            "tools",
        ),
        (None, ToolChoice::Function(name)) => (
            Some(Grammar::Lark(format.grammar(tools, Some(name), false))),
            "tools",
        ),
        _ => (None, ""),
    };
    let constraint = match grammar {
        Some(g) => Some(guidance.constrain(&g, param)?),
        None => None,
    };
    let echo_text = match (&req.prompt, req.echo) {
        (PromptInput::Text(t), true) => Some(t.clone()),
        (PromptInput::Tokens(ids), true) => Some(
            assets
                .tokenizer
                .decode(ids, false)
                .map_err(|e| ApiError::internal(format!("decoding the prompt failed: {e}")))?,
        ),
        _ => None,
    };
    Ok(Prepared {
        options: JobOptions {
            n: req.n,
            logprobs: req.logprobs,
            prompt_logprobs: if req.echo { req.logprobs } else { None },
            logit_bias: LogitBias(req.logit_bias.clone()),
            constraint,
        },
        tool_format: (!tools.is_empty() && req.tool_choice != ToolChoice::None).then_some(format),
        echo_text,
        ids,
        gen: GenerationConfig {
            max_tokens,
            sampling,
            stop_strings: req.stop.clone(),
            eos_ids: if req.ignore_eos {
                Vec::new()
            } else {
                assets.eos_ids.clone()
            },
        },
    })
}

/// The conversation through the model's template, with the tools and the extra variables. The
/// template may refuse a conversation (e.g. roles that do not alternate) through
/// raise_exception; that is the client's to fix.
fn render_chat(assets: &TextAssets, chat: &ChatPrompt) -> Result<String, ApiError> {
    let messages = TmplValue::from_serialize(&chat.messages);
    let tools = (!chat.tools.is_empty()).then(|| TmplValue::from_serialize(&chat.tools));
    let kwargs: Vec<(String, TmplValue)> = chat
        .kwargs
        .iter()
        .map(|(k, v)| (k.clone(), TmplValue::from_serialize(v)))
        .collect();
    assets
        .template
        .render_with_kwargs(messages, tools, &kwargs, true)
        .map_err(template_error)
}

/// A template's errors are the conversation's (400); the file's path stays on the server.
fn template_error(e: LlmError) -> ApiError {
    match e {
        LlmError::TemplateMemory { limit_mib, .. } => ApiError::field(
            "messages",
            format!(
                "the model's chat template exceeded its memory limit ({limit_mib} MiB) rendering this conversation"
            ),
        ),
        // No render worker could start: the server's fault, not the request's.
        LlmError::Other(msg) => ApiError::internal(msg),
        e => ApiError::field("messages", template_msg(e)),
    }
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
