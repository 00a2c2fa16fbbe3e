//! A Hugging Face safetensors checkpoint, single file or sharded, read from mmaps.
//!
//! Files: `model.safetensors.index.json` (its `weight_map` names the shards) or else
//! `model.safetensors`. Other `*.safetensors` files in the directory are not weights (e.g. test
//! outputs) and are ignored. Headers are parsed and validated by the `safetensors` crate
//! (bounded header size, offsets within the file, no overlaps); tensor data stays in the map.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::{Dtype as StDtype, SafeTensors};
use serde_json::Value;

use crate::error::{ConvertError, Result};

/// One tensor: which shard, where its bytes are, element type and shape.
#[derive(Debug, Clone)]
pub struct StTensor {
    pub shard: usize,
    pub dtype: SourceDtype,
    pub shape: Vec<usize>,
    /// Absolute byte range in the shard file.
    pub start: usize,
    pub end: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceDtype {
    F32,
    F16,
    Bf16,
}

impl SourceDtype {
    pub fn name(self) -> &'static str {
        match self {
            SourceDtype::F32 => "f32",
            SourceDtype::F16 => "f16",
            SourceDtype::Bf16 => "bf16",
        }
    }

    fn size(self) -> usize {
        match self {
            SourceDtype::F32 => 4,
            SourceDtype::F16 | SourceDtype::Bf16 => 2,
        }
    }
}

pub struct Checkpoint {
    pub files: Vec<PathBuf>,
    maps: Vec<Mmap>,
    /// Sorted by name, for a deterministic output order.
    pub tensors: BTreeMap<String, StTensor>,
}

impl Checkpoint {
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        let index = dir.join("model.safetensors.index.json");
        let files = if index.is_file() {
            shards_from_index(&index)?
                .into_iter()
                .map(|f| dir.join(f))
                .collect()
        } else {
            let single = dir.join("model.safetensors");
            if !single.is_file() {
                return Err(ConvertError::unsupported(
                    dir,
                    "no model.safetensors or model.safetensors.index.json (only safetensors checkpoints are supported)",
                ));
            }
            vec![single]
        };
        let mut maps = Vec::with_capacity(files.len());
        let mut tensors = BTreeMap::new();
        for (shard, path) in files.iter().enumerate() {
            let file = cmf_format::regular::open(path).map_err(|e| ConvertError::io(path, e))?;
            // SAFETY: read-only map; the converter does not defend against the file being
            // truncated by another process while it runs (no mmap reader can).
            let map = unsafe { Mmap::map(&file) }.map_err(|e| ConvertError::io(path, e))?;
            let (header_len, meta) = SafeTensors::read_metadata(&map).map_err(|e| {
                ConvertError::unsupported(path, format!("not a valid safetensors file: {e}"))
            })?;
            let data_start = 8 + header_len;
            for (name, info) in meta.tensors() {
                let dtype = match info.dtype {
                    StDtype::F32 => SourceDtype::F32,
                    StDtype::F16 => SourceDtype::F16,
                    StDtype::BF16 => SourceDtype::Bf16,
                    other => {
                        return Err(ConvertError::tensor(
                            path,
                            name,
                            format!("dtype {other:?} is not supported (f32, f16, bf16)"),
                        ))
                    }
                };
                let t = StTensor {
                    shard,
                    dtype,
                    shape: info.shape.clone(),
                    start: data_start + info.data_offsets.0,
                    end: data_start + info.data_offsets.1,
                };
                if let Some(prev) = tensors.insert(name.clone(), t) {
                    return Err(ConvertError::tensor(
                        path,
                        &name,
                        format!("also present in {}", files[prev.shard].display()),
                    ));
                }
            }
            maps.push(map);
        }
        Ok(Checkpoint {
            files,
            maps,
            tensors,
        })
    }

    pub fn get(&self, name: &str) -> Option<&StTensor> {
        self.tensors.get(name)
    }

    pub fn file_of(&self, t: &StTensor) -> &Path {
        &self.files[t.shard]
    }

    /// Drops the tensor's pages from this process's resident set once it has been written, so
    /// that peak RSS stays at about one tensor rather than growing to the whole checkpoint (the
    /// pages stay in the page cache; a later read maps them again).
    pub fn release(&self, t: &StTensor) {
        const PAGE: usize = 4096;
        let map = &self.maps[t.shard];
        let start = t.start / PAGE * PAGE;
        let end = t.end.min(map.len());
        if end > start {
            // SAFETY: MADV_DONTNEED on a read-only, file-backed shared mapping only drops pages
            // that are re-read from the file on the next access; no data is lost and no
            // reference into the map is invalidated.
            let _ = unsafe {
                map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start)
            };
        }
    }

    pub fn bytes(&self, t: &StTensor) -> &[u8] {
        &self.maps[t.shard][t.start..t.end]
    }

    /// Elements `e0..e0 + out.len()` of the tensor, widened to f32 (exact for every source type).
    pub fn read_f32(&self, t: &StTensor, e0: usize, out: &mut [f32]) {
        let sz = t.dtype.size();
        let b = &self.bytes(t)[e0 * sz..(e0 + out.len()) * sz];
        match t.dtype {
            SourceDtype::F32 => {
                for (o, c) in out.iter_mut().zip(b.chunks_exact(4)) {
                    *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            SourceDtype::F16 => {
                for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
                    *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
                }
            }
            SourceDtype::Bf16 => {
                for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
                    *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
                }
            }
        }
    }
}

/// The distinct shard file names of an index, in first-appearance order of sorted tensor names.
fn shards_from_index(index: &Path) -> Result<Vec<String>> {
    let text =
        cmf_format::regular::read_to_string(index).map_err(|e| ConvertError::io(index, e))?;
    let json: Value = serde_json::from_str(&text).map_err(|cause| ConvertError::Json {
        path: index.into(),
        cause,
    })?;
    let map = json
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| ConvertError::field(index, "weight_map", "missing or not an object"))?;
    let mut files: Vec<String> = Vec::new();
    for (tensor, file) in map {
        let f = file.as_str().ok_or_else(|| {
            ConvertError::field(
                index,
                format!("weight_map.{tensor}"),
                "expected a file name",
            )
        })?;
        if f.contains('/') || f.contains('\\') || f.starts_with('.') {
            return Err(ConvertError::field(
                index,
                format!("weight_map.{tensor}"),
                format!("unsafe file name {f:?}"),
            ));
        }
        if !files.iter().any(|x| x == f) {
            files.push(f.to_owned());
        }
    }
    files.sort();
    Ok(files)
}
