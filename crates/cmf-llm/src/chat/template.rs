//! Hugging Face chat templates rendered with minijinja, set up the way transformers sets up
//! Jinja2 (`utils/chat_template_utils.py`, `_cached_compile_jinja_template` and
//! `render_jinja_template`):
//! - `trim_blocks` and `lstrip_blocks` on; `{% break %}` / `{% continue %}` (loopcontrols);
//! - globals `raise_exception(msg)` (an error carrying msg) and `strftime_now(fmt)`;
//! - `tojson` replaced by `json.dumps(x, ensure_ascii=False)` (no HTML escaping, `", "` / `": "`
//!   separators, keys in insertion order, optional `indent`, `separators`, `sort_keys`);
//! - Python string/dict methods (`.strip()`, `.startswith()`, `.items()`, …) via
//!   `minijinja_contrib::pycompat`;
//! - `{% generation %}…{% endgeneration %}` (transformers' AssistantTracker) renders its body;
//! - context: `messages`, `tools`, `documents`, `add_generation_prompt`, and the special tokens
//!   `bos_token`, `eos_token`, `unk_token`, `pad_token` as strings (`special_tokens_map`).
//!
//! A template is code that comes with the model file, so every render runs under [`Limits`]:
//! minijinja's fuel (instructions) and recursion limit, a cap on the rendered size, a wall-clock
//! deadline, and bounded widths for `indent` / `tojson(indent=…)` (minijinja already refuses a
//! `range` over 100 000 items and a string repeated past 100 MB). Intermediate values are not
//! bounded in a render here: a process that renders untrusted templates installs render workers
//! ([`super::render_worker`]), whose memory is capped, and every render then runs there.

use std::cell::Cell;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{LlmError, Result};
use minijinja::value::{Kwargs, StringInput, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};

/// Bounds on one render. Real templates need a few thousand instructions and a few kB of output
/// per message; the defaults leave a wide margin over the longest prompt a context can hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// minijinja instructions per render.
    pub fuel: u64,
    /// Bytes of rendered output.
    pub max_output: usize,
    /// Wall-clock time per render.
    pub time: Duration,
    /// Nesting depth of calls, loops and includes (minijinja's recursion limit).
    pub recursion: usize,
    /// Widest indentation `indent` and `tojson(indent=…)` may produce.
    pub max_indent: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            fuel: 20_000_000,
            max_output: 16 << 20,
            time: Duration::from_secs(5),
            recursion: 200,
            max_indent: 64,
        }
    }
}

thread_local! {
    /// The running render's deadline, for the functions and filters that can take long.
    static DEADLINE: Cell<Option<Instant>> = const { Cell::new(None) };
}

fn past_deadline() -> bool {
    DEADLINE.with(|d| d.get().is_some_and(|t| Instant::now() > t))
}

/// Every error of ours about a limit says this, so a render failure can be told apart from an
/// error the template raises on purpose.
const LIMIT_MARK: &str = "template limit";

fn time_limit_error() -> Error {
    limit_error("time limit exceeded")
}

fn limit_error(what: impl std::fmt::Display) -> Error {
    Error::new(ErrorKind::InvalidOperation, format!("{LIMIT_MARK}: {what}"))
}

/// Whether a render error is a limit: ours, or minijinja's own bounds (range length, string
/// repetition, recursion depth).
fn past_limit(msg: &str) -> bool {
    [
        LIMIT_MARK,
        "range has too many elements",
        "repeated string is too large",
        "recursion limit",
        "maximum recursion",
    ]
    .iter()
    .any(|m| msg.contains(m))
}

/// ChatML, used when the file carries no template (the common format of Qwen and SmolLM).
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// The special-token strings a template may reference.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpecialTokens {
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub unk_token: Option<String>,
    pub pad_token: Option<String>,
}

pub struct ChatTemplate {
    env: Environment<'static>,
    /// As given (a render worker compiles it again).
    source: Arc<str>,
    special: SpecialTokens,
    limits: Limits,
    /// The file the template came from, for errors that must name it.
    origin: Option<String>,
}

const NAME: &str = "chat_template";

impl ChatTemplate {
    /// Compiles `source` under the default [`Limits`]; a syntax error is reported with its line.
    pub fn new(source: &str, special: SpecialTokens) -> Result<ChatTemplate> {
        ChatTemplate::with_limits(source, special, Limits::default())
    }

