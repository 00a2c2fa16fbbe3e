//! The Hugging Face tokenizer stored in the file's vocab section (`tokenizer.json` verbatim),
//! through the `tokenizers` crate (pure Rust: fancy-regex, no onig).
//!
//! The `tokenizers` crate panics on some malformed files (a wrong-typed normalizer field, for
//! one), so every call into it runs inside [`guarded`]: a panic becomes an error.

use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::error::{LlmError, Result};

thread_local! {
    /// Calls into `tokenizers` under way on this thread (see [`inside_guard`]).
    static GUARDED: Cell<usize> = const { Cell::new(0) };
}

/// Whether this thread is inside a guarded call, where a panic becomes an error: a process-wide
/// panic hook can leave such a panic unreported (the error carries its message).
pub fn inside_guard() -> bool {
    GUARDED.with(|g| g.get() > 0)
}

/// Runs `f`, turning a panic into a tokenizer error that says what was being done.
fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    GUARDED.with(|g| g.set(g.get() + 1));
    let result = catch_unwind(AssertUnwindSafe(f));
    GUARDED.with(|g| g.set(g.get() - 1));
    result.unwrap_or_else(|panic| {
        let msg = panic
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| panic.downcast_ref::<&str>().copied())
            .unwrap_or("unknown cause");
        Err(LlmError::Tokenizer(format!(
            "{what}: the tokenizer failed on this input ({msg})"
        )))
    })
}

/// Text run through a tokenizer when it is loaded: words, digits, punctuation, whitespace runs
/// and non-ASCII, the paths normalizers and pre-tokenizers take.
const SAMPLE_TEXT: &str = "Hello, world! 123  tabs\tand\nnew lines; café 東京 🙂";

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
}

impl Tokenizer {
    /// Parses `tokenizer.json` bytes, then encodes and decodes a sample text so that a
    /// tokenizer which panics is refused here rather than at the first prompt.
    pub fn from_bytes(json: &[u8]) -> Result<Tokenizer> {
        let inner = guarded("cannot parse tokenizer.json", || {
            tokenizers::Tokenizer::from_bytes(json)
                .map_err(|e| LlmError::Tokenizer(format!("cannot parse tokenizer.json: {e}")))
        })?;
        release_freed_heap();
        let tok = Tokenizer { inner };
        tok.probe()?;
        Ok(tok)
    }

    /// Encodes and decodes [`SAMPLE_TEXT`]: a panic inside the tokenizer refuses it, while an
    /// ordinary error (a vocabulary without an unknown token, say) only concerns that text.
    fn probe(&self) -> Result<()> {
        guarded("tokenizer.json fails on a sample text", || {
            if let Ok(enc) = self.inner.encode(SAMPLE_TEXT, true) {
                let _ = self.inner.decode(enc.get_ids(), false);
            }
            Ok(())
        })
    }

    /// Token ids of `text`. `add_special_tokens` runs the post-processor (e.g. a BOS it adds);
    /// special tokens written in the text are matched either way, as transformers does.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        guarded("encode", || {
            let enc = self
                .inner
                .encode(text, add_special_tokens)
                .map_err(|e| LlmError::Tokenizer(format!("encode: {e}")))?;
            Ok(enc.get_ids().to_vec())
        })
    }

    /// A copy that treats special-token text (`<|im_start|>`) as ordinary text, as llama.cpp's
    /// `--no-parse-special` and transformers' `split_special_tokens=True` do.
    pub fn special_tokens_as_text(&self) -> Tokenizer {
        let mut inner = self.inner.clone();
        inner.set_encode_special_tokens(true);
        Tokenizer { inner }
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        guarded("decode", || {
            self.inner
                .decode(ids, skip_special_tokens)
                .map_err(|e| LlmError::Tokenizer(format!("decode: {e}")))
        })
    }

    /// The token strings of `ids` (vocabulary entries, not decoded text).
    pub fn tokens(&self, ids: &[u32]) -> Vec<Option<String>> {
        ids.iter().map(|&i| self.inner.id_to_token(i)).collect()
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of `text` when it is a special added token (not an ordinary vocabulary entry).
    pub fn special_token_id(&self, text: &str) -> Option<u32> {
        self.inner
            .get_added_tokens_decoder()
            .into_iter()
            .find(|(_, t)| t.special && t.content == text)
            .map(|(id, _)| id)
    }

    /// Entries including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// A streaming decoder; `context` are ids already shown (e.g. the end of the prompt) so
    /// that decoders which strip a leading space on the first token see the real neighbour.
    pub fn text_decoder(&self, context: &[u32], skip_special_tokens: bool) -> TextDecoder<'_> {
        TextDecoder {
            tok: self,
            ids: context.to_vec(),
            prefix: 0,
            read: context.len(),
            skip_special_tokens,
        }
    }
}

