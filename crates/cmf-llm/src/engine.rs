//! What the generation loop needs from an engine: run tokens after those already cached and hand
//! back logits. The CPU engine is a [`Model`] with its [`State`]; another backend (the GPU's
//! whole-token decode) implements the same trait and plugs into `generate` and `ChatSession`.

use crate::error::Result;
use crate::model::{Model, State};
use cmf_gpu::llm::sample::SampleSpec;

pub trait Engine {
    /// Runs `tokens` after the cached ones; returns the logits of the last ([vocab]).
    fn prefill(&mut self, tokens: &[u32]) -> Result<&[f32]>;

    /// Tokens the generation loop hands to one [`Engine::prefill`] call when it wants to check
    /// for cancellation between calls. Splitting a prompt there must not change the logits: the
    /// CPU engine runs its prefill in passes of this many rows anyway.
    fn prefill_piece(&self) -> usize {
        usize::MAX
    }

    /// Runs one token; returns its logits.
    fn decode(&mut self, token: u32) -> Result<&[f32]> {
        self.prefill(&[token])
    }

    /// Runs one token and draws the next with `spec` on the engine's own sampler (the device's:
    /// only the token id comes back), or returns None, having run nothing, when the engine has
    /// no sampler for `spec` (the caller then calls [`Engine::decode`] and samples the logits).
    /// Either way the draw is `cmf_gpu::llm::sample`'s for this position.
    fn decode_sampled(&mut self, _token: u32, _spec: &SampleSpec) -> Result<Option<u32>> {
        Ok(None)
    }

    /// [`Engine::decode_sampled`] drawing only among the tokens a mask allows: `mask` fills the
    /// allowed-token bitset (`cmf_gpu::llm::sample::mask_words(vocab)` words, all ones on
    /// entry; a grammar's, computed while the device runs the forward), the engine sets the other
    /// logits to −∞ and samples as the host would from the masked logits. None, having run
    /// nothing, when the engine cannot (the caller decodes and masks on the host).
    fn decode_masked(
        &mut self,
        _token: u32,
        _spec: &SampleSpec,
        _mask: &mut dyn FnMut(&mut [u32]),
    ) -> Result<Option<u32>> {
        Ok(None)
    }

    /// Runs `tokens` after the cached ones and calls `f(i, logits_i)` for every one of them
    /// (scoring a prompt, OpenAI's `echo` with `logprobs`). By default one token at a time.
    fn prefill_scored(
        &mut self,
        tokens: &[u32],
        f: &mut (dyn FnMut(usize, &[f32]) + Send),
    ) -> Result<()> {
        for (i, &t) in tokens.iter().enumerate() {
            f(i, self.prefill(&[t])?);
        }
        Ok(())
    }

    /// Tokens cached (the next token's position).
    fn len(&self) -> usize;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Most tokens the cache may hold.
    fn limit(&self) -> usize;

    /// Keeps the first `len` cached tokens (a chat turn reuses the unchanged prefix). An engine
    /// whose state cannot be rewound (recurrent layers) may keep fewer, down to none: callers
    /// read [`Engine::len`] afterwards.
    fn truncate(&mut self, len: usize);
}

/// The CPU engine: a model and one sequence's state.
pub struct CpuEngine<'m, 'a> {
    pub model: &'m Model<'a>,
    pub state: State,
}

impl<'m, 'a> CpuEngine<'m, 'a> {
    pub fn new(model: &'m Model<'a>, limit: usize, kv_dtype: cmf_kernels::KvDtype) -> Result<Self> {
        Ok(CpuEngine {
            model,
            state: model.new_state_with(limit, kv_dtype)?,
        })
    }
}

impl Engine for CpuEngine<'_, '_> {
    fn prefill(&mut self, tokens: &[u32]) -> Result<&[f32]> {
        self.model.prefill(&mut self.state, tokens)
    }

    fn prefill_piece(&self) -> usize {
        crate::model::PREFILL_CHUNK
    }

    fn prefill_scored(
        &mut self,
        tokens: &[u32],
        f: &mut (dyn FnMut(usize, &[f32]) + Send),
    ) -> Result<()> {
        self.model.forward_scored(&mut self.state, tokens, 0, f)
    }

    fn len(&self) -> usize {
        self.state.len()
    }

    fn limit(&self) -> usize {
        self.state.kv.limit()
    }

    fn truncate(&mut self, len: usize) {
        self.state.truncate(len);
    }
}
