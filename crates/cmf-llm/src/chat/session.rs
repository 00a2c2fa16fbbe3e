//! A multi-turn chat over one KV cache. Each turn renders the whole conversation with the
//! template, keeps the cached prefix that still matches the new token ids, and runs only the
//! rest, so earlier turns are not recomputed.

use super::{ChatTemplate, Message, Tokenizer};
use crate::error::{LlmError, Result};
use crate::generate::{generate_on, GenerationConfig, GenerationStats};
use crate::gpu::Engine;
use crate::model::{Model, State};

pub struct ChatSession<'m, 'a> {
    model: &'m Model<'a>,
    tokenizer: &'m Tokenizer,
    template: &'m ChatTemplate,
    pub messages: Vec<Message>,
    state: State,
    /// Ids whose keys/values are in the cache (`state`, or the device's).
    cached: Vec<u32>,
    /// Where the forward passes run (the CPU unless [`ChatSession::with_engine`]).
    engine: Engine,
}

impl<'m, 'a> ChatSession<'m, 'a> {
    /// `limit`: tokens the conversation may occupy; `kv_dtype`: the cache's element type.
    pub fn new(
        model: &'m Model<'a>,
        tokenizer: &'m Tokenizer,
        template: &'m ChatTemplate,
        system: Option<&str>,
        limit: usize,
        kv_dtype: cmf_kernels::KvDtype,
    ) -> Self {
        let messages = system
            .map(|s| vec![Message::new("system", s)])
            .unwrap_or_default();
        let state = model.new_state_with(limit, kv_dtype);
        ChatSession {
            model,
            tokenizer,
            template,
            messages,
            state,
            cached: Vec::new(),
            engine: Engine::Cpu,
        }
    }

    /// Runs the forward passes on `engine` (e.g. the GPU, see [`crate::gpu`]).
    pub fn with_engine(mut self, engine: Engine) -> Self {
        self.engine = engine;
        self
    }

    /// Forgets the conversation except the system message.
    pub fn reset(&mut self) {
        self.messages.retain(|m| m.role == "system");
        self.state.clear();
        self.cached.clear();
        self.engine.truncate(0);
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
        let limit = self.state.kv.limit();
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
        self.state.kv.truncate(keep);
        self.engine.truncate(keep);
        self.cached.truncate(keep);
        let mut reply = String::new();
        let mut collect = |t: &str| {
            reply.push_str(t);
            on_text(t);
        };
        let stats = generate_on(
            self.model,
            &mut self.engine,
            &mut self.state,
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
