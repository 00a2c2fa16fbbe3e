//! Tool calling: the request's `tools` / `tool_choice` checked, the model's tool-call syntax
//! (detected from its chat template) parsed back into OpenAI `tool_calls` — whole or as stream
//! deltas with the arguments streamed as they are generated — and the grammar that forces a
//! call when `tool_choice` is `required` or names a function.
//!
//! Formats (the text the model writes):
//! - Hermes / Qwen: `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>` (one per call);
//! - Mistral: `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]`;
//! - Llama 3.x: a bare `{"name": …, "parameters": {…}}` (optionally after `<|python_tag|>`).
//!
//! The parser is format-agnostic past the opener: every top-level JSON object after it is one
//! call, and the arguments are the raw text of its `arguments` / `parameters` value (so the
//! streamed pieces concatenate to exactly the non-streamed string).

use crate::error::ApiError;
use crate::request::{printable, type_err};
use serde_json::{json, Value};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    Auto,
    None,
    Required,
    Function(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    Mistral,
    Llama3,
}

impl ToolFormat {
    /// The format a chat template speaks; Hermes when it names none.
    pub fn detect(template: &str) -> ToolFormat {
        if template.contains("[TOOL_CALLS]") {
            ToolFormat::Mistral
        } else if template.contains("<tool_call>") {
            ToolFormat::Hermes
        } else if template.contains("<|python_tag|>") || template.contains("ipython") {
            ToolFormat::Llama3
        } else {
            ToolFormat::Hermes
        }
    }

