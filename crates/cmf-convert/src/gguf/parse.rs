//! Parsing of the GGUF header, metadata and tensor infos from untrusted bytes.
//!
//! Layout (github ggml-org/ggml `docs/gguf.md`; llama.cpp `ggml/src/gguf.cpp`, `gguf_init_from_file_impl`):
//! magic `GGUF`, u32 version, u64 tensor_count, u64 kv_count, kv_count × (string key, u32 type,
//! value), tensor_count × (string name, u32 n_dims, u64 ne[n_dims], u32 type, u64 offset), padding
//! to `general.alignment` (default 32), then the data section. Strings are u64 length + UTF-8 bytes.
//!
//! Defensive rules: no allocation is sized by a count before the count has been checked against
//! the bytes left in the file; every read is bounds-checked; every error carries the byte offset
//! and the key or tensor being read.

use std::collections::HashMap;

use super::types::{GgmlType, ValueType};
use super::value::Value;
use super::{Gguf, GgufError, TensorInfo};

pub const MAGIC: &[u8; 4] = b"GGUF";
/// ggml's default when `general.alignment` is absent (`GGUF_DEFAULT_ALIGNMENT`).
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// `GGML_MAX_DIMS`.
pub const MAX_DIMS: u32 = 4;
/// Arrays of arrays are legal GGUF but unused by real models; bound the recursion.
const MAX_ARRAY_DEPTH: usize = 3;
/// Elements of one metadata array, and of all arrays together. Each element is held as a
/// [`Value`] (tens of bytes), so a byte array would cost ~30× its size in memory; real files
/// hold well under a million per array (vocabulary, merges, scores, token types).
pub const MAX_ARRAY_LEN: usize = 1 << 22;
pub const MAX_ARRAY_ELEMENTS: usize = 1 << 23;

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    /// Array elements read so far (bounded by [`MAX_ARRAY_ELEMENTS`]).
    elements: usize,
    /// What is being read, for error messages ("metadata key 'general.name'", "tensor info #3").
    context: String,
}

