//! Importers into CMF: Hugging Face safetensors directories, GGUF files, and random-weight
//! `synth` presets for benchmarks.

pub mod gguf;
pub mod zimage;
