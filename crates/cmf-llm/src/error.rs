//! Errors of the LLM runtime. Each names the file, tensor, field or token at fault.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum LlmError {
    /// A model-config field is missing, has the wrong type or an unsupported value.
    #[error("model config field `{field}`: {msg}")]
    Config { field: String, msg: String },
    /// The architecture (or one of its features) is not one this runtime implements.
    #[error("unsupported model: {0}")]
    Unsupported(String),
    #[error("tensor `{0}` is missing from the model file")]
    MissingTensor(String),
    #[error("tensor `{name}`: {msg}")]
    Tensor { name: String, msg: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    /// A render went past one of the template limits (fuel, output size, time, recursion).
    #[error("chat template: {0}")]
    TemplateLimit(String),
    /// A render ran its worker out of memory (see `chat::render_worker`).
    #[error("{}", memory_limit_message(origin.as_deref(), *limit_mib))]
    TemplateMemory {
        /// The file the template came from.
        origin: Option<String>,
        limit_mib: u64,
    },
    /// A token id outside the vocabulary (from the caller or a corrupt tokenizer).
    #[error("token id {id} is outside the vocabulary (size {vocab})")]
    TokenOutOfRange { id: u32, vocab: usize },
    /// The sequence would exceed the context the caller allowed.
    #[error("context full: {needed} tokens needed, the limit is {limit}")]
    ContextFull { needed: usize, limit: usize },
    #[error("{0}")]
    Other(String),
}

fn memory_limit_message(origin: Option<&str>, limit_mib: u64) -> String {
    match origin {
        Some(o) => {
            format!("chat template of {o}: render exceeded its memory limit ({limit_mib} MiB)")
        }
        None => format!("chat template: render exceeded its memory limit ({limit_mib} MiB)"),
    }
}

pub type Result<T, E = LlmError> = std::result::Result<T, E>;

pub(crate) fn config_err(field: &str, msg: impl Into<String>) -> LlmError {
    LlmError::Config {
        field: field.to_string(),
        msg: msg.into(),
    }
}