    fn opener(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "<tool_call>",
            ToolFormat::Mistral => "[TOOL_CALLS]",
            ToolFormat::Llama3 => "<|python_tag|>",
        }
    }

    fn args_key(self) -> &'static str {
        match self {
            ToolFormat::Llama3 => "parameters",
            _ => "arguments",
        }
    }

    /// A Lark grammar (llguidance's dialect) for one or more calls of `tools` (only `only` when
    /// named), each call's arguments constrained by the function's `parameters` schema.
    pub fn grammar(self, tools: &[Value], only: Option<&str>, parallel: bool) -> String {
        let key = self.args_key();
        let calls: Vec<Value> = tools
            .iter()
            .filter_map(|t| t.get("function"))
            .filter(|f| only.is_none_or(|n| f["name"] == n))
            .map(|f| {
                let params = match f.get("parameters") {
                    Some(p) if !p.is_null() => p.clone(),
                    _ => json!({"type": "object"}),
                };
                json!({
                    "type": "object",
                    "properties": {"name": {"const": f["name"]}, key: params},
                    "required": ["name", key],
                    "additionalProperties": false,
                })
            })
            .collect();
        // Calls written exactly as the templates render them (`{"name": "f", "arguments": …}`):
        // what the model has seen, and no room to wander in whitespace.
        let schema = json!({"anyOf": calls, "x-guidance": {
            "whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}});
        let (first, sep, last) = match self {
            ToolFormat::Hermes => (
                r#""<tool_call>\n""#,
                r#""\n</tool_call>\n<tool_call>\n""#,
                r#""\n</tool_call>""#,
            ),
            ToolFormat::Mistral => (r#""[TOOL_CALLS][""#, r#"", ""#, r#""]""#),
            ToolFormat::Llama3 => ("", "", ""),
        };
        let more = if parallel && self != ToolFormat::Llama3 {
            format!("({sep} call)*")
        } else {
            String::new()
        };
        format!("start: {first} call {more} {last}\ncall: %json {schema}\n")
    }
}

/// Most tools one request may declare.
pub const MAX_TOOLS: usize = 128;

/// `tools`: an array of `{"type": "function", "function": {"name", "description"?,
/// "parameters"?, "strict"?}}`.
pub fn parse_tools(v: Option<&Value>) -> Result<Vec<Value>, ApiError> {
    let arr = match v {
        None => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(v) => return Err(type_err("tools", "an array of tools", v)),
    };
    if arr.len() > MAX_TOOLS {
        return Err(ApiError::field(
            "tools",
            format!("at most {MAX_TOOLS} tools"),
        ));
    }
    let mut out = Vec::with_capacity(arr.len());
    for (i, t) in arr.iter().enumerate() {
        let at = |k: &str| format!("tools[{i}].{k}");
        let Value::Object(o) = t else {
            return Err(type_err(&format!("tools[{i}]"), "an object", t));
        };
        match o.get("type").and_then(Value::as_str) {
            Some("function") => {}
            Some(other) => {
                return Err(ApiError::field(
                    at("type"),
                    format!(
                        "only function tools are supported (got \"{}\")",
                        printable(other)
                    ),
                ))
            }
            None => return Err(ApiError::field(at("type"), "is required (\"function\")")),
        }
        let Some(Value::Object(f)) = o.get("function") else {
            return Err(ApiError::field(at("function"), "is required (an object)"));
        };
        for k in f.keys() {
            if !["name", "description", "parameters", "strict"].contains(&k.as_str()) {
                return Err(ApiError::field(
                    at(&format!("function.{}", printable(k))),
                    "unrecognized field",
                )
                .with_code("unknown_parameter"));
            }
        }
        let name = match f.get("name") {
            Some(Value::String(n)) => n,
            _ => {
                return Err(ApiError::field(
                    at("function.name"),
                    "is required (a string)",
                ))
            }
        };
        let ok = !name.is_empty()
            && name.len() <= 64
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if !ok {
            return Err(ApiError::field(
                at("function.name"),
                "must be 1 to 64 characters of a-z, A-Z, 0-9, _ or -",
            ));
        }
        let mut func = serde_json::Map::new();
        func.insert("name".into(), json!(name));
        if let Some(d) = f.get("description").filter(|d| !d.is_null()) {
            if !d.is_string() {
                return Err(type_err(&at("function.description"), "a string", d));
            }
            func.insert("description".into(), d.clone());
        }
        if let Some(p) = f.get("parameters").filter(|p| !p.is_null()) {
            if !p.is_object() {
                return Err(type_err(
                    &at("function.parameters"),
                    "a JSON schema object",
                    p,
                ));
            }
            func.insert("parameters".into(), p.clone());
        }
        if let Some(s) = f.get("strict").filter(|s| !s.is_null() && !s.is_boolean()) {
            return Err(type_err(&at("function.strict"), "a boolean", s));
        }
        out.push(json!({"type": "function", "function": func}));
    }
    Ok(out)
}

/// `tool_choice`: `none`, `auto`, `required` or `{"type": "function", "function": {"name"}}`.
pub fn parse_tool_choice(v: Option<&Value>, tools: &[Value]) -> Result<ToolChoice, ApiError> {
    let choice = match v {
        None => return Ok(ToolChoice::Auto),
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::field(
                    "tool_choice",
                    format!(
                        "expected none, auto, required or a function (got \"{}\")",
                        printable(other)
                    ),
                ))
            }
        },
        Some(Value::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str);
            match (o.get("type").and_then(Value::as_str), name) {
                (Some("function"), Some(n)) => ToolChoice::Function(n.to_string()),
                _ => {
                    return Err(ApiError::field(
                        "tool_choice",
                        "expected {\"type\": \"function\", \"function\": {\"name\": …}}",
                    ))
                }
            }
        }
        Some(v) => return Err(type_err("tool_choice", "a string or an object", v)),
    };
    match &choice {
        ToolChoice::Required if tools.is_empty() => Err(ApiError::field(
            "tool_choice",
            "\"required\" needs at least one tool in `tools`",
        )),
        ToolChoice::Function(n) if !tools.iter().any(|t| t["function"]["name"] == n.as_str()) => {
            Err(ApiError::field(
                "tool_choice",
                format!("no tool named \"{}\" in `tools`", printable(n)),
            ))
        }
        _ => Ok(choice),
    }
}

