//! What travels between the parent and a render worker over the worker's stdin/stdout: frames of
//! a little-endian `u32` length and a payload. The first frame to the worker is a [`Hello`] (its
//! memory limit), then one [`Request`] (JSON) per render, each answered by one [`Reply`] (a tag
//! byte and UTF-8 text, so a 16 MiB rendering is not escaped and parsed again).
//!
//! Template values are sent as a flat list of [`Token`]s rather than as JSON values: minijinja's
//! kinds (undefined vs none, safe strings, integer widths, non-string keys) and the exact bits of
//! every float arrive unchanged, so a render in the worker equals one in the process, and nesting
//! depth does not meet the JSON parser's recursion limit.

use std::borrow::Cow;
use std::io::{self, Read, Write};

use minijinja::value::{Value, ValueKind};
use serde::{Deserialize, Serialize};

use crate::chat::template::{Limits, SpecialTokens};

/// The worker's set-up, sent once after it starts.
#[derive(Debug, Serialize, Deserialize)]
pub struct Hello {
    /// Bytes of address space the worker may use.
    pub memory_limit: u64,
}

/// One render: the template (as compiled by [`crate::chat::ChatTemplate::with_limits`]) and its
/// variables, each value a token list.
#[derive(Debug, Serialize, Deserialize)]
pub struct Request<'a> {
    pub source: Cow<'a, str>,
    pub special: Cow<'a, SpecialTokens>,
    pub limits: Limits,
    pub messages: Vec<Token>,
    pub tools: Option<Vec<Token>>,
    pub kwargs: Vec<(String, Vec<Token>)>,
    pub add_generation_prompt: bool,
}

/// The answer to one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Rendered(String),
    /// An error of the template (syntax, `raise_exception`, a type error).
    Template(String),
    /// A render past one of the [`Limits`].
    Limit(String),
}

const RENDERED: u8 = 0;
const TEMPLATE: u8 = 1;
const LIMIT: u8 = 2;

impl Reply {
    pub fn write(&self, out: &mut impl Write) -> io::Result<()> {
        let (tag, text) = match self {
            Reply::Rendered(t) => (RENDERED, t),
            Reply::Template(t) => (TEMPLATE, t),
            Reply::Limit(t) => (LIMIT, t),
        };
        let len = u32::try_from(text.len() + 1)
            .map_err(|_| io::Error::other("reply larger than 4 GiB"))?;
        out.write_all(&len.to_le_bytes())?;
        out.write_all(&[tag])?;
        out.write_all(text.as_bytes())?;
        out.flush()
    }

    pub fn parse(frame: Vec<u8>) -> io::Result<Reply> {
        let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, what.to_string());
        let (&tag, text) = frame.split_first().ok_or_else(|| bad("empty reply"))?;
        let text = String::from_utf8(text.to_vec()).map_err(|_| bad("reply is not UTF-8"))?;
        match tag {
            RENDERED => Ok(Reply::Rendered(text)),
            TEMPLATE => Ok(Reply::Template(text)),
            LIMIT => Ok(Reply::Limit(text)),
            _ => Err(bad("unknown reply tag")),
        }
    }
}

pub fn write_frame(out: &mut impl Write, payload: &[u8]) -> io::Result<()> {
    let len =
        u32::try_from(payload.len()).map_err(|_| io::Error::other("request larger than 4 GiB"))?;
    out.write_all(&len.to_le_bytes())?;
    out.write_all(payload)?;
    out.flush()
}

/// The next frame, `None` at a clean end of stream; a frame over `max` bytes is an error.
pub fn read_frame(input: &mut impl Read, max: u64) -> io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 4];
    match input.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_le_bytes(len) as u64;
    if len > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {len} bytes is over the {max}-byte bound"),
        ));
    }
    let mut buf = Vec::with_capacity(len as usize);
    input.take(len).read_to_end(&mut buf)?;
    if buf.len() as u64 != len {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(Some(buf))
}

/// One node of a value in pre-order; `Seq` and `Map` give how many items (map: key, value pairs)
/// follow.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Token {
    Undefined,
    None,
    Bool(bool),
    Int(i64),
    /// Integers outside `i64` (u64, i128, u128), in decimal.
    BigInt(String),
    /// An `f64`'s bits.
    Float(u64),
    Str(String),
    SafeStr(String),
    Bytes(Vec<u8>),
    Seq(usize),
    Map(usize),
}