    pub fn with_limits(
        source: &str,
        special: SpecialTokens,
        limits: Limits,
    ) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_fuel(Some(limits.fuel));
        env.set_recursion_limit(limits.recursion);
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        let max_indent = limits.max_indent;
        env.add_filter("tojson", move |v: Value, kw: Kwargs| {
            tojson(v, kw, max_indent)
        });
        env.add_filter(
            "indent",
            move |s: StringInput,
                  w: Option<usize>,
                  f: Option<bool>,
                  b: Option<bool>,
                  kw: Kwargs| { bounded_indent(s, w, f, b, kw, max_indent) },
        );
        env.add_function("range", bounded_range);
        env.add_template_owned(NAME, strip_generation_tags(source))
            .map_err(|e| LlmError::Template(describe(&e)))?;
        Ok(ChatTemplate {
            env,
            source: source.into(),
            special,
            limits,
            origin: None,
        })
    }

    /// Names the file the template came from in the errors that need it.
    pub fn with_origin(mut self, origin: impl Into<String>) -> ChatTemplate {
        self.origin = Some(origin.into());
        self
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn special(&self) -> &SpecialTokens {
        &self.special
    }

    pub fn origin(&self) -> Option<&str> {
        self.origin.as_deref()
    }

    /// Renders a one-message conversation to prove the template stays within its limits (run
    /// where a template enters the system: import, load, verify). Errors the template raises on
    /// purpose (`raise_exception`, a role it refuses) are not failures here: only a limit is.
    pub fn check_limits(&self) -> Result<()> {
        let msgs = [
            super::Message::new("system", "You are a helpful assistant."),
            super::Message::new("user", "Hello!"),
        ];
        for (msgs, gen) in [(&msgs[..], true), (&msgs[1..], true), (&msgs[1..], false)] {
            match self.render(msgs, gen) {
                Err(e @ (LlmError::TemplateLimit(_) | LlmError::TemplateMemory { .. })) => {
                    return Err(e)
                }
                Err(e @ LlmError::Other(_)) => return Err(e), // no render worker
                _ => continue,
            }
        }
        Ok(())
    }

    pub fn chatml(special: SpecialTokens) -> ChatTemplate {
        ChatTemplate::new(CHATML_TEMPLATE, special).expect("the built-in ChatML template compiles")
    }

    /// Renders a conversation of (role, content) messages.
    pub fn render(
        &self,
        messages: &[super::Message],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let msgs: Vec<Value> = messages
            .iter()
            .map(|m| {
                Value::from_iter([
                    ("role", Value::from(m.role.as_str())),
                    ("content", Value::from(m.content.as_str())),
                ])
            })
            .collect();
        self.render_values(Value::from(msgs), None, add_generation_prompt)
    }

    /// Renders arbitrary messages (dicts with any fields, e.g. `tool_calls`) and optional tools,
    /// both as minijinja values (build them with `serde_json::from_str::<Value>` to keep key order).
    pub fn render_values(
        &self,
        messages: Value,
        tools: Option<Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.render_with_kwargs(messages, tools, &[], add_generation_prompt)
    }

    /// [`Self::render_values`] with extra template variables, as transformers passes the
    /// keyword arguments of `apply_chat_template` (`enable_thinking`, `reasoning_effort`, …).
    /// They cannot replace the variables above (`messages`, `tools`, the special tokens).
    ///
    /// Runs in a render worker when the process installed them ([`super::render_worker`]),
    /// else here.
    pub fn render_with_kwargs(
        &self,
        messages: Value,
        tools: Option<Value>,
        kwargs: &[(String, Value)],
        add_generation_prompt: bool,
    ) -> Result<String> {
        match super::render_worker::installed() {
            Some(workers) => workers.render(self, messages, tools, kwargs, add_generation_prompt),
            None => self.render_here(messages, tools, kwargs, add_generation_prompt),
        }
    }

    /// [`Self::render_with_kwargs`] in the calling thread.
    pub(crate) fn render_here(
        &self,
        messages: Value,
        tools: Option<Value>,
        kwargs: &[(String, Value)],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let tmpl = self
            .env
            .get_template(NAME)
            .map_err(|e| LlmError::Template(describe(&e)))?;
        let s = &self.special;
        let fixed = [
            ("messages", messages),
            ("tools", tools.unwrap_or(Value::from(()))),
            ("documents", Value::from(())),
            ("add_generation_prompt", Value::from(add_generation_prompt)),
            ("bos_token", opt(&s.bos_token)),
            ("eos_token", opt(&s.eos_token)),
            ("unk_token", opt(&s.unk_token)),
            ("pad_token", opt(&s.pad_token)),
        ];
        let ctx = Value::from_iter(
            kwargs
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .chain(fixed.into_iter().map(|(k, v)| (k.to_string(), v))),
        );
        let mut out = BoundedOutput {
            buf: Vec::new(),
            max: self.limits.max_output,
            deadline: Instant::now() + self.limits.time,
            exceeded: None,
        };
        DEADLINE.with(|d| d.set(Some(out.deadline)));
        let rendered = tmpl.render_captured_to(ctx, &mut out).map(|_| ());
        DEADLINE.with(|d| d.set(None));
        let l = &self.limits;
        match rendered {
            Ok(()) => String::from_utf8(out.buf)
                .map_err(|_| LlmError::Template("rendered text is not UTF-8".into())),
            Err(_) if out.exceeded.is_some() => {
                Err(LlmError::TemplateLimit(out.exceeded.unwrap_or_default()))
            }
            Err(e) if e.kind() == ErrorKind::OutOfFuel => Err(LlmError::TemplateLimit(format!(
                "{LIMIT_MARK}: fuel limit exceeded ({} instructions)",
                l.fuel
            ))),
            Err(e) if past_limit(&describe(&e)) => Err(LlmError::TemplateLimit(format!(
                "{} (limits: {} instructions, {} bytes of output, {:?}, recursion {}, indent {})",
                describe(&e),
                l.fuel,
                l.max_output,
                l.time,
                l.recursion,
                l.max_indent
            ))),
            Err(e) => Err(LlmError::Template(describe(&e))),
        }
    }
}

