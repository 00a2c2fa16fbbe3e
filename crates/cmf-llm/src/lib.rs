//! The LLM runtime: Llama / Mistral / Qwen2 / Qwen3 decoders over CMF files, tokenizer and chat
//! templates, sampling, streaming generation, benchmark and perplexity drivers.
//!
//! Layout:
//! - [`model`]: config from the header, weights bound in place from the mmap, KV cache, forward.
//! - [`chat`]: tokenizer, chat templates, streaming detokenization, multi-turn sessions.
//! - [`sampling`]: logits → next token (greedy, temperature, top-k/p, min-p, penalties, seed).
//! - [`engine`]: the `Engine` trait the loop drives (CPU: `CpuEngine`; a GPU backend plugs in here).
//! - [`generate`]: the prefill/decode loop with stop conditions and timings; [`guided`]: the same
//!   loop with logit processors ([`logits`], [`constraint`]) and log-probabilities.
//! - [`gpu`]: the hook that runs that loop's forward passes through cmf-gpu when a device holds the model.
//! - [`batch`]: many sequences at once: paged KV cache, prefix reuse, batched step, scheduler.
//! - [`bench`], [`perplexity`]: llama-bench's pp/tg contract and llama-perplexity's method.

pub mod batch;
pub mod bench;
pub mod chat;
pub mod constraint;
pub mod engine;
pub mod error;
pub mod fuzzing;
pub mod generate;
pub mod gpu;
pub mod guided;
pub mod logits;
pub mod model;
pub mod perplexity;
pub mod profile;
pub mod sampling;

pub use error::{LlmError, Result};
pub use model::{Model, ModelConfig, State, TensorRef, TensorSource};