/// `v` as tokens; functions and custom objects cannot be sent (the error names the kind).
pub fn encode(v: &Value, out: &mut Vec<Token>) -> Result<(), String> {
    let token = match v.kind() {
        ValueKind::Undefined => Token::Undefined,
        ValueKind::None => Token::None,
        ValueKind::Bool => Token::Bool(v.is_true()),
        ValueKind::Number if v.is_integer() => match i64::try_from(v.clone()) {
            Ok(i) => Token::Int(i),
            Err(_) => Token::BigInt(v.to_string()),
        },
        ValueKind::Number => Token::Float(
            f64::try_from(v.clone())
                .map_err(|e| e.to_string())?
                .to_bits(),
        ),
        ValueKind::String if v.is_safe() => Token::SafeStr(v.as_str().unwrap_or("").into()),
        ValueKind::String => Token::Str(v.as_str().unwrap_or("").into()),
        ValueKind::Bytes => Token::Bytes(v.as_bytes().unwrap_or(&[]).to_vec()),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter().map_err(|e| e.to_string())?.collect();
            out.push(Token::Seq(items.len()));
            return items.iter().try_for_each(|i| encode(i, out));
        }
        ValueKind::Map => {
            let keys: Vec<Value> = v.try_iter().map_err(|e| e.to_string())?.collect();
            out.push(Token::Map(keys.len()));
            for k in keys {
                let item = v.get_item(&k).map_err(|e| e.to_string())?;
                encode(&k, out)?;
                encode(&item, out)?;
            }
            return Ok(());
        }
        other => {
            return Err(format!(
                "a {other} value cannot be sent to the render worker"
            ))
        }
    };
    out.push(token);
    Ok(())
}

/// The value `tokens` encode (all of them: trailing tokens are an error).
pub fn decode(tokens: Vec<Token>) -> Result<Value, String> {
    let mut it = tokens.into_iter();
    let v = decode_one(&mut it)?;
    match it.next() {
        None => Ok(v),
        Some(_) => Err("tokens left over after the value".into()),
    }
}

fn decode_one(it: &mut std::vec::IntoIter<Token>) -> Result<Value, String> {
    let token = it.next().ok_or("the value's tokens end early")?;
    Ok(match token {
        Token::Undefined => Value::UNDEFINED,
        Token::None => Value::from(()),
        Token::Bool(b) => Value::from(b),
        Token::Int(i) => Value::from(i),
        Token::BigInt(s) => match (s.parse::<u64>(), s.parse::<i128>(), s.parse::<u128>()) {
            (Ok(u), _, _) => Value::from(u),
            (_, Ok(i), _) => Value::from(i),
            (_, _, Ok(u)) => Value::from(u),
            _ => return Err(format!("{s:?} is not an integer")),
        },
        Token::Float(bits) => Value::from(f64::from_bits(bits)),
        Token::Str(s) => Value::from(s),
        Token::SafeStr(s) => Value::from_safe_string(s),
        Token::Bytes(b) => Value::from_bytes(b),
        Token::Seq(n) => {
            let items = (0..n)
                .map(|_| decode_one(it))
                .collect::<Result<Vec<_>, _>>()?;
            Value::from(items)
        }
        Token::Map(n) => {
            let pairs = (0..n)
                .map(|_| Ok((decode_one(it)?, decode_one(it)?)))
                .collect::<Result<Vec<_>, String>>()?;
            Value::from_iter(pairs)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(v: &Value) -> Value {
        let mut t = Vec::new();
        encode(v, &mut t).unwrap();
        let json = serde_json::to_vec(&t).unwrap();
        decode(serde_json::from_slice(&json).unwrap()).unwrap()
    }

    #[test]
    fn values_cross_unchanged() {
        let v: Value = serde_json::from_str(
            r#"{"z": [1, -2, 18446744073709551615, 0.30000000000000004, 1e-300, true, null],
                "a": {"nested": [[[]]], "s": "café\u0000"}}"#,
        )
        .unwrap();
        let back = round_trip(&v);
        assert_eq!(back, v);
        assert_eq!(back.to_string(), v.to_string()); // key order included
        let kinds = Value::from_iter([
            (Value::from(1), Value::UNDEFINED),
            (Value::from("safe"), Value::from_safe_string("<b>".into())),
            (Value::from("bytes"), Value::from_bytes(vec![0, 255])),
            (Value::from("big"), Value::from(-(1i128 << 100))),
        ]);
        let back = round_trip(&kinds);
        assert!(back.get_item(&Value::from(1)).unwrap().is_undefined());
        assert!(back.get_attr("safe").unwrap().is_safe());
        assert_eq!(
            back.get_attr("bytes").unwrap().as_bytes(),
            Some(&[0, 255][..])
        );
        assert_eq!(back.get_attr("big").unwrap(), Value::from(-(1i128 << 100)));
    }

    #[test]
    fn frames_are_bounded() {
        let mut buf = Vec::new();
        write_frame(&mut buf, b"hello").unwrap();
        assert_eq!(read_frame(&mut &buf[..], 5).unwrap().unwrap(), b"hello");
        assert!(read_frame(&mut &buf[..], 4).is_err());
        assert!(read_frame(&mut &buf[..3], 5).unwrap().is_none());
        assert!(read_frame(&mut &buf[..6], 5).is_err());
        let mut buf = Vec::new();
        Reply::Limit("x".into()).write(&mut buf).unwrap();
        let frame = read_frame(&mut &buf[..], 10).unwrap().unwrap();
        assert_eq!(Reply::parse(frame).unwrap(), Reply::Limit("x".into()));
    }
}
