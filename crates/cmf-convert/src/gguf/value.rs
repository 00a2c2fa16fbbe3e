//! A GGUF metadata value and typed accessors.

use super::types::ValueType;

#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    U64(u64),
    I64(i64),
    F64(f64),
    /// Element type and elements (all of that type).
    Array(ValueType, Vec<Value>),
}

impl Value {
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
            Value::Array(..) => ValueType::Array,
        }
    }

    /// Any integer type as i128 (so that every GGUF integer fits), `None` for other types.
    pub fn as_int(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(v) => v as i128,
            Value::I8(v) => v as i128,
            Value::U16(v) => v as i128,
            Value::I16(v) => v as i128,
            Value::U32(v) => v as i128,
            Value::I32(v) => v as i128,
            Value::U64(v) => v as i128,
            Value::I64(v) => v as i128,
            _ => return None,
        })
    }

    /// A non-negative integer that fits `u64`.
    pub fn as_u64(&self) -> Option<u64> {
        self.as_int().and_then(|v| u64::try_from(v).ok())
    }

    /// A float, or an integer read as a float (writers differ on e.g. `rope.freq_base`).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_int().map(|v| v as f64),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<(ValueType, &[Value])> {
        match self {
            Value::Array(t, v) => Some((*t, v)),
            _ => None,
        }
    }

    /// A short human-readable rendering for `cmf info`-style listings (arrays summarised).
    pub fn summary(&self) -> String {
        match self {
            Value::String(s) if s.chars().count() > 60 => {
                format!("{:?}…", s.chars().take(60).collect::<String>())
            }
            Value::String(s) => format!("{s:?}"),
            Value::Array(t, v) => format!("[{} × {}]", v.len(), t.name()),
            Value::Bool(b) => b.to_string(),
            Value::F32(v) => v.to_string(),
            Value::F64(v) => v.to_string(),
            other => other.as_int().map(|i| i.to_string()).unwrap_or_default(),
        }
    }
}
