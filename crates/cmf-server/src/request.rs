//! Request bodies of `POST /v1/chat/completions` and `POST /v1/completions` → [`GenRequest`].
//!
//! The bytes come from the network, so parsing is defensive and strict:
//! - the body must be one JSON object (serde_json's recursion limit bounds nesting);
//! - every key must be one this server knows; an unknown key is refused by name rather than
//!   silently ignored (OpenAI refuses unknown arguments too);
//! - keys OpenAI defines but this server does not implement (`tools`, `logprobs`, `n` > 1, …) are
//!   accepted only with their neutral value, otherwise refused with the field named;
//! - numbers are range-checked here; what needs the tokenizer (prompt length against the
//!   context, `max_tokens` against what is left of it) is checked in [`crate::prompt`].
//!
//! `null` means "absent" for every optional field, as in OpenAI's API. Nothing here panics on
//! any input (see `tests/request_fuzz.rs`).

use crate::error::ApiError;
use cmf_llm::chat::Message;
use cmf_llm::sampling::SamplingParams;
use serde_json::{Map, Value};

/// Bounds that do not depend on the prompt.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// The context the server runs with: no request may ask for more tokens than this.
    pub ctx: usize,
}

/// Most stop strings in one request, and the longest one (bytes). OpenAI allows 4; a few more
/// cost nothing, but the stop matcher's work grows with count × length.
pub const MAX_STOP_STRINGS: usize = 16;
pub const MAX_STOP_BYTES: usize = 256;

#[derive(Debug, Clone, PartialEq)]
pub enum PromptInput {
    /// Chat messages, rendered with the model's chat template.
    Chat(Vec<Message>),
    /// Raw text, tokenized with the tokenizer's own special tokens (e.g. a BOS).
    Text(String),
    /// Token ids as given (checked against the vocabulary later).
    Tokens(Vec<u32>),
}

/// One generation request, validated except for what needs the tokenizer.
#[derive(Debug, Clone, PartialEq)]
pub struct GenRequest {
    pub prompt: PromptInput,
    pub stream: bool,
    /// `stream_options.include_usage`: also send OpenAI's separate usage chunk.
    pub include_usage: bool,
    /// `max_tokens` / `max_completion_tokens`; `None`: the server default, capped by the context.
    pub max_tokens: Option<usize>,
    /// Sampling with OpenAI's defaults (temperature 1, top_p 1); the seed is filled in by the
    /// server when the request has none.
    pub sampling: SamplingParams,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
}

/// Parses a chat completion request.
pub fn parse_chat(body: &[u8], limits: Limits) -> Result<GenRequest, ApiError> {
    let obj = parse_object(body)?;
    check_keys(&obj, CHAT_KEYS, "")?;
    let f = Fields(&obj);
    let messages = parse_messages(f.get("messages"))?;
    refuse_unless_neutral(&f)?;
    common(&f, PromptInput::Chat(messages), limits)
}

/// Parses a (legacy, raw prompt) completion request.
pub fn parse_completion(body: &[u8], limits: Limits) -> Result<GenRequest, ApiError> {
    let obj = parse_object(body)?;
    check_keys(&obj, COMPLETION_KEYS, "")?;
    let f = Fields(&obj);
    let prompt = parse_prompt(f.get("prompt"))?;
    refuse_unless_neutral(&f)?;
    if f.bool("echo")?.unwrap_or(false) {
        return Err(ApiError::field(
            "echo",
            "echo is not supported (only false)",
        ));
    }
    if f.get("suffix").is_some() {
        return Err(ApiError::field(
            "suffix",
            "suffix (fill-in-the-middle) is not supported",
        ));
    }
    if let Some(b) = f.uint("best_of")? {
        if b != 1 {
            return Err(ApiError::field("best_of", "only best_of = 1 is supported"));
        }
    }
    common(&f, prompt, limits)
}

