//! Response bodies in OpenAI's shapes: `chat.completion`, `chat.completion.chunk`,
//! `text_completion` (whole and streamed), `list` of `model`s, and the usage block.
//!
//! A stream is a sequence of server-sent events `data: <json>\n\n` ended by `data: [DONE]\n\n`.
//! Chat streams open with a chunk whose delta carries the role, then content deltas, then a chunk
//! with an empty delta and the `finish_reason`; this server puts `usage` on that last chunk too
//! (OpenAI sends usage only in an extra chunk with no choices when `stream_options.include_usage`
//! is set; that chunk is sent as well when asked).

use cmf_llm::generate::{FinishReason, GenerationStats};
use serde::Serialize;
use serde_json::{json, Value};

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
/// the token budget or a full context.
pub fn finish_reason(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Eos | FinishReason::Stop => "stop",
        FinishReason::Length | FinishReason::ContextFull => "length",
        // Never sent: a cancelled request has no client left to read it.
        FinishReason::Cancelled => "cancelled",
    }
}

impl ResponseMeta {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Completion, _) => "text_completion",
        }
    }

    fn envelope(&self, chunk: bool, choices: Value) -> serde_json::Map<String, Value> {
        let mut m = serde_json::Map::new();
        m.insert("id".into(), json!(self.id));
        m.insert("object".into(), json!(self.object(chunk)));
        m.insert("created".into(), json!(self.created));
        m.insert("model".into(), json!(self.model));
        m.insert("system_fingerprint".into(), Value::Null);
        m.insert("choices".into(), choices);
        m
    }

    /// The whole (non-streamed) response.
    pub fn complete(&self, text: &str, stats: &GenerationStats) -> Value {
        let finish = finish_reason(stats.finish);
        let choice = match self.endpoint {
            Endpoint::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": null,
                "finish_reason": finish,
            }),
            Endpoint::Completion => json!({
                "index": 0,
                "text": text,
                "logprobs": null,
                "finish_reason": finish,
            }),
        };
        let mut m = self.envelope(false, json!([choice]));
        m.insert("usage".into(), json!(Usage::from_stats(stats)));
        Value::Object(m)
    }

    /// The opening chunk of a chat stream (the role); `None` for completions, which have none.
    pub fn first_chunk(&self) -> Option<Value> {
        match self.endpoint {
            Endpoint::Chat => Some(Value::Object(self.envelope(
                true,
                json!([{"index": 0, "delta": {"role": "assistant", "content": ""},
                        "logprobs": null, "finish_reason": null}]),
            ))),
            Endpoint::Completion => None,
        }
    }

    /// A chunk carrying a piece of generated text.
    pub fn text_chunk(&self, text: &str) -> Value {
        let choice = match self.endpoint {
            Endpoint::Chat => json!({"index": 0, "delta": {"content": text},
                                     "logprobs": null, "finish_reason": null}),
            Endpoint::Completion => json!({"index": 0, "text": text,
                                           "logprobs": null, "finish_reason": null}),
        };
        Value::Object(self.envelope(true, json!([choice])))
    }

    /// The last chunk with a choice: empty delta / text, the finish reason, and the usage.
    pub fn final_chunk(&self, stats: &GenerationStats) -> Value {
        let finish = finish_reason(stats.finish);
        let choice = match self.endpoint {
            Endpoint::Chat => json!({"index": 0, "delta": {}, "logprobs": null,
                                     "finish_reason": finish}),
            Endpoint::Completion => json!({"index": 0, "text": "", "logprobs": null,
                                           "finish_reason": finish}),
        };
        let mut m = self.envelope(true, json!([choice]));
        m.insert("usage".into(), json!(Usage::from_stats(stats)));
        Value::Object(m)
    }

    /// OpenAI's `stream_options.include_usage` chunk: no choices, only the usage.
    pub fn usage_chunk(&self, stats: &GenerationStats) -> Value {
        let mut m = self.envelope(true, json!([]));
        m.insert("usage".into(), json!(Usage::from_stats(stats)));
        Value::Object(m)
    }
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
