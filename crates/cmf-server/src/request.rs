//! Request bodies of `POST /v1/chat/completions` and `POST /v1/completions` → [`GenRequest`].
//!
//! The bytes come from the network, so parsing is defensive and strict:
//! - the body must be one JSON object (serde_json's recursion limit bounds nesting);
//! - every key must be one this server knows; an unknown key is refused by name rather than
//!   silently ignored (OpenAI refuses unknown arguments too);
//! - keys OpenAI defines that do not apply here (`store`, `metadata`, `service_tier`, …) are
//!   accepted and ignored (docs/server.md lists every field and what this server does with it);
//!   the few it cannot honour (audio output, the deprecated `functions`) are refused by name;
//! - numbers are range-checked here; what needs the tokenizer (prompt length against the
//!   context, `max_tokens` against what is left of it) is checked in [`crate::prompt`].
//!
//! `null` means "absent" for every optional field at every level, as in OpenAI's API (so a
//! history built from `message.model_dump()`, full of nulls, is accepted). Nothing here panics
//! on any input (see `tests/request_fuzz.rs`).

use crate::error::ApiError;
use crate::tools::{parse_tool_choice, parse_tools, ToolChoice};
use cmf_llm::sampling::SamplingParams;
use serde_json::{json, Map, Value};

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
/// Most choices (`n`) and `top_logprobs` / `logprobs` alternatives one request may ask for.
pub const MAX_CHOICES: u64 = 16;
pub const MAX_TOP_LOGPROBS: u64 = 20;
/// Most `logit_bias` entries (OpenAI allows 300; the cost is one add per entry and token).
pub const MAX_LOGIT_BIAS: usize = 1024;