/// An assistant message's `tool_calls` for the template: `arguments` parsed from their JSON
/// string into a value (templates render them with `tojson`).
pub fn parse_history_calls(v: &Value, at: &str) -> Result<Value, ApiError> {
    let Value::Array(calls) = v else {
        return Err(type_err(at, "an array of tool calls", v));
    };
    let mut out = Vec::with_capacity(calls.len());
    for (j, c) in calls.iter().enumerate() {
        let at = format!("{at}[{j}]");
        let f = c
            .get("function")
            .filter(|f| f.is_object())
            .ok_or_else(|| ApiError::field(format!("{at}.function"), "is required (an object)"))?;
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| ApiError::field(format!("{at}.function.name"), "is required"))?;
        let args = match f.get("arguments") {
            Some(Value::String(s)) => serde_json::from_str(s).unwrap_or_else(|_| json!(s)),
            None | Some(Value::Null) => json!({}),
            Some(a) => a.clone(),
        };
        let mut call = json!({"type": "function", "function": {"name": name, "arguments": args}});
        if let Some(id) = c.get("id").and_then(Value::as_str) {
            call["id"] = json!(id);
        }
        out.push(call);
    }
    Ok(Value::Array(out))
}

/// One parsed call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments' JSON text as the model wrote it.
    pub arguments: String,
}

impl ToolCall {
    pub fn to_json(&self) -> Value {
        json!({"id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}})
    }
}

/// What a piece of answer text turned into.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delta {
    Content(String),
    /// A new call (`index`), with its id and name and empty arguments so far.
    CallStart {
        index: usize,
        id: String,
        name: String,
    },
    /// More argument text of call `index`.
    CallArgs {
        index: usize,
        text: String,
    },
}

/// Splits the answer into content and tool calls as it is generated.
pub struct ToolParser {
    format: ToolFormat,
    id_base: String,
    /// Text not yet classified (a possible opener prefix), or, once in calls, all of it.
    buf: String,
    in_calls: bool,
    /// Nothing but whitespace seen yet (a bare JSON object may start the calls).
    at_start: bool,
    /// Per call: the name emitted and how much of the arguments.
    emitted: Vec<(String, usize)>,
    /// `parallel_tool_calls: false`: only the first call counts.
    single: bool,
}

impl ToolParser {
    pub fn new(format: ToolFormat, id_base: String) -> ToolParser {
        ToolParser {
            format,
            id_base,
            buf: String::new(),
            in_calls: false,
            at_start: true,
            emitted: Vec::new(),
            single: false,
        }
    }

    /// Keeps only the first call (OpenAI's `parallel_tool_calls: false`).
    pub fn single_call(mut self) -> ToolParser {
        self.single = true;
        self
    }

    pub fn push(&mut self, text: &str) -> Vec<Delta> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        if !self.in_calls {
            if self.at_start && self.buf.trim().is_empty() {
                return out; // leading whitespace: wait to see what starts the answer
            }
            let lead = self.buf.len() - self.buf.trim_start().len();
            let bare_start = self.at_start
                && matches!(
                    (self.format, self.buf.trim_start().chars().next()),
                    (ToolFormat::Llama3, Some('{')) | (ToolFormat::Mistral, Some('['))
                );
            if bare_start {
                self.buf.drain(..lead);
                self.in_calls = true;
            } else if let Some(at) = self.buf.find(self.format.opener()) {
                let before: String = self.buf.drain(..at).collect();
                if !before.trim().is_empty() {
                    out.push(Delta::Content(before));
                }
                self.in_calls = true;
            } else {
                let keep = partial_suffix(&self.buf, self.format.opener());
                let shown: String = self.buf.drain(..self.buf.len() - keep).collect();
                if !shown.is_empty() {
                    self.at_start = false;
                    out.push(Delta::Content(shown));
                }
                return out;
            }
        }
        self.scan(&mut out);
        out
    }

    /// Emits what the calls in `buf` add to what was already sent.
    fn scan(&mut self, out: &mut Vec<Delta>) {
        let limit = if self.single { 1 } else { usize::MAX };
        for (i, obj) in top_level_objects(&self.buf)
            .into_iter()
            .enumerate()
            .take(limit)
        {
            let Some(name) = string_field(obj, "name") else {
                break;
            };
            if i == self.emitted.len() {
                out.push(Delta::CallStart {
                    index: i,
                    id: format!("{}{i}", self.id_base),
                    name: name.clone(),
                });
                self.emitted.push((name, 0));
            }
            let args = value_text(obj, self.format.args_key()).unwrap_or("");
            let sent = self.emitted[i].1;
            if args.len() > sent {
                out.push(Delta::CallArgs {
                    index: i,
                    text: args[sent..].to_string(),
                });
                self.emitted[i].1 = args.len();
            }
        }
    }

