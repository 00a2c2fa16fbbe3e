//! Test helpers: the committed transformers fixtures (`fixtures/llm/*`) read without Python.
#![allow(dead_code)]

use cmf_format::Dtype;
use cmf_llm::{TensorRef, TensorSource};
use safetensors::SafeTensors;
use serde_json::Value;
use std::path::PathBuf;

pub const FIXTURES: [&str; 4] = ["llama-tiny", "mistral-tiny", "qwen2-tiny", "qwen3-tiny"];

pub fn fixture_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/llm")
        .join(name)
}

pub fn read_json(path: PathBuf) -> Value {
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The safetensors files of a Hugging Face model directory (single file or sharded).
pub fn read_weight_files(dir: &std::path::Path) -> Vec<Vec<u8>> {
    let single = dir.join("model.safetensors");
    if single.exists() {
        return vec![std::fs::read(single).unwrap()];
    }
    let index = read_json(dir.join("model.safetensors.index.json"));
    let mut files: Vec<String> = index["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    files.sort();
    files.dedup();
    files
        .iter()
        .map(|f| std::fs::read(dir.join(f)).unwrap())
        .collect()
}

/// Tensors straight from safetensors files (f32/f16/bf16), as a [`TensorSource`].
pub struct SafetensorsSource<'a>(pub Vec<SafeTensors<'a>>);

impl<'a> SafetensorsSource<'a> {
    pub fn new(files: &'a [Vec<u8>]) -> Self {
        SafetensorsSource(
            files
                .iter()
                .map(|b| SafeTensors::deserialize(b).unwrap())
                .collect(),
        )
    }
}

impl<'a> TensorSource<'a> for SafetensorsSource<'a> {
    fn tensor(&self, name: &str) -> Option<TensorRef<'a>> {
        let t = self.0.iter().find_map(|s| s.tensor(name).ok())?;
        let dtype = match t.dtype() {
            safetensors::Dtype::F32 => Dtype::F32,
            safetensors::Dtype::F16 => Dtype::F16,
            safetensors::Dtype::BF16 => Dtype::Bf16,
            other => panic!("{name}: unexpected dtype {other:?}"),
        };
        Some(TensorRef {
            dtype,
            shape: t.shape().to_vec(),
            data: t.data(),
        })
    }
}

/// A `[rows, cols]` f32 tensor of `expected.safetensors`.
pub fn expected_matrix(dir: &std::path::Path, name: &str) -> (Vec<f32>, usize) {
    let bytes = std::fs::read(dir.join("expected.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(name).unwrap();
    assert_eq!(t.dtype(), safetensors::Dtype::F32);
    let v = t
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    (v, t.shape()[1])
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// max |a − b| / max |b| — the per-row relative error the fixtures README prescribes.
pub fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    let num = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    let den = b.iter().map(|y| y.abs()).fold(0f32, f32::max);
    num / den
}

pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}