/// Keys shared by both endpoints.
const COMMON_KEYS: &[&str] = &[
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "n",
    "user",
    "logprobs",
    "logit_bias",
];
const CHAT_ONLY_KEYS: &[&str] = &[
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
];
const COMPLETION_ONLY_KEYS: &[&str] = &["prompt", "echo", "suffix", "best_of"];
const CHAT_KEYS: &[&[&str]] = &[COMMON_KEYS, CHAT_ONLY_KEYS];
const COMPLETION_KEYS: &[&[&str]] = &[COMMON_KEYS, COMPLETION_ONLY_KEYS];

fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    if body.iter().all(|b| b.is_ascii_whitespace()) {
        return Err(
            ApiError::bad_request("the request body is empty: send a JSON object")
                .with_code("invalid_json"),
        );
    }
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(format!("the request body is not valid JSON: {e}"))
            .with_code("invalid_json")
    })?;
    match v {
        Value::Object(m) => Ok(m),
        other => Err(ApiError::bad_request(format!(
            "the request body must be a JSON object, got {}",
            kind(&other)
        ))
        .with_code("invalid_json")),
    }
}

fn check_keys(obj: &Map<String, Value>, known: &[&[&str]], prefix: &str) -> Result<(), ApiError> {
    for k in obj.keys() {
        if !known.iter().any(|set| set.contains(&k.as_str())) {
            return Err(
                ApiError::field(format!("{prefix}{}", printable(k)), "unrecognized field")
                    .with_code("unknown_parameter"),
            );
        }
    }
    Ok(())
}

/// The fields shared by both endpoints: stream, sampling, stop, max_tokens.
fn common(f: &Fields, prompt: PromptInput, limits: Limits) -> Result<GenRequest, ApiError> {
    if let Some(m) = f.get("model") {
        if !m.is_string() {
            return Err(type_err("model", "a string", m));
        }
    }
    if let Some(u) = f.get("user") {
        if !u.is_string() {
            return Err(type_err("user", "a string", u));
        }
    }
    if let Some(n) = f.uint("n")? {
        if n != 1 {
            return Err(ApiError::field(
                "n",
                format!("only n = 1 is supported (got {n}); send one request per choice"),
            ));
        }
    }
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = match f.get("stream_options") {
        None => false,
        Some(Value::Object(o)) => {
            if !stream {
                return Err(ApiError::field(
                    "stream_options",
                    "only allowed when `stream` is true",
                ));
            }
            check_keys(o, &[&["include_usage"]], "stream_options.")?;
            match o.get("include_usage") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(v) => return Err(type_err("stream_options.include_usage", "a boolean", v)),
            }
        }
        Some(v) => return Err(type_err("stream_options", "an object", v)),
    };

    let max_tokens = max_tokens(f, limits)?;
    let d = SamplingParams::default();
    let sampling = SamplingParams {
        temperature: f
            .num("temperature", 0.0, 100.0, "in [0, 100]")?
            .unwrap_or(1.0),
        top_k: match f.uint("top_k")? {
            Some(k) => usize::try_from(k).unwrap_or(usize::MAX),
            None => 0,
        },
        top_p: match f.num("top_p", f64::MIN_POSITIVE, 1.0, "in (0, 1]")? {
            Some(p) if p > 0.0 => p,
            Some(_) => return Err(ApiError::field("top_p", "must be in (0, 1]")),
            None => 1.0,
        },
        min_p: f.num("min_p", 0.0, 1.0, "in [0, 1]")?.unwrap_or(0.0),
        presence_penalty: f
            .num("presence_penalty", -2.0, 2.0, "in [-2, 2]")?
            .unwrap_or(0.0),
        frequency_penalty: f
            .num("frequency_penalty", -2.0, 2.0, "in [-2, 2]")?
            .unwrap_or(0.0),
        repeat_penalty: match f.num("repetition_penalty", f64::MIN_POSITIVE, 10.0, "in (0, 10]")? {
            Some(p) if p > 0.0 => p,
            Some(_) => return Err(ApiError::field("repetition_penalty", "must be in (0, 10]")),
            None => 1.0,
        },
        penalty_last_n: d.penalty_last_n,
        seed: 0,
    };
    // The sampler's own check, so the two can never disagree on what is valid.
    sampling
        .validate()
        .map_err(|e| ApiError::bad_request(format!("sampling parameters: {e}")))?;
    let seed = match f.get("seed") {
        None => None,
        Some(v) => Some(
            v.as_u64()
                .or_else(|| v.as_i64().map(|i| i as u64))
                .ok_or_else(|| type_err("seed", "an integer", v))?,
        ),
    };
    let stop = parse_stop(f.get("stop"))?;
    Ok(GenRequest {
        prompt,
        stream,
        include_usage,
        max_tokens,
        sampling,
        seed,
        stop,
    })
}