    /// The end of the answer: the calls found, or, when the text after the opener held none,
    /// that text as content.
    pub fn finish(&mut self) -> (Vec<Delta>, Vec<ToolCall>) {
        let mut out = Vec::new();
        if !self.in_calls || self.emitted.is_empty() {
            let rest = std::mem::take(&mut self.buf);
            if !rest.is_empty() {
                out.push(Delta::Content(rest));
            }
            return (out, Vec::new());
        }
        let calls = top_level_objects(&self.buf)
            .into_iter()
            .zip(&self.emitted)
            .enumerate()
            .map(|(i, (obj, (name, _)))| ToolCall {
                id: format!("{}{i}", self.id_base),
                name: name.clone(),
                arguments: value_text(obj, self.format.args_key())
                    .filter(|a| serde_json::from_str::<Value>(a).is_ok())
                    .unwrap_or("{}")
                    .to_string(),
            })
            .collect();
        (out, calls)
    }
}

/// Parses a whole answer: (content, calls).
pub fn parse_answer(format: ToolFormat, text: &str, id_base: &str) -> (String, Vec<ToolCall>) {
    let mut p = ToolParser::new(format, id_base.to_string());
    let mut deltas = p.push(text);
    let (tail, calls) = p.finish();
    deltas.extend(tail);
    let content = deltas
        .into_iter()
        .filter_map(|d| match d {
            Delta::Content(c) => Some(c),
            _ => None,
        })
        .collect::<String>();
    (content, calls)
}

/// Length of the longest suffix of `s` that is a proper prefix of `pat`.
fn partial_suffix(s: &str, pat: &str) -> usize {
    (1..pat.len().min(s.len() + 1))
        .rev()
        .find(|&k| s.is_char_boundary(s.len() - k) && pat.starts_with(&s[s.len() - k..]))
        .unwrap_or(0)
}

/// The top-level `{…}` objects of `s`, the last possibly unfinished (strings and escapes are
/// followed, so braces inside strings do not count).
fn top_level_objects(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut depth, mut in_str, mut esc, mut start) = (0usize, false, false, 0usize);
    for (i, c) in s.char_indices() {
        if in_str {
            match (esc, c) {
                (true, _) => esc = false,
                (false, '\\') => esc = true,
                (false, '"') => in_str = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' if depth > 0 => in_str = true,
            '{' => {
                if depth == 0 {
                    start = i;
                }
                depth += 1;
            }
            '}' if depth > 0 => {
                depth -= 1;
                if depth == 0 {
                    out.push(&s[start..=i]);
                }
            }
            _ => {}
        }
    }
    if depth > 0 {
        out.push(&s[start..]);
    }
    out
}

/// The text of the value of `"key":` at the top level of `obj` (possibly unfinished).
fn value_text<'a>(obj: &'a str, key: &str) -> Option<&'a str> {
    let pat = format!("\"{key}\"");
    let at = obj.find(&pat)? + pat.len();
    let rest = &obj[at..];
    let colon = rest.find(|c: char| !c.is_whitespace())?;
    if !rest[colon..].starts_with(':') {
        return None;
    }
    let v = &rest[colon + 1..];
    let v0 = v.len() - v.trim_start().len();
    let v = &v[v0..];
    // Scan one JSON value: an object/array by depth, a string by quotes, a scalar to , or }.
    let (mut depth, mut in_str, mut esc) = (0i32, false, false);
    for (i, c) in v.char_indices() {
        if in_str {
            match (esc, c) {
                (true, _) => esc = false,
                (false, '\\') => esc = true,
                (false, '"') => {
                    in_str = false;
                    if depth == 0 {
                        return Some(&v[..=i]);
                    }
                }
                _ => {}
            }
            continue;
        }
        match c {
            '"' => in_str = true,
            '{' | '[' => depth += 1,
            '}' | ']' if depth == 0 => return Some(v[..i].trim_end()),
            '}' | ']' => {
                depth -= 1;
                if depth == 0 {
                    return Some(&v[..=i]);
                }
            }
            ',' if depth == 0 => return Some(v[..i].trim_end()),
            _ => {}
        }
    }
    Some(v)
}

