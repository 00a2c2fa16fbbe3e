//! Response bodies in OpenAI's shapes: `chat.completion`, `chat.completion.chunk`,
//! `text_completion` (whole and streamed), `list` of `model`s, the usage block, and the two
//! `logprobs` shapes (chat's `content` entries, completions' parallel arrays).
//!
//! A stream is a sequence of server-sent events `data: <json>\n\n` ended by `data: [DONE]\n\n`.
//! Chat streams open with a chunk per choice whose delta carries the role, then content (or
//! `tool_calls`) deltas, then a chunk per choice with an empty delta and the `finish_reason`.
//! Usage is sent once: in OpenAI's extra chunk with no choices when
//! `stream_options.include_usage` is set, otherwise on the last finish chunk.

use crate::tools::{Delta, ToolCall};
use cmf_llm::chat::Tokenizer;
use cmf_llm::generate::{FinishReason, GenerationStats};
use cmf_llm::logits::TokenLogprob;
use serde::Serialize;
use serde_json::{json, Map, Value};

/// Which endpoint a response belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completion,
}

/// The identity of one response: shared by all chunks of a stream.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub endpoint: Endpoint,
}

#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

impl Usage {
    pub fn from_stats(s: &GenerationStats) -> Usage {
        Usage {
            prompt_tokens: s.prompt_tokens,
            completion_tokens: s.generated_tokens,
            total_tokens: s.prompt_tokens + s.generated_tokens,
        }
    }
}

/// OpenAI's `finish_reason`: `stop` for an end-of-sequence token or a stop string, `length` for
/// the token budget or a full context, `tool_calls` when a finished answer called tools.
pub fn finish_reason(f: FinishReason, called_tools: bool) -> &'static str {
    match f {
        FinishReason::Eos | FinishReason::Stop if called_tools => "tool_calls",
        FinishReason::Eos | FinishReason::Stop => "stop",
        FinishReason::Length | FinishReason::ContextFull => "length",
        // Never sent: a cancelled request has no client left to read it.
        FinishReason::Cancelled => "cancelled",
    }
}

/// One finished choice of a whole (non-streamed) answer.
#[derive(Debug, Default)]
pub struct ChoiceOut {
    pub content: String,
    pub tool_calls: Vec<ToolCall>,
    pub logprobs: Option<Value>,
    pub finish: Option<&'static str>,
}

impl ResponseMeta {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Completion, _) => "text_completion",
        }
    }

    fn envelope(&self, chunk: bool, choices: Value) -> Map<String, Value> {
        let mut m = Map::new();
        m.insert("id".into(), json!(self.id));
        m.insert("object".into(), json!(self.object(chunk)));
        m.insert("created".into(), json!(self.created));
        m.insert("model".into(), json!(self.model));
        m.insert("system_fingerprint".into(), Value::Null);
        m.insert("choices".into(), choices);
        m
    }

    /// The whole (non-streamed) response.
    pub fn complete(&self, choices: &[ChoiceOut], stats: &GenerationStats) -> Value {
        let choices: Vec<Value> = choices
            .iter()
            .enumerate()
            .map(|(i, c)| match self.endpoint {
                Endpoint::Chat => {
                    let mut msg =
                        json!({"role": "assistant", "content": c.content, "refusal": null});
                    if !c.tool_calls.is_empty() {
                        msg["tool_calls"] = c.tool_calls.iter().map(ToolCall::to_json).collect();
                        if c.content.trim().is_empty() {
                            msg["content"] = Value::Null;
                        }
                    }
                    json!({"index": i, "message": msg, "logprobs": c.logprobs,
                           "finish_reason": c.finish})
                }
                Endpoint::Completion => json!({"index": i, "text": c.content,
                    "logprobs": c.logprobs, "finish_reason": c.finish}),
            })
            .collect();
        let mut m = self.envelope(false, Value::Array(choices));
        m.insert("usage".into(), json!(Usage::from_stats(stats)));
        Value::Object(m)
    }

    /// The opening chunk of choice `index` of a chat stream (the role); `None` for completions.
    pub fn first_chunk(&self, index: usize) -> Option<Value> {
        match self.endpoint {
            Endpoint::Chat => Some(Value::Object(self.envelope(
                true,
                json!([{"index": index, "delta": {"role": "assistant", "content": ""},
                        "logprobs": null, "finish_reason": null}]),
            ))),
            Endpoint::Completion => None,
        }
    }

    /// A chunk carrying a piece of choice `index`'s answer (text or a tool-call delta).
    pub fn delta_chunk(&self, index: usize, delta: &Delta, logprobs: Option<Value>) -> Value {
        let choice = match (self.endpoint, delta) {
            (Endpoint::Completion, Delta::Content(t)) => {
                json!({"index": index, "text": t, "logprobs": logprobs, "finish_reason": null})
            }
            (_, d) => json!({"index": index, "delta": delta_json(d), "logprobs": logprobs,
                             "finish_reason": null}),
        };
        Value::Object(self.envelope(true, json!([choice])))
    }

    /// The finish chunk of choice `index`: empty delta / text, the finish reason, and the usage
    /// when it is the stream's last and no usage chunk follows.
    pub fn finish_chunk(
        &self,
        index: usize,
        finish: &str,
        logprobs: Option<Value>,
        usage: Option<&GenerationStats>,
    ) -> Value {
        let choice = match self.endpoint {
            Endpoint::Chat => json!({"index": index, "delta": {}, "logprobs": logprobs,
                                     "finish_reason": finish}),
            Endpoint::Completion => json!({"index": index, "text": "", "logprobs": logprobs,
                                           "finish_reason": finish}),
        };
        let mut m = self.envelope(true, json!([choice]));
        if let Some(s) = usage {
            m.insert("usage".into(), json!(Usage::from_stats(s)));
        }
        Value::Object(m)
    }

    /// OpenAI's `stream_options.include_usage` chunk: no choices, only the usage.
    pub fn usage_chunk(&self, stats: &GenerationStats) -> Value {
        let mut m = self.envelope(true, json!([]));
        m.insert("usage".into(), json!(Usage::from_stats(stats)));
        Value::Object(m)
    }
}