fn max_tokens(f: &Fields, limits: Limits) -> Result<Option<usize>, ApiError> {
    let a = f.uint("max_tokens")?;
    let b = f.uint("max_completion_tokens")?;
    let (name, n) = match (a, b) {
        (Some(a), Some(b)) if a != b => {
            return Err(ApiError::field(
                "max_completion_tokens",
                format!("differs from `max_tokens` ({b} vs {a}); send one of them"),
            ))
        }
        (_, Some(b)) => ("max_completion_tokens", b),
        (Some(a), None) => ("max_tokens", a),
        (None, None) => return Ok(None),
    };
    if n == 0 {
        return Err(ApiError::field(name, "must be at least 1"));
    }
    if n > limits.ctx as u64 {
        return Err(ApiError::field(
            name,
            format!(
                "{n} is more than the context of {} tokens this server runs with",
                limits.ctx
            ),
        )
        .with_code("context_length_exceeded"));
    }
    Ok(Some(n as usize))
}

/// Fields OpenAI defines that this server accepts only with their neutral value.
fn refuse_unless_neutral(f: &Fields) -> Result<(), ApiError> {
    if let Some(v) = f.get("logprobs") {
        let neutral = matches!(v, Value::Bool(false));
        if !neutral {
            return Err(ApiError::field(
                "logprobs",
                "log probabilities are not supported",
            ));
        }
    }
    if f.get("top_logprobs").is_some() {
        return Err(ApiError::field(
            "top_logprobs",
            "log probabilities are not supported",
        ));
    }
    if let Some(v) = f.get("logit_bias") {
        match v {
            Value::Object(m) if m.is_empty() => {}
            _ => return Err(ApiError::field("logit_bias", "logit bias is not supported")),
        }
    }
    if let Some(v) = f.get("response_format") {
        let text = v
            .as_object()
            .is_some_and(|o| o.len() == 1 && o.get("type").and_then(Value::as_str) == Some("text"));
        if !text {
            return Err(ApiError::field(
                "response_format",
                "only {\"type\": \"text\"} is supported (no JSON mode or schemas)",
            ));
        }
    }
    if let Some(v) = f.get("tools") {
        if !matches!(v, Value::Array(a) if a.is_empty()) {
            return Err(ApiError::field("tools", "tool calling is not supported"));
        }
    }
    if let Some(v) = f.get("tool_choice") {
        if !matches!(v.as_str(), Some("none" | "auto")) {
            return Err(ApiError::field(
                "tool_choice",
                "tool calling is not supported (only \"none\" or \"auto\" without tools)",
            ));
        }
    }
    if let Some(v) = f.get("parallel_tool_calls") {
        if !v.is_boolean() {
            return Err(type_err("parallel_tool_calls", "a boolean", v));
        }
    }
    Ok(())
}

