//! Typed errors of the Z-Image runtime; each names the file, tensor, field or flag at fault.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ZimageError {
    /// The file opened but is not a Z-Image pack (wrong `arch_name`, missing parts).
    #[error("{origin}: not a Z-Image pack: {why}")]
    NotZimage { origin: String, why: String },
    /// A tensor is missing or has the wrong shape/codec.
    #[error("{origin}: tensor `{name}`: {why}")]
    Tensor {
        origin: String,
        name: String,
        why: String,
    },
    /// A config blob field is missing or unsupported.
    #[error("{origin}: `{blob}` field `{field}`: {why}")]
    Config {
        origin: String,
        blob: String,
        field: String,
        why: String,
    },
    /// A request the pipeline cannot run (bad size, zero steps, …); `flag` names the option.
    #[error("{flag}: {why}")]
    Request { flag: String, why: String },
    /// The tokenizer could not be loaded or failed on the prompt.
    #[error("{origin}: tokenizer: {why}")]
    Tokenizer { origin: String, why: String },
    /// Initial latents could not be read.
    #[error("{path}: latents: {why}")]
    Latents { path: PathBuf, why: String },
    /// The image could not be written.
    #[error("{path}: {why}")]
    Output { path: PathBuf, why: String },
    /// The run produced non-finite values (a corrupt file or an overflow).
    #[error("{stage}: the result is not finite ({why})")]
    NonFinite { stage: String, why: String },
}

impl ZimageError {
    pub fn request(flag: &str, why: impl Into<String>) -> Self {
        ZimageError::Request {
            flag: flag.to_string(),
            why: why.into(),
        }
    }
}