/// A complete string field `"key": "…"` of `obj`.
fn string_field(obj: &str, key: &str) -> Option<String> {
    let t = value_text(obj, key)?;
    if t.len() >= 2 && t.ends_with('"') {
        serde_json::from_str(t).ok()
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(format: ToolFormat, pieces: &[&str]) -> (String, Vec<ToolCall>) {
        let mut p = ToolParser::new(format, "call_".into());
        let mut content = String::new();
        let mut args: Vec<(String, String)> = Vec::new();
        let mut all = Vec::new();
        for piece in pieces {
            all.extend(p.push(piece));
        }
        let (tail, calls) = p.finish();
        all.extend(tail);
        for d in all {
            match d {
                Delta::Content(c) => content.push_str(&c),
                Delta::CallStart { index, name, .. } => {
                    assert_eq!(index, args.len());
                    args.push((name, String::new()));
                }
                Delta::CallArgs { index, text } => args[index].1.push_str(&text),
            }
        }
        // Streamed pieces add up to the whole answer's calls.
        assert_eq!(args.len(), calls.len());
        for (a, c) in args.iter().zip(&calls) {
            assert_eq!((&a.0, &a.1), (&c.name, &c.arguments));
        }
        (content, calls)
    }

    fn chars(s: &str) -> Vec<String> {
        s.chars().map(|c| c.to_string()).collect()
    }

    #[test]
    fn hermes_calls_parse_whole_and_char_by_char() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris {x}\", \"n\": [1, 2]}}\n</tool_call>\n<tool_call>\n{\"name\": \"t2\", \"arguments\": {}}\n</tool_call>";
        let (content, calls) = parse_answer(ToolFormat::Hermes, text, "call_");
        assert_eq!(content.trim(), "Let me check.");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(calls[0].arguments, r#"{"city": "Paris {x}", "n": [1, 2]}"#);
        assert_eq!(calls[1].arguments, "{}");
        let pieces = chars(text);
        let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
        let (c2, calls2) = stream(ToolFormat::Hermes, &refs);
        assert_eq!(c2.trim(), "Let me check.");
        assert_eq!(calls2, calls);
    }

    #[test]
    fn single_call_keeps_the_first() {
        let text = "<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", \"arguments\": {}}\n</tool_call>";
        let mut p = ToolParser::new(ToolFormat::Hermes, "c".into()).single_call();
        let deltas = p.push(text);
        let (_, calls) = p.finish();
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].name, "a");
        assert_eq!(
            deltas
                .iter()
                .filter(|d| matches!(d, Delta::CallStart { .. }))
                .count(),
            1
        );
    }

    #[test]
    fn mistral_and_llama_forms() {
        let (c, calls) = parse_answer(
            ToolFormat::Mistral,
            r#"[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"y": "}"}}]"#,
            "id",
        );
        assert_eq!(c, "");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[1].arguments, r#"{"y": "}"}"#);
        let (c, calls) = parse_answer(
            ToolFormat::Llama3,
            r#" {"name": "f", "parameters": {"q": "v"}}"#,
            "id",
        );
        assert_eq!((c.as_str(), calls.len()), ("", 1));
        assert_eq!(calls[0].arguments, r#"{"q": "v"}"#);
    }

    #[test]
    fn plain_text_and_false_openers_stay_content() {
        let (c, calls) = stream(ToolFormat::Hermes, &["Use <tool", "s> wisely", " <tool_"]);
        assert_eq!(c, "Use <tools> wisely <tool_");
        assert!(calls.is_empty());
        let (c, calls) = parse_answer(ToolFormat::Hermes, "<tool_call> not json", "x");
        assert_eq!((c.as_str(), calls.len()), ("<tool_call> not json", 0));
    }

    #[test]
    fn template_detection() {
        assert_eq!(
            ToolFormat::detect("{{ '[TOOL_CALLS]' }}"),
            ToolFormat::Mistral
        );
        assert_eq!(ToolFormat::detect("<tool_call>"), ToolFormat::Hermes);
        assert_eq!(ToolFormat::detect("<|python_tag|>"), ToolFormat::Llama3);
        assert_eq!(ToolFormat::detect("plain"), ToolFormat::Hermes);
    }
}
