//! The tokenizer and chat template an importer is about to write, loaded the way `cmf run` will
//! load them (inside the tokenizer's panic guard, the template rendered under its limits), so a
//! file that could never run is refused before it is written.

use std::path::Path;

use cmf_format::TokenizerConfig;

use crate::error::{ConvertError, Result};

/// `source` is the file or directory the assets come from, named in the error.
pub fn check(source: &Path, tokenizer_json: &[u8], cfg: &TokenizerConfig) -> Result<()> {
    cmf_llm::chat::TextAssets::from_parts(&source.display().to_string(), tokenizer_json, cfg)
        .map(drop)
        .map_err(|e| ConvertError::Text {
            message: e.to_string(),
        })
}