impl<'a> Cursor<'a> {
    fn err(&self, offset: usize, message: impl Into<String>) -> GgufError {
        GgufError {
            offset: offset as u64,
            context: self.context.clone(),
            message: message.into(),
        }
    }

    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(self.err(
                self.pos,
                format!(
                    "file truncated: {what} needs {n} bytes, {} left",
                    self.remaining()
                ),
            ));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        Ok(self
            .take(N, what)?
            .try_into()
            .expect("take returned N bytes"))
    }

    fn u8(&mut self, what: &str) -> Result<u8, GgufError> {
        Ok(self.array::<1>(what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16, GgufError> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }
    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count of items each at least `min_size` bytes long, checked against the bytes left.
    fn count(&mut self, min_size: usize, what: &str) -> Result<usize, GgufError> {
        let at = self.pos;
        let n = self.u64(what)?;
        let max = (self.remaining() / min_size.max(1)) as u64;
        if n > max {
            return Err(self.err(
                at,
                format!(
                    "{what} = {n} is impossible: the {} bytes left hold at most {max} (file truncated or corrupt)",
                    self.remaining()
                ),
            ));
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let len = self.count(1, &format!("{what} length"))?;
        let at = self.pos;
        let bytes = self.take(len, what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(e) => Err(self.err(at, format!("{what} is not valid UTF-8 ({e})"))),
        }
    }

    fn value_type(&mut self, what: &str) -> Result<ValueType, GgufError> {
        let at = self.pos;
        let id = self.u32(what)?;
        ValueType::from_id(id).ok_or_else(|| self.err(at, format!("unknown {what} id {id}")))
    }

    fn value(&mut self, ty: ValueType, depth: usize) -> Result<Value, GgufError> {
        Ok(match ty {
            ValueType::U8 => Value::U8(self.u8("uint8 value")?),
            ValueType::I8 => Value::I8(self.u8("int8 value")? as i8),
            ValueType::U16 => Value::U16(self.u16("uint16 value")?),
            ValueType::I16 => Value::I16(self.u16("int16 value")? as i16),
            ValueType::U32 => Value::U32(self.u32("uint32 value")?),
            ValueType::I32 => Value::I32(self.u32("int32 value")? as i32),
            ValueType::F32 => Value::F32(f32::from_bits(self.u32("float32 value")?)),
            ValueType::U64 => Value::U64(self.u64("uint64 value")?),
            ValueType::I64 => Value::I64(self.u64("int64 value")? as i64),
            ValueType::F64 => Value::F64(f64::from_bits(self.u64("float64 value")?)),
            ValueType::Bool => {
                let at = self.pos;
                match self.u8("bool value")? {
                    0 => Value::Bool(false),
                    1 => Value::Bool(true),
                    b => return Err(self.err(at, format!("bool value must be 0 or 1, found {b}"))),
                }
            }
            ValueType::String => Value::String(self.string("string value")?),
            ValueType::Array => {
                let at = self.pos;
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(
                        self.err(at, format!("arrays nested deeper than {MAX_ARRAY_DEPTH}"))
                    );
                }
                let elem = self.value_type("array element type")?;
                let n = self.count(elem.min_encoded_size(), "array length")?;
                self.elements += n;
                if n > MAX_ARRAY_LEN || self.elements > MAX_ARRAY_ELEMENTS {
                    return Err(self.err(
                        at,
                        format!(
                            "array of {n} elements is above the limit ({MAX_ARRAY_LEN} per array, \
                             {MAX_ARRAY_ELEMENTS} in all)"
                        ),
                    ));
                }
                let mut items = Vec::with_capacity(n);
                for i in 0..n {
                    let v = self.value(elem, depth + 1).map_err(|mut e| {
                        e.message = format!("array element {i}: {}", e.message);
                        e
                    })?;
                    items.push(v);
                }
                Value::Array(elem, items)
            }
        })
    }
}

fn align_up(x: u64, align: u64) -> Option<u64> {
    x.checked_add(align - 1).map(|v| v / align * align)
}

pub fn parse(buf: &[u8]) -> Result<Gguf, GgufError> {
    let mut c = Cursor {
        buf,
        pos: 0,
        elements: 0,
        context: "GGUF header".into(),
    };
    let magic = c.array::<4>("magic")?;
    if &magic != MAGIC {
        return Err(c.err(
            0,
            format!("not a GGUF file (magic {magic:02x?}, expected \"GGUF\")"),
        ));
    }
    let version = c.u32("version")?;
    match version {
        2 | 3 => {}
        1 => {
            return Err(c.err(
                4,
                "GGUF version 1 (32-bit counts) is not supported; re-convert the model",
            ))
        }
        v if matches!(v.swap_bytes(), 1..=3) => {
            return Err(c.err(4, "big-endian GGUF files are not supported"));
        }
        v => return Err(c.err(4, format!("unsupported GGUF version {v} (supported: 2, 3)"))),
    }
    // Minimum encodings: tensor info = name len 8 + n_dims 4 + type 4 + offset 8;
    // kv = key len 8 + type 4 + 1-byte value.
    let n_tensors_at = c.pos;
    let n_tensors_raw = c.u64("tensor count")?;
    let n_kv = c.count(13, "metadata key/value count")?;

    c.context = "metadata".into();
    let mut metadata: Vec<(String, Value)> = Vec::with_capacity(n_kv);
    let mut index = HashMap::with_capacity(n_kv);
    for i in 0..n_kv {
        c.context = format!("metadata entry #{i}");
        let key_at = c.pos;
        let key = c.string("key")?;
        c.context = format!("metadata key '{key}'");
        if index.contains_key(&key) {
            return Err(c.err(key_at, "duplicate key"));
        }
        let ty = c.value_type("value type")?;
        let value = c.value(ty, 0)?;
        index.insert(key.clone(), metadata.len());
        metadata.push((key, value));
    }

    c.context = "GGUF header".into();
    let max_tensors = (c.remaining() / 24) as u64;
    if n_tensors_raw > max_tensors {
        return Err(c.err(
            n_tensors_at,
            format!(
                "tensor count {n_tensors_raw} is impossible: the rest of the file holds at most {max_tensors} tensor infos (file truncated or corrupt)"
            ),
        ));
    }
    let n_tensors = n_tensors_raw as usize;

    let alignment = match index.get("general.alignment").map(|&i| &metadata[i].1) {
        None => DEFAULT_ALIGNMENT,
        Some(Value::U32(a)) if *a != 0 && a.is_power_of_two() => *a as u64,
        Some(v) => {
            return Err(GgufError {
                offset: 0,
                context: "metadata key 'general.alignment'".into(),
                message: format!(
                    "must be a non-zero power of two of type uint32, found {}",
                    v.summary()
                ),
            })
        }
    };

    struct Raw {
        info: TensorInfo,
        at: usize,
    }
    let mut raw: Vec<Raw> = Vec::with_capacity(n_tensors);
    let mut names = HashMap::with_capacity(n_tensors);
    for i in 0..n_tensors {
        c.context = format!("tensor info #{i}");
        let at = c.pos;
        let name = c.string("tensor name")?;
        c.context = format!("tensor '{name}'");
        if names.insert(name.clone(), i).is_some() {
            return Err(c.err(at, "duplicate tensor name"));
        }
        let dims_at = c.pos;
        let n_dims = c.u32("dimension count")?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(c.err(
                dims_at,
                format!("dimension count {n_dims} outside 1..={MAX_DIMS}"),
            ));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for d in 0..n_dims {
            let dim_at = c.pos;
            let v = c.u64("dimension")?;
            if v > i64::MAX as u64 {
                return Err(c.err(
                    dim_at,
                    format!("dimension {d} = {v} is negative as ggml's int64"),
                ));
            }
            dims.push(v);
        }
        let n_elements = dims
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .filter(|&n| n <= i64::MAX as u64)
            .ok_or_else(|| {
                c.err(
                    dims_at,
                    format!("element count of shape {dims:?} overflows"),
                )
            })?;
        let ty_at = c.pos;
        let ty_id = c.u32("tensor type")?;
        let ty = GgmlType::from_id(ty_id)
            .ok_or_else(|| c.err(ty_at, format!("unknown ggml tensor type id {ty_id}")))?;
        let block = ty.block_size() as u64;
        if dims[0] % block != 0 {
            return Err(c.err(
                dims_at,
                format!(
                    "row length ne[0] = {} is not a multiple of the {ty} block size {block}",
                    dims[0]
                ),
            ));
        }
        let off_at = c.pos;
        let offset = c.u64("data offset")?;
        if offset % alignment != 0 {
            return Err(c.err(
                off_at,
                format!("data offset {offset} is not a multiple of the alignment {alignment}"),
            ));
        }
        let nbytes = ty.nbytes(n_elements).ok_or_else(|| {
            c.err(
                dims_at,
                format!("byte size of shape {dims:?} as {ty} overflows"),
            )
        })?;
        raw.push(Raw {
            info: TensorInfo {
                name,
                dims,
                ty,
                offset,
                nbytes,
            },
            at,
        });
    }

    c.context = "GGUF data section".into();
    let data_offset = align_up(c.pos as u64, alignment).expect("file offsets fit u64");
    let file_len = buf.len() as u64;
    if n_tensors > 0 && data_offset > file_len {
        return Err(c.err(c.pos, format!("file truncated: data section would start at {data_offset}, file is {file_len} bytes")));
    }
    let data_len = file_len.saturating_sub(data_offset);

    // Bounds and overlaps, in data order.
    let mut order: Vec<usize> = (0..raw.len()).collect();
    order.sort_by_key(|&i| raw[i].info.offset);
    let mut prev_end = 0u64;
    let mut prev_name = "";
    for &i in &order {
        let t = &raw[i].info;
        let end = t.offset.checked_add(t.nbytes);
        match end {
            Some(end) if end <= data_len => {}
            _ => {
                return Err(GgufError {
                    offset: raw[i].at as u64,
                    context: format!("tensor '{}'", t.name),
                    message: format!(
                        "data [{}, +{}) runs past the end of the data section ({data_len} bytes; file truncated?)",
                        t.offset, t.nbytes
                    ),
                });
            }
        }
        if t.offset < prev_end {
            return Err(GgufError {
                offset: raw[i].at as u64,
                context: format!("tensor '{}'", t.name),
                message: format!(
                    "data at {} overlaps tensor '{prev_name}' (ends at {prev_end})",
                    t.offset
                ),
            });
        }
        prev_end = t.offset + t.nbytes;
        prev_name = &t.name;
    }

    let tensors: Vec<TensorInfo> = raw.into_iter().map(|r| r.info).collect();
    Ok(Gguf {
        version,
        metadata,
        metadata_index: index,
        tensors,
        tensor_index: names,
        alignment,
        data_offset,
    })
}