/// A chat conversation as the template sees it: messages as JSON objects (`role`, `content`,
/// and `tool_calls` / `tool_call_id` / `name` where given), the tools, and extra template
/// variables (`chat_template_kwargs`, `reasoning_effort`).
#[derive(Debug, Clone, PartialEq)]
pub struct ChatPrompt {
    pub messages: Vec<Value>,
    /// OpenAI tool objects (`{"type": "function", "function": {…}}`), checked.
    pub tools: Vec<Value>,
    pub kwargs: Vec<(String, Value)>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum PromptInput {
    /// Chat messages, rendered with the model's chat template.
    Chat(ChatPrompt),
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
    /// Choices to generate (`n`) from one computed prompt.
    pub n: usize,
    /// `Some(k)`: report each answer token's log-probability and its `k` best alternatives.
    pub logprobs: Option<usize>,
    /// Completions' `echo`: the answer starts with the prompt (and its log-probabilities).
    pub echo: bool,
    /// `logit_bias` as (token id, bias); ids are checked against the vocabulary later.
    pub logit_bias: Vec<(u32, f32)>,
    /// `ignore_eos` (llama-server's and vLLM's extension, for benchmarks): end-of-sequence ids
    /// do not end the answer; `max_tokens`, stop strings and the context still do.
    pub ignore_eos: bool,
    /// `response_format` `json_object` / `json_schema`: the JSON schema the answer must match.
    pub json_schema: Option<Value>,
    pub tool_choice: ToolChoice,
    pub parallel_tool_calls: bool,
}

/// Parses a chat completion request.
pub fn parse_chat(body: &[u8], limits: Limits) -> Result<GenRequest, ApiError> {
    let obj = parse_object(body)?;
    check_keys(&obj, CHAT_KEYS, "")?;
    let f = Fields(&obj);
    let messages = parse_messages(f.get("messages"))?;
    refuse_inapplicable(&f)?;
    let tools = parse_tools(f.get("tools"))?;
    let tool_choice = parse_tool_choice(f.get("tool_choice"), &tools)?;
    let kwargs = template_kwargs(&f)?;
    let json_schema = parse_response_format(f.get("response_format"))?;
    if json_schema.is_some()
        && matches!(tool_choice, ToolChoice::Required | ToolChoice::Function(_))
    {
        return Err(ApiError::field(
            "response_format",
            "cannot be combined with a tool_choice that forces a tool call",
        ));
    }
    let logprobs = match f.bool("logprobs")? {
        Some(true) => Some(f.uint_max("top_logprobs", MAX_TOP_LOGPROBS)?.unwrap_or(0) as usize),
        _ if f.get("top_logprobs").is_some() => {
            return Err(ApiError::field("top_logprobs", "requires `logprobs: true`"))
        }
        _ => None,
    };
    let parallel_tool_calls = f.bool("parallel_tool_calls")?.unwrap_or(true);
    let prompt = PromptInput::Chat(ChatPrompt {
        messages,
        tools,
        kwargs,
    });
    let mut r = common(&f, prompt, limits)?;
    r.logprobs = logprobs;
    r.json_schema = json_schema;
    r.tool_choice = tool_choice;
    r.parallel_tool_calls = parallel_tool_calls;
    Ok(r)
}

/// Parses a (legacy, raw prompt) completion request.
pub fn parse_completion(body: &[u8], limits: Limits) -> Result<GenRequest, ApiError> {
    let obj = parse_object(body)?;
    check_keys(&obj, COMPLETION_KEYS, "")?;
    let f = Fields(&obj);
    let prompt = parse_prompt(f.get("prompt"))?;
    if f.get("suffix").is_some_and(|v| v.as_str() != Some("")) {
        return Err(ApiError::field(
            "suffix",
            "suffix (fill-in-the-middle) is not supported",
        ));
    }
    let mut r = common(&f, prompt, limits)?;
    if let Some(b) = f.uint("best_of")? {
        if b != 1 && b != r.n as u64 {
            return Err(ApiError::field(
                "best_of",
                format!("only best_of = n ({}) is supported", r.n),
            ));
        }
    }
    r.logprobs = f
        .uint_max("logprobs", MAX_TOP_LOGPROBS)?
        .map(|k| k as usize);
    r.echo = f.bool("echo")?.unwrap_or(false);
    if r.echo && r.stream && r.logprobs.is_some() {
        // The prompt's log-probabilities would have no chunk to travel in.
        return Err(ApiError::field(
            "echo",
            "echo with logprobs is not supported when streaming",
        ));
    }
    Ok(r)
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
    "ignore_eos",
];
const CHAT_ONLY_KEYS: &[&str] = &[
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "reasoning_effort",
    "chat_template_kwargs",
    "functions",
    "function_call",
    "audio",
    "modalities",
    "metadata",
    "store",
    "service_tier",
    "prediction",
    "verbosity",
    "prompt_cache_key",
    "safety_identifier",
    "web_search_options",
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
    let n = match f.uint("n")? {
        None => 1,
        Some(0) => return Err(ApiError::field("n", "must be at least 1")),
        Some(n) if n > MAX_CHOICES => {
            return Err(ApiError::field(
                "n",
                format!("at most {MAX_CHOICES} choices per request (got {n})"),
            ))
        }
        Some(n) => n as usize,
    };
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
            check_keys(
                o,
                &[&["include_usage", "include_obfuscation"]],
                "stream_options.",
            )?;
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
    let logit_bias = parse_logit_bias(f.get("logit_bias"))?;
    let ignore_eos = f.bool("ignore_eos")?.unwrap_or(false);
    Ok(GenRequest {
        prompt,
        stream,
        include_usage,
        max_tokens,
        sampling,
        seed,
        stop,
        n,
        logprobs: None,
        echo: false,
        logit_bias,
        ignore_eos,
        json_schema: None,
        tool_choice: ToolChoice::Auto,
        parallel_tool_calls: true,
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

/// Chat fields OpenAI defines that this server cannot honour: refused when they ask for
/// something (audio output, the deprecated function calling); the rest of OpenAI's fields that
/// do not apply (`store`, `metadata`, `service_tier`, …) are ignored.
fn refuse_inapplicable(f: &Fields) -> Result<(), ApiError> {
    if let Some(v) = f.get("modalities") {
        let Value::Array(a) = v else {
            return Err(type_err("modalities", "an array of strings", v));
        };
        for (i, m) in a.iter().enumerate() {
            match m.as_str() {
                Some("text") => {}
                Some(other) => {
                    return Err(ApiError::field(
                        format!("modalities[{i}]"),
                        format!(
                            "only text output is supported (got \"{}\")",
                            printable(other)
                        ),
                    ))
                }
                None => return Err(type_err(&format!("modalities[{i}]"), "a string", m)),
            }
        }
    }
    if f.get("audio").is_some() {
        return Err(ApiError::field("audio", "audio output is not supported"));
    }
    for name in ["functions", "function_call"] {
        if f.get(name).is_some() {
            return Err(ApiError::field(
                name,
                "the deprecated function-calling fields are not supported: use `tools` and `tool_choice`",
            ));
        }
    }
    if let Some(v) = f.get("metadata") {
        if !v.is_object() {
            return Err(type_err("metadata", "an object", v));
        }
    }
    for name in [
        "service_tier",
        "verbosity",
        "prompt_cache_key",
        "safety_identifier",
    ] {
        if let Some(v) = f.get(name) {
            if !v.is_string() {
                return Err(type_err(name, "a string", v));
            }
        }
    }
    f.bool("store")?;
    Ok(())
}

/// `chat_template_kwargs` (extra template variables, e.g. `enable_thinking` for Qwen3) and
/// `reasoning_effort` (passed to the template under that name, as gpt-oss templates read it).
fn template_kwargs(f: &Fields) -> Result<Vec<(String, Value)>, ApiError> {
    let mut out = Vec::new();
    match f.get("chat_template_kwargs") {
        None => {}
        Some(Value::Object(o)) => {
            for (k, v) in o {
                if !v.is_null() {
                    out.push((k.clone(), v.clone()));
                }
            }
        }
        Some(v) => return Err(type_err("chat_template_kwargs", "an object", v)),
    }
    if let Some(v) = f.get("reasoning_effort") {
        match v.as_str() {
            Some("none" | "minimal" | "low" | "medium" | "high") => {
                out.push(("reasoning_effort".into(), v.clone()))
            }
            Some(other) => {
                return Err(ApiError::field(
                    "reasoning_effort",
                    format!(
                        "expected none, minimal, low, medium or high (got \"{}\")",
                        printable(other)
                    ),
                ))
            }
            None => return Err(type_err("reasoning_effort", "a string", v)),
        }
    }
    Ok(out)
}

/// `response_format`: `text` → None; `json_object` → any JSON object; `json_schema` → its schema.
fn parse_response_format(v: Option<&Value>) -> Result<Option<Value>, ApiError> {
    let Some(v) = v else { return Ok(None) };
    let Value::Object(o) = v else {
        return Err(type_err("response_format", "an object", v));
    };
    let ty = match o.get("type") {
        Some(Value::String(t)) => t.as_str(),
        None | Some(Value::Null) => {
            return Err(ApiError::field("response_format.type", "is required"))
        }
        Some(t) => return Err(type_err("response_format.type", "a string", t)),
    };
    match ty {
        "text" => {
            check_keys(o, &[&["type"]], "response_format.")?;
            Ok(None)
        }
        "json_object" => {
            check_keys(o, &[&["type"]], "response_format.")?;
            Ok(Some(json!({"type": "object"})))
        }
        "json_schema" => {
            check_keys(o, &[&["type", "json_schema"]], "response_format.")?;
            let js = match o.get("json_schema") {
                Some(Value::Object(js)) => js,
                None | Some(Value::Null) => {
                    return Err(ApiError::field(
                        "response_format.json_schema",
                        "is required",
                    ))
                }
                Some(v) => return Err(type_err("response_format.json_schema", "an object", v)),
            };
            let p = "response_format.json_schema.";
            check_keys(js, &[&["name", "description", "schema", "strict"]], p)?;
            match js.get("name") {
                Some(Value::String(_)) => {}
                None | Some(Value::Null) => {
                    return Err(ApiError::field(format!("{p}name"), "is required"))
                }
                Some(v) => return Err(type_err(&format!("{p}name"), "a string", v)),
            }
            if let Some(s) = js.get("strict").filter(|s| !s.is_null() && !s.is_boolean()) {
                return Err(type_err(&format!("{p}strict"), "a boolean", s));
            }
            match js.get("schema") {
                None | Some(Value::Null) => Ok(Some(json!({}))),
                Some(s @ (Value::Object(_) | Value::Bool(_))) => Ok(Some(s.clone())),
                Some(s) => Err(type_err(&format!("{p}schema"), "a JSON schema object", s)),
            }
        }
        other => Err(ApiError::field(
            "response_format.type",
            format!(
                "expected text, json_object or json_schema (got \"{}\")",
                printable(other)
            ),
        )),
    }
}

/// `logit_bias`: `{"token id": bias}` with biases in [-100, 100].
fn parse_logit_bias(v: Option<&Value>) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(v) = v else { return Ok(Vec::new()) };
    let Value::Object(o) = v else {
        return Err(type_err("logit_bias", "an object of token id → bias", v));
    };
    if o.len() > MAX_LOGIT_BIAS {
        return Err(ApiError::field(
            "logit_bias",
            format!("at most {MAX_LOGIT_BIAS} entries (got {})", o.len()),
        ));
    }
    let mut out = Vec::with_capacity(o.len());
    for (k, b) in o {
        let at = format!("logit_bias.{}", printable(k));
        let id: u32 = k
            .parse()
            .map_err(|_| ApiError::field(&at, "keys must be token ids (integers as strings)"))?;
        if b.is_null() {
            continue;
        }
        let x = b.as_f64().ok_or_else(|| type_err(&at, "a number", b))?;
        if !(-100.0..=100.0).contains(&x) {
            return Err(ApiError::field(
                &at,
                format!("must be in [-100, 100] (got {x})"),
            ));
        }
        out.push((id, x as f32));
    }
    Ok(out)
}

fn parse_messages(v: Option<&Value>) -> Result<Vec<Value>, ApiError> {
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
    arr.iter()
        .enumerate()
        .map(|(i, m)| parse_message(i, m))
        .collect()
}

/// Keys a message may carry (OpenAI's message shapes, as `model_dump()` writes them).
const MESSAGE_KEYS: &[&str] = &[
    "role",
    "content",
    "name",
    "tool_calls",
    "tool_call_id",
    "refusal",
    "annotations",
    "audio",
    "function_call",
    "reasoning_content",
];

/// One message as the template sees it: `role`, `content` (a string), and `name`,
/// `tool_calls` (arguments parsed into objects, as transformers expects) or `tool_call_id`.
fn parse_message(i: usize, m: &Value) -> Result<Value, ApiError> {
    let at = |field: &str| format!("messages[{i}].{field}");
    let Value::Object(o) = m else {
        return Err(type_err(&format!("messages[{i}]"), "an object", m));
    };
    check_keys(o, &[MESSAGE_KEYS], &format!("messages[{i}]."))?;
    let get = |k: &str| o.get(k).filter(|v| !v.is_null());
    let role = match get("role") {
        Some(Value::String(r)) => r.as_str(),
        None => return Err(ApiError::field(at("role"), "is required")),
        Some(v) => return Err(type_err(&at("role"), "a string", v)),
    };
    // OpenAI's newer name for the system role; templates only know `system`.
    let role = match role {
        "developer" => "system",
        "system" | "user" | "assistant" | "tool" => role,
        "function" => {
            return Err(ApiError::field(
                at("role"),
                "the deprecated function role is not supported: use tool messages",
            ))
        }
        other => {
            return Err(ApiError::field(
                at("role"),
                format!(
                    "unknown role \"{}\" (expected system, user, assistant or tool)",
                    printable(other)
                ),
            ))
        }
    };
    let mut out = Map::new();
    out.insert("role".into(), json!(role));
    if let Some(n) = get("name") {
        if !n.is_string() {
            return Err(type_err(&at("name"), "a string", n));
        }
        out.insert("name".into(), n.clone());
    }
    if get("function_call").is_some() {
        return Err(ApiError::field(
            at("function_call"),
            "the deprecated function calling is not supported: use tool_calls",
        ));
    }
    if get("audio").is_some() {
        return Err(ApiError::field(at("audio"), "audio is not supported"));
    }
    let tool_calls = match get("tool_calls") {
        None => None,
        Some(v) if role == "assistant" => {
            Some(crate::tools::parse_history_calls(v, &at("tool_calls"))?)
        }
        Some(_) => {
            return Err(ApiError::field(
                at("tool_calls"),
                "only assistant messages carry tool calls",
            ))
        }
    };
    let content = match get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => text_parts(parts, i)?,
        // An assistant turn that only calls tools has no content.
        None if role == "assistant" => String::new(),
        None => return Err(ApiError::field(at("content"), "is required")),
        Some(v) => {
            return Err(type_err(
                &at("content"),
                "a string or an array of text parts",
                v,
            ))
        }
    };
    out.insert("content".into(), json!(content));
    if let Some(calls) = tool_calls {
        out.insert("tool_calls".into(), calls);
    }
    if let Some(r) = get("reasoning_content") {
        if !r.is_string() {
            return Err(type_err(&at("reasoning_content"), "a string", r));
        }
        out.insert("reasoning_content".into(), r.clone());
    }
    match (role, get("tool_call_id")) {
        ("tool", Some(Value::String(id))) => {
            out.insert("tool_call_id".into(), json!(id));
        }
        ("tool", None) => return Err(ApiError::field(at("tool_call_id"), "is required")),
        ("tool", Some(v)) => return Err(type_err(&at("tool_call_id"), "a string", v)),
        (_, Some(_)) => {
            return Err(ApiError::field(
                at("tool_call_id"),
                "only tool messages carry a tool_call_id",
            ))
        }
        (_, None) => {}
    }
    Ok(Value::Object(out))
}

/// `[{"type": "text", "text": "…"}, …]` joined with newlines (a `refusal` part counts as text);
/// other part types are refused.
fn text_parts(parts: &[Value], i: usize) -> Result<String, ApiError> {
    let mut texts = Vec::with_capacity(parts.len());
    for (j, p) in parts.iter().enumerate() {
        let at = format!("messages[{i}].content[{j}]");
        let Value::Object(o) = p else {
            return Err(type_err(&at, "an object", p));
        };
        let key = match o.get("type").and_then(Value::as_str) {
            Some("text") => "text",
            Some("refusal") => "refusal",
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
        };
        check_keys(o, &[&["type", key, "annotations"]], &format!("{at}."))?;
        match o.get(key) {
            Some(Value::String(s)) => texts.push(s.as_str()),
            None | Some(Value::Null) => {
                return Err(ApiError::field(format!("{at}.{key}"), "is required"))
            }
            Some(v) => return Err(type_err(&format!("{at}.{key}"), "a string", v)),
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

    /// A non-negative integer of at most `max`.
    fn uint_max(&self, name: &str, max: u64) -> Result<Option<u64>, ApiError> {
        match self.uint(name)? {
            Some(n) if n > max => Err(ApiError::field(
                name,
                format!("must be at most {max} (got {n})"),
            )),
            n => Ok(n),
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

pub(crate) fn type_err(name: &str, expected: &str, got: &Value) -> ApiError {
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
pub(crate) fn printable(s: &str) -> String {
    let mut out: String = s.chars().take(64).flat_map(char::escape_default).collect();
    if s.chars().count() > 64 {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests;