fn parse_messages(v: Option<&Value>) -> Result<Vec<Message>, ApiError> {
    let arr = match v {
        None => return Err(ApiError::field("messages", "is required")),
        Some(Value::Array(a)) => a,
        Some(v) => return Err(type_err("messages", "an array of messages", v)),
    };
    if arr.is_empty() {
        return Err(ApiError::field(
            "messages",
            "must hold at least one message",
        ));
    }
    let mut out = Vec::with_capacity(arr.len());
    for (i, m) in arr.iter().enumerate() {
        let at = |field: &str| format!("messages[{i}].{field}");
        let Value::Object(o) = m else {
            return Err(type_err(&format!("messages[{i}]"), "an object", m));
        };
        for k in o.keys() {
            match k.as_str() {
                "role" | "content" | "name" => {}
                "tool_calls" | "tool_call_id" | "function_call" => {
                    return Err(ApiError::field(at(k), "tool calling is not supported"))
                }
                _ => {
                    return Err(ApiError::field(at(&printable(k)), "unrecognized field")
                        .with_code("unknown_parameter"))
                }
            }
        }
        let role = match o.get("role") {
            Some(Value::String(r)) => r.as_str(),
            None | Some(Value::Null) => return Err(ApiError::field(at("role"), "is required")),
            Some(v) => return Err(type_err(&at("role"), "a string", v)),
        };
        // OpenAI's newer name for the system role; templates only know `system`.
        let role = match role {
            "developer" => "system",
            "system" | "user" | "assistant" => role,
            "tool" | "function" => {
                return Err(ApiError::field(
                    at("role"),
                    "tool messages are not supported",
                ))
            }
            other => {
                return Err(ApiError::field(
                    at("role"),
                    format!(
                        "unknown role \"{}\" (expected system, user or assistant)",
                        printable(other)
                    ),
                ))
            }
        };
        if let Some(n) = o.get("name") {
            if !n.is_string() && !n.is_null() {
                return Err(type_err(&at("name"), "a string", n));
            }
        }
        let content = match o.get("content") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => text_parts(parts, i)?,
            None | Some(Value::Null) => return Err(ApiError::field(at("content"), "is required")),
            Some(v) => {
                return Err(type_err(
                    &at("content"),
                    "a string or an array of text parts",
                    v,
                ))
            }
        };
        out.push(Message::new(role, content));
    }
    Ok(out)
}

/// `[{"type": "text", "text": "…"}, …]` joined with newlines; other part types are refused.
fn text_parts(parts: &[Value], i: usize) -> Result<String, ApiError> {
    let mut texts = Vec::with_capacity(parts.len());
    for (j, p) in parts.iter().enumerate() {
        let at = format!("messages[{i}].content[{j}]");
        let Value::Object(o) = p else {
            return Err(type_err(&at, "an object", p));
        };
        match o.get("type").and_then(Value::as_str) {
            Some("text") => {}
            Some(t) => {
                return Err(ApiError::field(
                    format!("{at}.type"),
                    format!(
                        "content part type \"{}\" is not supported (only text)",
                        printable(t)
                    ),
                ))
            }
            None => {
                return Err(ApiError::field(
                    format!("{at}.type"),
                    "is required (\"text\")",
                ))
            }
        }
        check_keys(o, &[&["type", "text"]], &format!("{at}."))?;
        match o.get("text") {
            Some(Value::String(s)) => texts.push(s.as_str()),
            Some(v) => return Err(type_err(&format!("{at}.text"), "a string", v)),
            None => return Err(ApiError::field(format!("{at}.text"), "is required")),
        }
    }
    Ok(texts.join("\n"))
}

/// `prompt`: a string, a one-string array, token ids, or a one-element array of token ids.
fn parse_prompt(v: Option<&Value>) -> Result<PromptInput, ApiError> {
    let expected = "a string, an array of one string, or an array of token ids";
    let v = v.ok_or_else(|| ApiError::field("prompt", "is required"))?;
    match v {
        Value::String(s) => Ok(PromptInput::Text(s.clone())),
        Value::Array(a) if a.is_empty() => Err(ApiError::field("prompt", "is empty")),
        Value::Array(a) => {
            if a.len() == 1 {
                match &a[0] {
                    Value::String(s) => return Ok(PromptInput::Text(s.clone())),
                    Value::Array(ids) => return token_ids(ids, "prompt[0]"),
                    _ => {}
                }
            }
            if a.iter().all(Value::is_number) {
                return token_ids(a, "prompt");
            }
            if a.iter().all(|x| x.is_string() || x.is_array()) {
                return Err(ApiError::field(
                    "prompt",
                    "only one prompt per request is supported",
                ));
            }
            Err(type_err("prompt", expected, v))
        }
        other => Err(type_err("prompt", expected, other)),
    }
}

