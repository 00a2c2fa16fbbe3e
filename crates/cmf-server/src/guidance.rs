//! What constrained decoding and tool calling need from the model file: the tokenizer's
//! vocabulary compiled for llguidance (built on the first request that needs it: a pass over the
//! vocabulary that plain requests should not pay for at start-up) and the tool-call format of
//! the chat template.

use crate::error::ApiError;
use crate::tools::ToolFormat;
use cmf_format::CmfModel;
use cmf_llm::chat::TextAssets;
use cmf_llm::constraint::{Constrained, Grammar, Grammars};
use std::sync::OnceLock;

pub struct Guidance {
    tokenizer_json: Vec<u8>,
    eos_ids: Vec<u32>,
    n_vocab: usize,
    grammars: OnceLock<Result<Grammars, String>>,
    pub tool_format: ToolFormat,
}

impl Guidance {
    pub fn new(file: &CmfModel, assets: &TextAssets, n_vocab: usize) -> Guidance {
        let template = file
            .header()
            .tokenizer_config
            .as_ref()
            .and_then(|c| c.chat_template.clone())
            .unwrap_or_default();
        Guidance {
            tokenizer_json: file.vocab().map(<[u8]>::to_vec).unwrap_or_default(),
            eos_ids: assets.eos_ids.clone(),
            n_vocab,
            grammars: OnceLock::new(),
            tool_format: ToolFormat::detect(&template),
        }
    }

    /// A fresh constraint for `grammar`; a grammar that does not compile is the client's
    /// `param` to fix.
    pub fn constrain(&self, grammar: &Grammar, param: &str) -> Result<Constrained, ApiError> {
        let grammars = self
            .grammars
            .get_or_init(|| {
                Grammars::new(&self.tokenizer_json, &self.eos_ids, self.n_vocab)
                    .map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|e| ApiError::internal(e.clone()))?;
        grammars
            .constrain(grammar)
            .map_err(|e| ApiError::field(param, e))
    }
}
