//! Tokenizer and chat: the Hugging Face `tokenizer.json` from the file's vocab section, chat
//! templates rendered as transformers renders them, and streaming token-to-text decoding.

pub mod assets;
pub mod render_worker;
pub mod session;
pub mod template;
pub mod tokenizer;

pub use assets::TextAssets;
pub use session::ChatSession;
pub use template::{ChatTemplate, SpecialTokens, CHATML_TEMPLATE};
pub use tokenizer::{TextDecoder, Tokenizer};

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }
}