/// The render's sink: refuses to grow past `max` bytes or to go on past `deadline`.
struct BoundedOutput {
    buf: Vec<u8>,
    max: usize,
    deadline: Instant,
    exceeded: Option<String>,
}

impl std::io::Write for BoundedOutput {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() + b.len() > self.max {
            self.exceeded = Some(format!(
                "{LIMIT_MARK}: output size limit exceeded ({} bytes)",
                self.max
            ));
        } else if Instant::now() > self.deadline {
            self.exceeded = Some(format!("{LIMIT_MARK}: time limit exceeded"));
        } else {
            self.buf.extend_from_slice(b);
            return Ok(b.len());
        }
        Err(std::io::Error::other(
            self.exceeded.clone().unwrap_or_default(),
        ))
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// minijinja's `range` (at most 100 000 items), refused once the render is past its deadline so
/// nested loops that print nothing still stop on time.
fn bounded_range(
    lower: isize,
    upper: Option<isize>,
    step: Option<isize>,
) -> std::result::Result<Value, Error> {
    if past_deadline() {
        return Err(time_limit_error());
    }
    minijinja::functions::range(lower, upper, step)
}

/// minijinja's `indent` filter with the width bounded.
fn bounded_indent(
    value: StringInput,
    width: Option<usize>,
    first: Option<bool>,
    blank: Option<bool>,
    kwargs: Kwargs,
    max_indent: usize,
) -> std::result::Result<Value, Error> {
    let w = match width {
        Some(w) => Some(w),
        None => kwargs.get::<Option<usize>>("width")?,
    };
    if w.is_some_and(|w| w > max_indent) {
        return Err(limit_error(format!("indent width above {max_indent}")));
    }
    if past_deadline() {
        return Err(time_limit_error());
    }
    minijinja::filters::indent(value, w, first, blank, kwargs)
}

fn opt(s: &Option<String>) -> Value {
    match s {
        Some(s) => Value::from(s.as_str()),
        None => Value::from(()),
    }
}

/// The error and its cause chain (minijinja puts the template line in the detail).
fn describe(e: &Error) -> String {
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        msg.push_str(&format!(": {s}"));
        src = s.source();
    }
    msg
}

fn raise_exception(msg: String) -> std::result::Result<Value, Error> {
    Err(Error::new(
        ErrorKind::InvalidOperation,
        format!("raise_exception: {msg}"),
    ))
}

