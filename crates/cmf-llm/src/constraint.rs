//! Grammar-constrained decoding through `llguidance` (the matcher llama.cpp and mistral.rs use):
//! JSON schemas, Lark grammars and regexes compiled against the model's vocabulary, and a
//! [`LogitProcessor`] that masks every token that would break the grammar.
//!
//! [`Grammars`] is built once per tokenizer (the token trie costs a pass over the vocabulary);
//! each generation gets a fresh [`Constrained`] from it.

use crate::error::{LlmError, Result};
use crate::logits::LogitProcessor;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::SimpleVob;
use llguidance::{Matcher, ParserFactory};
use std::sync::Arc;

/// What a generation must match.
#[derive(Debug, Clone, PartialEq)]
pub enum Grammar {
    /// Any JSON value valid against this JSON schema.
    JsonSchema(serde_json::Value),
    /// A grammar in llguidance's Lark dialect (which may embed `%json { schema }`).
    Lark(String),
}

/// The compiled vocabulary, shared by every constraint on one tokenizer.
#[derive(Clone)]
pub struct Grammars {
    factory: Arc<ParserFactory>,
}

impl Grammars {
    /// Builds the token trie of a tokenizer from its `tokenizer.json` bytes. `eos_ids` end a
    /// generation (allowed where the grammar is complete); `n_vocab` is the model's logit count.
    pub fn new(tokenizer_json: &[u8], eos_ids: &[u32], n_vocab: usize) -> Result<Grammars> {
        fn err(e: impl std::fmt::Display) -> LlmError {
            LlmError::Other(format!("grammar support: {e}"))
        }
        let mut bt =
            toktrie_hf_tokenizers::ByteTokenizer::from_json_bytes(tokenizer_json).map_err(err)?;
        if !eos_ids.is_empty() {
            bt.set_eos_tokens(eos_ids);
        }
        let n_tok = bt.token_bytes().len();
        let env = bt.into_tok_env(Some(n_vocab.max(n_tok))).map_err(err)?;
        let mut factory = ParserFactory::new_simple(&env).map_err(err)?;
        factory.quiet();
        Ok(Grammars {
            factory: Arc::new(factory),
        })
    }

    /// A fresh constraint for one generation; an invalid schema or grammar is an error that
    /// says why.
    pub fn constrain(&self, grammar: &Grammar) -> Result<Constrained> {
        let top = match grammar {
            Grammar::JsonSchema(s) => TopLevelGrammar::from_json_schema(bounded_whitespace(s)),
            Grammar::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        };
        let parser = self
            .factory
            .create_parser(top)
            .map_err(|e| LlmError::Other(format!("invalid grammar: {e}")))?;
        Ok(Constrained {
            matcher: Matcher::new(Ok(parser)),
            mask: None,
        })
    }
}

/// Whitespace between JSON tokens, bounded: llguidance's default allows any run of it, and a
/// model that keeps choosing newlines would never finish the value. Forty characters still fit
/// pretty-printed JSON several levels deep. A schema's own `x-guidance` options win.
pub const JSON_WHITESPACE: &str = r"[\x20\x0A\x0D\x09]{1,40}";

/// `schema` with [`JSON_WHITESPACE`] unless it sets its own llguidance options.
pub fn bounded_whitespace(schema: &serde_json::Value) -> serde_json::Value {
    let mut s = schema.clone();
    if let Some(o) = s.as_object_mut() {
        o.entry("x-guidance")
            .or_insert_with(|| serde_json::json!({"whitespace_pattern": JSON_WHITESPACE}));
    }
    s
}

/// One generation's grammar state: masks the logits of each step to the tokens the grammar
/// allows next.
pub struct Constrained {
    matcher: Matcher,
    /// The allowed set of the current step (computed in `process`).
    mask: Option<SimpleVob>,
}

impl Constrained {
    /// A copy in the same state (a fresh copy of an unused constraint serves another choice).
    pub fn fork(&self) -> Constrained {
        Constrained {
            matcher: self.matcher.deep_clone(),
            mask: None,
        }
    }

    /// Whether the text so far is a complete match (the grammar may end here).
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }

    fn fail(&self, what: &str) -> LlmError {
        let why = self
            .matcher
            .get_error()
            .unwrap_or_else(|| "unknown error".into());
        LlmError::Other(format!("constrained decoding: {what}: {why}"))
    }
}

impl LogitProcessor for Constrained {
    fn process(&mut self, logits: &mut [f32]) -> Result<()> {
        let mask = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|_| self.fail("computing the token mask"))?;
        for (i, l) in logits.iter_mut().enumerate() {
            if !mask.is_allowed(i as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
        self.mask = Some(mask);
        Ok(())
    }

    fn masks_only(&self) -> bool {
        true
    }

    fn mask_bits(&mut self, words: &mut [u32]) -> Result<()> {
        let mask = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|_| self.fail("computing the token mask"))?;
        let have = mask.as_slice();
        for (i, w) in words.iter_mut().enumerate() {
            *w &= have.get(i).copied().unwrap_or(0);
        }
        self.mask = Some(mask);
        Ok(())
    }

    fn accept(&mut self, token: u32) -> Result<()> {
        self.mask = None;
        self.matcher
            .consume_token(token)
            .map_err(|_| self.fail("the chosen token does not fit the grammar"))
    }

    fn allowed(&self, token: u32) -> bool {
        self.mask.as_ref().is_none_or(|m| m.is_allowed(token))
    }

    fn finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}