fn token_ids(a: &[Value], name: &str) -> Result<PromptInput, ApiError> {
    if a.is_empty() {
        return Err(ApiError::field(name, "is empty"));
    }
    let mut ids = Vec::with_capacity(a.len());
    for (i, x) in a.iter().enumerate() {
        match x.as_u64().and_then(|n| u32::try_from(n).ok()) {
            Some(id) => ids.push(id),
            None => return Err(type_err(&format!("{name}[{i}]"), "a token id (u32)", x)),
        }
    }
    Ok(PromptInput::Tokens(ids))
}

fn parse_stop(v: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let list: Vec<&Value> = match v {
        None => return Ok(Vec::new()),
        Some(Value::String(_)) => vec![v.unwrap()],
        Some(Value::Array(a)) => a.iter().collect(),
        Some(v) => return Err(type_err("stop", "a string or an array of strings", v)),
    };
    if list.len() > MAX_STOP_STRINGS {
        return Err(ApiError::field(
            "stop",
            format!(
                "at most {MAX_STOP_STRINGS} stop strings (got {})",
                list.len()
            ),
        ));
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, s) in list.into_iter().enumerate() {
        let name = if v.is_some_and(Value::is_array) {
            format!("stop[{i}]")
        } else {
            "stop".to_string()
        };
        let Value::String(s) = s else {
            return Err(type_err(&name, "a string", s));
        };
        if s.is_empty() {
            return Err(ApiError::field(name, "a stop string must not be empty"));
        }
        if s.len() > MAX_STOP_BYTES {
            return Err(ApiError::field(
                name,
                format!("longer than {MAX_STOP_BYTES} bytes"),
            ));
        }
        out.push(s.clone());
    }
    Ok(out)
}

/// Typed, null-as-absent access to the top-level fields.
struct Fields<'a>(&'a Map<String, Value>);

impl<'a> Fields<'a> {
    fn get(&self, name: &str) -> Option<&'a Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    fn bool(&self, name: &str) -> Result<Option<bool>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(type_err(name, "a boolean", v)),
        }
    }

    /// A non-negative integer (a float such as `5.0` is refused: the API's fields are integers).
    fn uint(&self, name: &str) -> Result<Option<u64>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) => Ok(Some(n)),
                None if v.as_i64().is_some() => Err(ApiError::field(name, "must not be negative")),
                None => Err(type_err(name, "an integer", v)),
            },
        }
    }

    /// A finite number in `[lo, hi]` (as f32; `range` says the range in the message).
    fn num(&self, name: &str, lo: f64, hi: f64, range: &str) -> Result<Option<f32>, ApiError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        let x = v.as_f64().ok_or_else(|| type_err(name, "a number", v))?;
        // `lo` of f64::MIN_POSITIVE marks an open lower bound at 0.
        let ok = x.is_finite() && x >= lo && x <= hi;
        if !ok {
            return Err(ApiError::field(
                name,
                format!("must be {range} (got {})", short(v)),
            ));
        }
        Ok(Some(x as f32))
    }
}

fn type_err(name: &str, expected: &str, got: &Value) -> ApiError {
    ApiError::field(
        name,
        format!("expected {expected}, got {} {}", kind(got), short(got)),
    )
    .with_code("invalid_type")
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A value for an error message, cut to a few dozen characters.
fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() <= 40 {
        s
    } else {
        let head: String = s.chars().take(40).collect();
        format!("{head}…")
    }
}