/// Removes `{% generation %}` / `{% endgeneration %}` tags (with optional `-` trim markers),
/// keeping what they enclose: transformers' AssistantTracker only records where it is.
fn strip_generation_tags(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(i) = rest.find("{%") {
        let after = &rest[i + 2..];
        let Some(end) = after.find("%}") else { break };
        let inner = after[..end].trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        if inner == "generation" || inner == "endgeneration" {
            out.push_str(&rest[..i]);
        } else {
            out.push_str(&rest[..i + 2 + end + 2]);
        }
        rest = &after[end + 2..];
    }
    out.push_str(rest);
    out
}

/// Python's `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
/// `indent` is bounded by `max_indent` (as a width or a string's length).
fn tojson(value: Value, kwargs: Kwargs, max_indent: usize) -> std::result::Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?; // always False semantics: we emit UTF-8
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.kind() {
            ValueKind::Number => {
                let w = i64::try_from(v)?.max(0) as u64;
                if w > max_indent as u64 {
                    return Err(limit_error(format!("tojson indent above {max_indent}")));
                }
                Some(" ".repeat(w as usize))
            }
            ValueKind::String if v.as_str().is_some_and(|s| s.len() > max_indent) => {
                return Err(limit_error(format!("tojson indent above {max_indent}")))
            }
            ValueKind::String => Some(v.as_str().unwrap_or_default().to_string()),
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an int or a string",
                ))
            }
        },
    };
    // json.dumps: item separator ", " without indent, "," with one; key separator ": ".
    let (item_sep, key_sep) = match separators {
        Some(v) if !v.is_none() => {
            let a = v.get_item_by_index(0)?;
            let b = v.get_item_by_index(1)?;
            let (a, b) = (a.as_str().unwrap_or(","), b.as_str().unwrap_or(":"));
            if a.len() > max_indent || b.len() > max_indent {
                return Err(limit_error(format!(
                    "tojson separators longer than {max_indent}"
                )));
            }
            (a.to_string(), b.to_string())
        }
        _ => (
            if indent.is_some() { "," } else { ", " }.to_string(),
            ": ".to_string(),
        ),
    };
    let opts = JsonOpts {
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    write_json(&value, &opts, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

struct JsonOpts {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

fn write_json(
    v: &Value,
    o: &JsonOpts,
    depth: usize,
    out: &mut String,
) -> std::result::Result<(), Error> {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number if v.is_integer() => out.push_str(&v.to_string()),
        ValueKind::Number => out.push_str(&python_float_repr(f64::try_from(v.clone())?)),
        ValueKind::String => write_json_str(v.as_str().unwrap_or_default(), out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            write_container(out, o, depth, '[', ']', items.len(), |i, out| {
                write_json(&items[i], o, depth + 1, out)
            })?;
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if o.sort_keys {
                keys.sort();
            }
            write_container(out, o, depth, '{', '}', keys.len(), |i, out| {
                let k = &keys[i];
                match k.as_str() {
                    Some(s) => write_json_str(s, out),
                    None => write_json_str(&k.to_string(), out),
                }
                out.push_str(&o.key_sep);
                write_json(&v.get_item(k)?, o, depth + 1, out)
            })?;
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: cannot serialize a {}", v.kind()),
            ));
        }
    }
    Ok(())
}

fn write_container(
    out: &mut String,
    o: &JsonOpts,
    depth: usize,
    open: char,
    close: char,
    n: usize,
    mut item: impl FnMut(usize, &mut String) -> std::result::Result<(), Error>,
) -> std::result::Result<(), Error> {
    out.push(open);
    if n == 0 {
        out.push(close);
        return Ok(());
    }
    for i in 0..n {
        if i > 0 {
            out.push_str(&o.item_sep);
        }
        if let Some(ind) = &o.indent {
            out.push('\n');
            out.push_str(&ind.repeat(depth + 1));
        }
        item(i, out)?;
    }
    if let Some(ind) = &o.indent {
        out.push('\n');
        out.push_str(&ind.repeat(depth));
    }
    out.push(close);
    Ok(())
}

