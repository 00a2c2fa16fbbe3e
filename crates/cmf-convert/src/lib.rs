//! Importers into CMF: Hugging Face safetensors directories ([`hf`]), GGUF files
//! ([`import_gguf`], on top of the GGUF reader [`gguf`]), and random-weight benchmark models
//! ([`synth`]). All write through `cmf_format::CmfWriter` (temp file + rename) one chunk of rows
//! at a time ([`emit`]).

pub mod emit;
pub mod error;
pub mod fuzzing;
pub mod gguf;
pub mod hf;
pub mod import_gguf;
pub mod progress;
pub mod quant;
pub mod synth;
pub mod text_check;
pub mod zimage;

use std::path::{Path, PathBuf};

use cmf_format::Dtype;

pub use emit::TensorStats;
pub use error::{ConvertError, Result};
pub use progress::{Progress, Silent};
pub use quant::Quant;

/// How provenance names a source: its file or directory name (of the canonical path, so `.`
/// names the directory), never the absolute path, which would disclose where the converter
/// keeps its files to everyone the model is shared with.
pub fn source_name(path: &Path) -> String {
    let canonical = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
    canonical
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Options shared by the importers.
pub struct Options<'a> {
    /// `None`: the importer's default (HF: q8; GGUF: per source type, see [`import_gguf`]).
    pub quant: Option<Quant>,
    /// Decode every encoded chunk again and sum the error against the source values.
    pub measure_error: bool,
    pub progress: &'a dyn Progress,
}

impl Default for Options<'_> {
    fn default() -> Self {
        Options {
            quant: None,
            measure_error: false,
            progress: &Silent,
        }
    }
}

/// What an import wrote.
#[derive(Debug, Clone)]
pub struct Report {
    pub output: PathBuf,
    /// (CMF tensor name, codec, stats) in file order.
    pub tensors: Vec<(String, Dtype, TensorStats)>,
    pub total: TensorStats,
    /// Notes worth showing the user (dropped tensors, codec fallbacks).
    pub notes: Vec<String>,
}