fn delta_json(d: &Delta) -> Value {
    match d {
        Delta::Content(t) => json!({"content": t}),
        Delta::CallStart { index, id, name } => json!({"tool_calls": [{
            "index": index, "id": id, "type": "function",
            "function": {"name": name, "arguments": ""}}]}),
        Delta::CallArgs { index, text } => {
            json!({"tool_calls": [{"index": index, "function": {"arguments": text}}]})
        }
    }
}

/// Token text for log-probability entries: the token decoded alone, and its UTF-8 bytes.
fn token_text(tok: &Tokenizer, id: u32) -> String {
    tok.decode(&[id], false).unwrap_or_default()
}

/// Chat's `logprobs`: `{"content": [{"token", "logprob", "bytes", "top_logprobs"}], "refusal"}`.
pub fn chat_logprobs(tok: &Tokenizer, entries: &[TokenLogprob]) -> Value {
    let one = |id: u32, lp: f32| {
        let t = token_text(tok, id);
        json!({"token": t, "logprob": lp, "bytes": t.as_bytes()})
    };
    let content: Vec<Value> = entries
        .iter()
        .map(|e| {
            let mut v = one(e.id, e.logprob);
            v["top_logprobs"] = e.top.iter().map(|&(i, l)| one(i, l)).collect();
            v
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// Completions' `logprobs`: parallel arrays `tokens`, `token_logprobs`, `top_logprobs` (a
/// token → log-probability object per position) and `text_offset` (bytes into the returned
/// text, from `offset`). Entries without a log-probability (the prompt's first token under
/// `echo`) are `(id, None)`.
pub fn completion_logprobs(
    tok: &Tokenizer,
    entries: &[(u32, Option<&TokenLogprob>)],
    mut offset: usize,
) -> Value {
    let (mut tokens, mut lps, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
    for (id, e) in entries {
        let t = token_text(tok, *id);
        offsets.push(json!(offset));
        offset += t.len();
        tokens.push(json!(t));
        match e {
            Some(e) => {
                lps.push(json!(e.logprob));
                let m: Map<String, Value> = e
                    .top
                    .iter()
                    .map(|&(i, l)| (token_text(tok, i), json!(l)))
                    .collect();
                tops.push(Value::Object(m));
            }
            None => {
                lps.push(Value::Null);
                tops.push(Value::Null);
            }
        }
    }
    json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
}

/// One server-sent event carrying `payload`.
pub fn sse_event(payload: &Value) -> String {
    format!("data: {payload}\n\n")
}

/// The event that ends every stream.
pub const SSE_DONE: &str = "data: [DONE]\n\n";

/// `GET /v1/models`'s single entry.
pub fn model_object(id: &str, created: u64) -> Value {
    json!({"id": id, "object": "model", "created": created, "owned_by": "cmf"})
}