/// JSON string with Python's escapes (ensure_ascii=False: only `"`, `\` and controls escaped).
fn write_json_str(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python `repr(float)`: shortest round-trip digits, positional for 1e-4 ≤ |x| < 1e16,
/// otherwise `d.ddde±XX`; `NaN`, `Infinity` as json.dumps writes them.
fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let sci = format!("{f:e}"); // shortest digits: "-1.2345e-5"
    let (mant, exp) = sci.split_once('e').expect("{:e} has an exponent");
    let exp: i32 = exp.parse().expect("{:e} exponent is an integer");
    let (sign, mant) = mant.strip_prefix('-').map_or(("", mant), |m| ("-", m));
    let digits: String = mant.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        let body = if point <= 0 {
            format!("0.{}{}", "0".repeat((-point) as usize), digits)
        } else if point as usize >= digits.len() {
            format!("{}{}.0", digits, "0".repeat(point as usize - digits.len()))
        } else {
            format!(
                "{}.{}",
                &digits[..point as usize],
                &digits[point as usize..]
            )
        };
        format!("{sign}{body}")
    } else {
        let m = if digits.len() > 1 {
            format!("{}.{}", &digits[..1], &digits[1..])
        } else {
            digits
        };
        format!(
            "{sign}{m}e{}{:02}",
            if exp < 0 { '-' } else { '+' },
            exp.abs()
        )
    }
}

/// `datetime.now().strftime(fmt)` for the directives real templates use, in UTC (this crate
/// keeps no time-zone database): %Y %y %m %d %e %B %b %A %a %H %I %M %S %p %j %%.
fn strftime_now(fmt: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime(secs, &fmt)
}

