//! Errors of the importers. Every variant names the file, field, key or tensor at fault.

use std::path::PathBuf;

use crate::gguf::OpenError;
use crate::import_gguf::tokenizer::TokenizerError;

#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    // The cause is part of the message (not a `#[source]`), so a printed error chain does not
    // repeat it.
    #[error("{}: {cause}", path.display())]
    Io {
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("{}: invalid JSON: {cause}", path.display())]
    Json {
        path: PathBuf,
        cause: serde_json::Error,
    },
    /// A required field is missing or has the wrong type/value (config.json, tokenizer_config.json,
    /// GGUF metadata key, ...).
    #[error("{}: field '{field}': {message}", file.display())]
    Field {
        file: PathBuf,
        field: String,
        message: String,
    },
    /// Valid input that this converter does not handle (architecture, tensor type, ...).
    #[error("{}: {message}", file.display())]
    Unsupported { file: PathBuf, message: String },
    /// A tensor is missing, has the wrong shape or dtype, or cannot be decoded.
    #[error("{}: tensor '{tensor}': {message}", file.display())]
    Tensor {
        file: PathBuf,
        tensor: String,
        message: String,
    },
    #[error(transparent)]
    Gguf(#[from] OpenError),
    #[error("{}: {cause}", file.display())]
    GgufTokenizer {
        file: PathBuf,
        cause: TokenizerError,
    },
    /// The CMF writer refused or failed (it names the output file).
    #[error(transparent)]
    Format(#[from] cmf_format::Error),
    /// The tokenizer or chat template cannot be loaded or run (the message names the source).
    #[error("{message}")]
    Text { message: String },
    /// A command-line option is invalid (`--quant`, `--preset`, ...).
    #[error("{flag}: {message}")]
    Option { flag: String, message: String },
}

impl ConvertError {
    pub fn field(
        file: impl Into<PathBuf>,
        field: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        ConvertError::Field {
            file: file.into(),
            field: field.into(),
            message: message.into(),
        }
    }

    pub fn tensor(
        file: impl Into<PathBuf>,
        tensor: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        ConvertError::Tensor {
            file: file.into(),
            tensor: tensor.into(),
            message: message.into(),
        }
    }

    pub fn unsupported(file: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        ConvertError::Unsupported {
            file: file.into(),
            message: message.into(),
        }
    }

    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ConvertError::Io {
            path: path.into(),
            cause: source,
        }
    }

    /// Whether the fault is in the input (exit code 2 in the CLI) rather than in the
    /// environment (I/O, exit code 1).
    pub fn is_bad_input(&self) -> bool {
        !matches!(
            self,
            ConvertError::Io { .. } | ConvertError::Gguf(OpenError::Io { .. })
        )
    }
}

pub type Result<T, E = ConvertError> = std::result::Result<T, E>;
