//! A multi-turn chat over one KV cache. Each turn renders the whole conversation with the
//! template, keeps the cached prefix that still matches the new token ids, and runs only the
//! rest, so earlier turns are not recomputed.

use super::{ChatTemplate, Message, Tokenizer};
use crate::engine::{CpuEngine, Engine};
use crate::error::{LlmError, Result};
use crate::generate::{generate, GenerationConfig, GenerationStats};
use crate::model::Model;

pub struct ChatSession<'m> {
    engine: Box<dyn Engine + 'm>,
    tokenizer: &'m Tokenizer,
    template: &'m ChatTemplate,
    pub messages: Vec<Message>,
    /// Ids whose keys/values are in the engine's cache.
    cached: Vec<u32>,
}

impl<'m> ChatSession<'m> {
    /// `limit`: tokens the conversation may occupy; `kv_dtype`: the cache's element type.
    pub fn new<'a: 'm>(
        model: &'m Model<'a>,
        tokenizer: &'m Tokenizer,
        template: &'m ChatTemplate,
        system: Option<&str>,
        limit: usize,
        kv_dtype: cmf_kernels::KvDtype,
    ) -> crate::Result<Self> {
        let engine = Box::new(CpuEngine::new(model, limit, kv_dtype)?);
        Ok(Self::with_engine(engine, tokenizer, template, system))
    }

    /// A session on any [`Engine`] (e.g. a GPU backend's).
    pub fn with_engine(
        engine: Box<dyn Engine + 'm>,
        tokenizer: &'m Tokenizer,
        template: &'m ChatTemplate,
        system: Option<&str>,
    ) -> Self {
        let messages = system
            .map(|s| vec![Message::new("system", s)])
            .unwrap_or_default();
        ChatSession {
            engine,
            tokenizer,
            template,
            messages,
            cached: Vec::new(),
        }
    }

    /// Forgets the conversation except the system message.
    pub fn reset(&mut self) {
        self.messages.retain(|m| m.role == "system");
        self.engine.truncate(0);
        self.cached.clear();
    }

    /// Adds a user message, generates the assistant's reply (streamed to `on_text`) and adds it.
    pub fn send(
        &mut self,
        user: &str,
        cfg: &GenerationConfig,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<(String, GenerationStats)> {
        self.messages.push(Message::new("user", user));
        let rendered = self.template.render(&self.messages, true);
        let ids = rendered.and_then(|r| self.tokenizer.encode(&r, false));
        let ids = match ids {
            Ok(ids) => ids,
            Err(e) => {
                self.messages.pop();
                return Err(e);
            }
        };
        let limit = self.engine.limit();
        if ids.len() + 1 > limit {
            self.messages.pop();
            return Err(LlmError::ContextFull {
                needed: ids.len() + 1,
                limit,
            });
        }
        // Reuse the cached prefix; at least one id must run to get logits.
        let mut keep = self
            .cached
            .iter()
            .zip(&ids)
            .take_while(|(a, b)| a == b)
            .count();
        keep = keep.min(ids.len() - 1);
        self.engine.truncate(keep);
        // A recurrent state cannot rewind: the engine may have kept less than asked.
        let keep = self.engine.len().min(keep);
        self.cached.truncate(keep);
        let mut reply = String::new();
        let mut collect = |t: &str| {
            reply.push_str(t);
            on_text(t);
        };
        let stats = generate(
            self.engine.as_mut(),
            self.tokenizer,
            &ids[keep..],
            &mut self.cached,
            cfg,
            &mut collect,
        )?;
        self.messages.push(Message::new("assistant", reply.clone()));
        Ok((reply, stats))
    }
}
