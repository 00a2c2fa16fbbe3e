//! The LLM runtime: Llama / Mistral / Qwen2 / Qwen3 decoders over CMF files, tokenizer and chat
//! templates, sampling, streaming generation, benchmark and perplexity drivers.
//!
//! Layout:
//! - [`model`]: config from the header, weights bound in place from the mmap, KV cache, forward.

pub mod error;
pub mod model;

pub use error::{LlmError, Result};
pub use model::{Model, ModelConfig, State, TensorRef, TensorSource};