/// Turns a stream of token ids into text pieces, never cutting a UTF-8 character that spans
/// tokens (byte-level BPE splits multi-byte characters across tokens).
///
/// The method is the one transformers' `TextStreamer` and text-generation-inference use: decode
/// the ids from `prefix` on and emit what extends the text decoded up to `read`, unless it ends
/// in U+FFFD (an incomplete character; wait for the next token).
pub struct TextDecoder<'t> {
    tok: &'t Tokenizer,
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
    skip_special_tokens: bool,
}

impl TextDecoder<'_> {
    /// Adds one id; returns the text it completes (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        let before = self
            .tok
            .decode(&self.ids[self.prefix..self.read], self.skip_special_tokens)?;
        let now = self
            .tok
            .decode(&self.ids[self.prefix..], self.skip_special_tokens)?;
        if now.len() > before.len() && !now.ends_with('\u{FFFD}') {
            let common = common_prefix_len(&before, &now);
            let piece = now[common..].to_string();
            // Keep the window short: the last emitted ids are enough context.
            self.prefix = self.read;
            self.read = self.ids.len();
            if self.prefix > 64 {
                self.ids.drain(..self.prefix);
                self.read -= self.prefix;
                self.prefix = 0;
            }
            return Ok(piece);
        }
        Ok(String::new())
    }

    /// Whatever is still held back (an incomplete character at the end of the stream is
    /// emitted as U+FFFD, as a plain decode would).
    pub fn flush(&mut self) -> Result<String> {
        let before = self
            .tok
            .decode(&self.ids[self.prefix..self.read], self.skip_special_tokens)?;
        let now = self
            .tok
            .decode(&self.ids[self.prefix..], self.skip_special_tokens)?;
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        let common = common_prefix_len(&before, &now);
        Ok(now[common..].to_string())
    }
}

/// Byte length of the longest common prefix of `a` and `b` that ends on a char boundary.
fn common_prefix_len(a: &str, b: &str) -> usize {
    let mut n = 0;
    for ((i, ca), cb) in a.char_indices().zip(b.chars()) {
        if ca != cb {
            return i;
        }
        n = i + ca.len_utf8();
    }
    n
}

/// Parsing a large tokenizer.json leaves tens of MB of freed parser memory that glibc keeps
/// (measured on Qwen3's 151k-entry vocabulary: 88 MB resident after parsing, 51 MB after this).
/// Hand it back so the process stays near "mapped weights + KV cache + a little".
fn release_freed_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free heap pages; it has no preconditions.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A word-level tokenizer.json with `normalizer` spliced in.
    fn tokenizer_json(normalizer: &str) -> String {
        format!(
            r#"{{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
            "normalizer":{normalizer},"pre_tokenizer":{{"type":"Whitespace"}},
            "post_processor":null,"decoder":null,
            "model":{{"type":"WordLevel","vocab":{{"[UNK]":0,"hello":1}},"unk_token":"[UNK]"}}}}"#
        )
    }

    #[test]
    fn a_plain_tokenizer_loads() {
        let t = Tokenizer::from_bytes(tokenizer_json("null").as_bytes()).unwrap();
        assert_eq!(t.encode("hello", false).unwrap(), vec![1]);
    }

    #[test]
    fn a_panicking_normalizer_is_an_error() {
        // A precompiled charsmap whose trie points past its own end: the `tokenizers` crate
        // panics inside the normalizer on the first text it sees.
        let json =
            tokenizer_json(r#"{"type":"Precompiled","precompiled_charsmap":"BAAAAP////8="}"#);
        let Err(err) = Tokenizer::from_bytes(json.as_bytes()) else {
            panic!("a tokenizer that panics was accepted");
        };
        assert!(err.to_string().contains("tokenizer"), "{err}");
    }
}