/// A client-chosen key or value echoed in a message: control characters escaped, length cut.
fn printable(s: &str) -> String {
    let mut out: String = s.chars().take(64).flat_map(char::escape_default).collect();
    if s.chars().count() > 64 {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const L: Limits = Limits { ctx: 256 };

    fn chat(body: &str) -> Result<GenRequest, ApiError> {
        parse_chat(body.as_bytes(), L)
    }

    fn param(r: Result<GenRequest, ApiError>) -> String {
        let e = r.unwrap_err();
        assert_eq!(e.status.as_u16(), 400, "{e}");
        e.param.unwrap_or_default()
    }

    #[test]
    fn minimal_chat_gets_openai_defaults() {
        let r = chat(r#"{"messages":[{"role":"user","content":"hi"}]}"#).unwrap();
        assert_eq!(
            r.prompt,
            PromptInput::Chat(vec![Message::new("user", "hi")])
        );
        assert!(!r.stream && r.max_tokens.is_none() && r.seed.is_none());
        assert_eq!(r.sampling.temperature, 1.0);
        assert_eq!(r.sampling.top_p, 1.0);
    }

    #[test]
    fn every_supported_field_is_read() {
        let r = chat(
            r#"{"model":"x","messages":[{"role":"developer","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},{"role":"user","content":"q","name":"n"}],
            "stream":true,"stream_options":{"include_usage":true},"max_completion_tokens":7,"temperature":0.5,"top_p":0.9,
            "top_k":40,"min_p":0.05,"presence_penalty":0.5,"frequency_penalty":-0.5,"repetition_penalty":1.1,"seed":-1,
            "stop":["x","yy"],"n":1,"user":"u","logprobs":false,"logit_bias":{},"response_format":{"type":"text"},"tools":[],"tool_choice":"none"}"#,
        )
        .unwrap();
        assert_eq!(
            r.prompt,
            PromptInput::Chat(vec![
                Message::new("system", "a\nb"),
                Message::new("user", "q")
            ])
        );
        assert!(r.stream && r.include_usage);
        assert_eq!(r.max_tokens, Some(7));
        let s = &r.sampling;
        assert_eq!(
            (s.temperature, s.top_p, s.top_k, s.min_p),
            (0.5, 0.9, 40, 0.05)
        );
        assert_eq!(
            (s.presence_penalty, s.frequency_penalty, s.repeat_penalty),
            (0.5, -0.5, 1.1)
        );
        assert_eq!(r.seed, Some(u64::MAX));
        assert_eq!(r.stop, vec!["x".to_string(), "yy".to_string()]);
    }

    #[test]
    fn bad_fields_are_named() {
        let m = r#""messages":[{"role":"user","content":"hi"}]"#;
        for (extra, want) in [
            (r#""temperature":-0.1"#, "temperature"),
            (r#""temperature":"hot""#, "temperature"),
            (r#""top_p":0"#, "top_p"),
            (r#""top_p":1.5"#, "top_p"),
            (r#""min_p":2"#, "min_p"),
            (r#""top_k":-1"#, "top_k"),
            (r#""max_tokens":0"#, "max_tokens"),
            (r#""max_tokens":257"#, "max_tokens"),
            (r#""max_tokens":1.5"#, "max_tokens"),
            (
                r#""max_tokens":3,"max_completion_tokens":4"#,
                "max_completion_tokens",
            ),
            (r#""n":2"#, "n"),
            (r#""stop":[1]"#, "stop[0]"),
            (r#""stop":"""#, "stop"),
            (r#""stream":"yes""#, "stream"),
            (
                r#""stream_options":{"include_usage":true}"#,
                "stream_options",
            ),
            (r#""seed":"x""#, "seed"),
            (r#""presence_penalty":3"#, "presence_penalty"),
            (r#""repetition_penalty":0"#, "repetition_penalty"),
            (r#""logprobs":true"#, "logprobs"),
            (r#""tools":[{"type":"function"}]"#, "tools"),
            (
                r#""response_format":{"type":"json_object"}"#,
                "response_format",
            ),
            (r#""frobnicate":1"#, "frobnicate"),
        ] {
            let body = format!("{{{m},{extra}}}");
            assert_eq!(param(chat(&body)), want, "{body}");
        }
        for (msgs, want) in [
            (r#"[]"#, "messages"),
            (r#""hi""#, "messages"),
            (r#"[{"content":"x"}]"#, "messages[0].role"),
            (
                r#"[{"role":"user","content":"x"},{"role":"wizard","content":"x"}]"#,
                "messages[1].role",
            ),
            (r#"[{"role":"tool","content":"x"}]"#, "messages[0].role"),
            (r#"[{"role":"user"}]"#, "messages[0].content"),
            (r#"[{"role":"user","content":7}]"#, "messages[0].content"),
            (
                r#"[{"role":"user","content":[{"type":"image_url"}]}]"#,
                "messages[0].content[0].type",
            ),
            (
                r#"[{"role":"user","content":"x","extra":1}]"#,
                "messages[0].extra",
            ),
            (
                r#"[{"role":"assistant","content":"x","tool_calls":[]}]"#,
                "messages[0].tool_calls",
            ),
        ] {
            let body = format!(r#"{{"messages":{msgs}}}"#);
            assert_eq!(param(chat(&body)), want, "{body}");
        }
        assert_eq!(param(chat("{}")), "messages");
    }

    #[test]
    fn malformed_bodies_are_400_without_param() {
        for body in [
            "",
            "  ",
            "{",
            "[]",
            "null",
            "\"x\"",
            "{\"messages\": [}",
            "\u{0}",
        ] {
            let e = chat(body).unwrap_err();
            assert_eq!(e.status.as_u16(), 400);
            assert_eq!(e.code, Some("invalid_json"), "{body:?}: {e}");
        }
    }

    #[test]
    fn completion_prompt_forms() {
        let p = |b: &str| parse_completion(b.as_bytes(), L).map(|r| r.prompt);
        assert_eq!(
            p(r#"{"prompt":"a"}"#).unwrap(),
            PromptInput::Text("a".into())
        );
        assert_eq!(
            p(r#"{"prompt":["a"]}"#).unwrap(),
            PromptInput::Text("a".into())
        );
        assert_eq!(
            p(r#"{"prompt":[1,2]}"#).unwrap(),
            PromptInput::Tokens(vec![1, 2])
        );
        assert_eq!(
            p(r#"{"prompt":[[3]]}"#).unwrap(),
            PromptInput::Tokens(vec![3])
        );
        for (b, want) in [
            (r#"{"prompt":["a","b"]}"#, "prompt"),
            (r#"{"prompt":[]}"#, "prompt"),
            (r#"{"prompt":[-1]}"#, "prompt[0]"),
            (r#"{"prompt":[4294967296]}"#, "prompt[0]"),
            (r#"{"prompt":{}}"#, "prompt"),
            (r#"{}"#, "prompt"),
            (r#"{"prompt":"a","echo":true}"#, "echo"),
            (r#"{"prompt":"a","best_of":2}"#, "best_of"),
            (r#"{"prompt":"a","messages":[]}"#, "messages"),
        ] {
            assert_eq!(param(parse_completion(b.as_bytes(), L)), want, "{b}");
        }
    }

    #[test]
    fn unknown_key_names_are_escaped_and_cut() {
        let key = format!("\u{1b}[31m{}", "k".repeat(100));
        let body = format!(
            r#"{{"prompt":"a",{}:1}}"#,
            serde_json::to_string(&key).unwrap()
        );
        let e = parse_completion(body.as_bytes(), L).unwrap_err();
        let p = e.param.unwrap();
        assert!(
            p.starts_with("\\u{1b}[31m") && p.ends_with('…') && p.len() < 90,
            "{p}"
        );
    }
}
