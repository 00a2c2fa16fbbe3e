//! GGUF (llama.cpp's model file) reader: header, metadata, tensor infos and dequantization.
//!
//! [`Gguf::parse`] validates the whole layout of untrusted bytes up front (see [`parse`]);
//! [`GgufFile`] maps a file and hands out tensor bytes and f32 dequantizations.

pub mod dequant;
mod parse;
pub mod types;
pub mod value;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

pub use parse::{DEFAULT_ALIGNMENT, MAGIC, MAX_ARRAY_ELEMENTS, MAX_ARRAY_LEN};
pub use types::{GgmlType, ValueType};
pub use value::Value;

/// A malformed GGUF file: where, while reading what, and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{context}, at byte offset {offset}: {message}")]
pub struct GgufError {
    pub offset: u64,
    /// The part being read: "GGUF header", "metadata key 'general.name'", "tensor 'output.weight'".
    pub context: String,
    pub message: String,
}

/// One tensor's description. `dims` are in ggml order (`ne[0]`, the contiguous row length,
/// first); [`TensorInfo::shape`] gives the row-major shape a Hugging Face checkpoint would use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Relative to the start of the data section; a multiple of the alignment.
    pub offset: u64,
    pub nbytes: u64,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Row-major shape (`[out, in]` for a weight matrix): the reverse of ggml's `ne`.
    pub fn shape(&self) -> Vec<u64> {
        self.dims.iter().rev().copied().collect()
    }
}

/// The parsed, validated structure of a GGUF file (no tensor data).
#[derive(Debug, Clone)]
pub struct Gguf {
    pub version: u32,
    /// Metadata in file order.
    pub metadata: Vec<(String, Value)>,
    metadata_index: HashMap<String, usize>,
    /// Tensor infos in file order.
    pub tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    pub alignment: u64,
    /// Absolute file offset of the data section.
    pub data_offset: u64,
}

impl Gguf {
    /// Parses and validates everything but the tensor data itself: every count, length, offset
    /// and tensor extent is checked against `bytes`.
    pub fn parse(bytes: &[u8]) -> Result<Gguf, GgufError> {
        parse::parse(bytes)
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata_index.get(key).map(|&i| &self.metadata[i].1)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// `general.architecture`, if present and a string.
    pub fn architecture(&self) -> Option<&str> {
        self.get("general.architecture").and_then(Value::as_str)
    }
}

/// A GGUF file mapped into memory.
pub struct GgufFile {
    pub path: PathBuf,
    mmap: Mmap,
    pub gguf: Gguf,
}

/// Opening a GGUF file failed.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("{}: {cause}", path.display())]
    Io {
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("{}: {cause}", path.display())]
    Malformed { path: PathBuf, cause: GgufError },
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<GgufFile, OpenError> {
        let io = |cause| OpenError::Io {
            path: path.to_owned(),
            cause,
        };
        let file = cmf_format::regular::open(path).map_err(io)?;
        // SAFETY: the map is read-only; a file truncated under us by another process is outside
        // what any mmap-based reader can defend against, as for the CMF reader.
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        let gguf = Gguf::parse(&mmap).map_err(|cause| OpenError::Malformed {
            path: path.to_owned(),
            cause,
        })?;
        Ok(GgufFile {
            path: path.to_owned(),
            mmap,
            gguf,
        })
    }

    /// The raw bytes of a tensor (bounds were validated by [`Gguf::parse`]).
    pub fn tensor_bytes(&self, t: &TensorInfo) -> &[u8] {
        let start = (self.gguf.data_offset + t.offset) as usize;
        &self.mmap[start..start + t.nbytes as usize]
    }

    /// The tensor decoded to f32, in row-major order of [`TensorInfo::shape`].
    pub fn dequantize(&self, t: &TensorInfo) -> Result<Vec<f32>, String> {
        let n = usize::try_from(t.n_elements())
            .map_err(|_| format!("tensor '{}' is too large", t.name))?;
        let mut out = vec![0f32; n];
        dequant::dequantize(t.ty, self.tensor_bytes(t), &mut out)
            .map_err(|e| format!("tensor '{}': {e}", t.name))?;
        Ok(out)
    }
}