fn strftime(unix: i64, fmt: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = unix.div_euclid(86400);
    let sod = unix.rem_euclid(86400);
    let (y, m, d) = civil_from_days(days);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday (index 3)
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(m - 1) as usize] + d + i64::from(leap && m > 2);
    let (hh, mm, ss) = (sod / 3600, sod / 60 % 60, sod % 60);
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('e') => out.push_str(&format!("{d:2}")),
            Some('B') => out.push_str(MONTHS[(m - 1) as usize]),
            Some('b') => out.push_str(&MONTHS[(m - 1) as usize][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('H') => out.push_str(&format!("{hh:02}")),
            Some('I') => out.push_str(&format!("{:02}", if hh % 12 == 0 { 12 } else { hh % 12 })),
            Some('M') => out.push_str(&format!("{mm:02}")),
            Some('S') => out.push_str(&format!("{ss:02}")),
            Some('p') => out.push_str(if hh < 12 { "AM" } else { "PM" }),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 → (year, month 1..12, day 1..31) (Howard Hinnant's `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (if m <= 2 { y + 1 } else { y }, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::Message;

    fn render(src: &str, msgs: &[Message]) -> Result<String> {
        let special = SpecialTokens {
            bos_token: Some("<s>".into()),
            ..Default::default()
        };
        ChatTemplate::new(src, special)?.render(msgs, true)
    }

    #[test]
    fn chatml_fallback() {
        let t = ChatTemplate::chatml(SpecialTokens::default());
        let out = t.render(&[Message::new("user", "Hi")], true).unwrap();
        assert_eq!(
            out,
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn raise_exception_is_an_error_with_the_message() {
        let src = "{% if messages[0].role != 'user' %}{{ raise_exception('Only user first') }}{% endif %}";
        let err = render(src, &[Message::new("system", "x")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("Only user first"), "{err}");
    }

    #[test]
    fn trim_blocks_python_methods_and_bos() {
        let src = "{{ bos_token }}{% for m in messages %}\n  {% if m.content.strip().startswith('a') %}{{ m.content.strip().upper() }}{% endif %}\n{% endfor %}";
        assert_eq!(
            render(src, &[Message::new("user", "  abc ")]).unwrap(),
            "<s>ABC"
        );
    }

    #[test]
    fn loop_controls_and_generation_tags() {
        let src = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{%- generation -%}{{ m.content }}{%- endgeneration -%}{% endfor %}";
        assert_eq!(
            render(src, &[Message::new("user", "a"), Message::new("user", "b")]).unwrap(),
            "a"
        );
    }

    #[test]
    fn tojson_like_python_json_dumps() {
        let v: Value = serde_json::from_str(
            r#"{"b": [1, 2.5, 1e-5, 1e20, true, null], "a": "<q> 'x' & \"y\" café\n"}"#,
        )
        .unwrap();
        let env = {
            let mut e = Environment::new();
            e.add_filter("tojson", |v: Value, kw: Kwargs| tojson(v, kw, 64));
            e
        };
        let out = env
            .render_str("{{ v | tojson }}", minijinja::context! { v => v.clone() })
            .unwrap();
        assert_eq!(
            out,
            r#"{"b": [1, 2.5, 1e-05, 1e+20, true, null], "a": "<q> 'x' & \"y\" café\n"}"#
        );
        let out = env
            .render_str("{{ v | tojson(indent=2) }}", minijinja::context! { v => v })
            .unwrap();
        assert!(out.starts_with("{\n  \"b\": [\n    1,\n    2.5,"), "{out}");
    }

    #[test]
    fn python_float_forms() {
        for (f, s) in [
            (1.0, "1.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (123456.789, "123456.789"),
            (-2.5e16, "-2.5e+16"),
            (1e15, "1000000000000000.0"),
        ] {
            assert_eq!(python_float_repr(f), s);
        }
    }

    #[test]
    fn strftime_known_dates() {
        assert_eq!(
            strftime(0, "%d %b %Y %A %H:%M:%S %j"),
            "01 Jan 1970 Thursday 00:00:00 001"
        );
        // 2024-02-29 12:34:56 UTC
        assert_eq!(
            strftime(1_709_210_096, "%Y-%m-%d %I:%M %p %B %a %j"),
            "2024-02-29 12:34 PM February Thu 060"
        );
    }

    fn limit_error_of(src: &str) -> String {
        let limits = Limits {
            time: Duration::from_secs(2),
            ..Limits::default()
        };
        let t = ChatTemplate::with_limits(src, SpecialTokens::default(), limits).unwrap();
        let started = Instant::now();
        let err = t.render(&[Message::new("user", "hi")], true).unwrap_err();
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "{src}: took {:?}",
            started.elapsed()
        );
        assert!(matches!(err, LlmError::TemplateLimit(_)), "{src}: {err}");
        assert!(t.check_limits().is_err(), "{src}");
        err.to_string()
    }

    #[test]
    fn runaway_templates_stop_at_a_limit() {
        // Nested loops that print nothing: 10^10 iterations without the fuel.
        let e = limit_error_of(
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        );
        assert!(e.contains("fuel") || e.contains("time"), "{e}");
        // Gigabytes of output from string repetition.
        let e = limit_error_of("{% for i in range(100000) %}{{ 'x' * 1000000 }}{% endfor %}");
        assert!(e.contains("output size"), "{e}");
        // A huge indentation would abort on allocation.
        for src in [
            "{{ messages | tojson(indent=100000000000) }}",
            "{{ messages | tojson(indent='x' * 1000) }}",
            "{{ 'a\nb' | indent(100000000000) }}",
            "{{ 'a\nb' | indent(width=100000000000) }}",
        ] {
            let e = limit_error_of(src);
            assert!(
                e.contains("indent above") || e.contains("indent width"),
                "{e}"
            );
        }
        // Unbounded recursion through a macro.
        let e = limit_error_of("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}");
        assert!(e.contains("recursion"), "{e}");
    }

    #[test]
    fn a_deadline_stops_a_slow_render() {
        let limits = Limits {
            time: Duration::from_millis(50),
            fuel: 1 << 40,
            ..Limits::default()
        };
        let src =
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}";
        let t = ChatTemplate::with_limits(src, SpecialTokens::default(), limits).unwrap();
        let err = t.render(&[Message::new("user", "hi")], true).unwrap_err();
        assert!(err.to_string().contains("time limit"), "{err}");
    }

    #[test]
    fn refusals_by_the_template_are_not_limit_failures() {
        let src = "{% if messages[0].role == 'system' %}{{ raise_exception('no system') }}{% endif %}{{ messages[0].content }}";
        let t = ChatTemplate::new(src, SpecialTokens::default()).unwrap();
        t.check_limits().unwrap();
    }

    #[test]
    fn syntax_errors_are_reported() {
        let err = ChatTemplate::new("{% for %}", SpecialTokens::default())
            .err()
            .unwrap();
        assert!(err.to_string().contains("chat template"), "{err}");
    }
}
