//! A decode step whose draw considers only the tokens a host-computed mask allows (a grammar's
//! next tokens), so a constrained generation still reads back one id a token instead of the
//! logits.
//!
//! Order on the stream: the captured greedy graph (the whole forward; its arg-max is discarded),
//! then — once the host has computed the mask, which it does while that graph runs — the mask's
//! upload, `apply_token_mask` and the spec's own sampler chain (`enqueue_sample`). The greedy
//! graph is used whatever the spec because its tail only reads the logits (a penalised spec's
//! graph would apply the penalties twice); its arg-max advanced the decode inputs, so they are
//! set back to this step's before the sampler reads them. No step is launched ahead: the next
//! step's input is the host's to check against the grammar first.

use super::CudaLlm;
use crate::cuda::runtime::device::{bytes_of, Arg, DResult, DevError};
use crate::llm::sample::mask_words;
use crate::llm::Sampler;

/// Threads of an `apply_token_mask` block (sample.cu).
const MASK_THREADS: usize = 256;

impl CudaLlm {
    /// The token drawn at `pos` (input `token`) by `sampler` among the tokens `mask` allows:
    /// `mask` fills the allowed-token bitset (bit `i % 32` of word `i / 32`; all ones on entry)
    /// while the device runs the forward.
    pub(super) fn decode_masked_step(
        &mut self,
        token: u32,
        pos: usize,
        sampler: &Sampler,
        mask: &mut dyn FnMut(&mut [u32]),
    ) -> DResult<u32> {
        let greedy = Sampler::Greedy;
        for slot in [false, true] {
            let stale = self.graphs[slot as usize]
                .as_ref()
                .is_none_or(|(s, _)| *s != greedy);
            if stale {
                self.settle()?;
                self.graphs[slot as usize] = None;
                let g = self.capture(&greedy, slot)?;
                self.graphs[slot as usize] = Some((greedy, g));
            }
        }
        // A graph launched ahead by an unmasked step computed another input: wait it out.
        self.settle()?;
        let inputs = bytes_of(&[token as i32, pos as i32]).to_vec();
        if self.dev_inputs != Some((token, pos)) {
            self.dev.upload(self.ws.io.ptr(), &inputs)?;
        }
        self.dev_inputs = None;
        self.launch_decode_graph(pos)?;

        // The host's part, while the forward runs.
        let v = self.spec.vocab;
        let mut bits = vec![u32::MAX; mask_words(v)];
        mask(&mut bits);

        // In stream order after the graph: this step's inputs again (the graph's arg-max moved
        // them on), the mask into the sampler's weight scratch (4·V bytes, the mask V/8: the
        // vocabulary passes rewrite it only after the mask kernel has completed), the mask, the
        // draw.
        self.dev.upload(self.ws.io.ptr(), &inputs)?;
        self.dev.upload(self.ws.weights.ptr(), bytes_of(&bits))?;
        self.enqueue_token_mask()?;
        self.enqueue_sample(sampler)?;
        self.dev.sync()?;
        let tok = self.ahead.ring.token_at(pos).ok_or_else(|| {
            DevError(format!(
                "the sampler's token for position {pos} is missing from the token ring"
            ))
        })?;
        self.dev_inputs = Some((tok, pos + 1));
        Ok(tok)
    }

    /// `apply_token_mask` over `ws.logits` with the mask in `ws.weights`.
    fn enqueue_token_mask(&self) -> DResult<()> {
        let v = self.spec.vocab;
        self.go(
            &self.ck.token_mask,
            (v.div_ceil(MASK_THREADS) as u32, 1, 1),
            (MASK_THREADS as u32, 1, 1),
            0,
            &[
                Arg::Ptr(self.ws.logits.ptr()),
                Arg::I32(v as i32),
                Arg::Ptr(self.ws.weights.ptr()),
            ],
        )
    }

    /// The mask kernel alone on `logits` (tests: its parity with the host's
    /// `llm::sample::apply_token_mask`).
    pub fn mask_logits(&mut self, logits: &[f32], allowed: &[u32]) -> DResult<Vec<f32>> {
        let v = self.spec.vocab;
        if logits.len() != v || allowed.len() != mask_words(v) {
            return Err(DevError(format!(
                "mask_logits: {} logits and {} mask words for a vocabulary of {v}",
                logits.len(),
                allowed.len()
            )));
        }
        self.settle()?;
        self.dev.upload_f32(self.ws.logits.ptr(), logits)?;
        self.dev.upload(self.ws.weights.ptr(), bytes_of(allowed))?;
        self.enqueue_token_mask()?;
        let mut out = vec![0f32; v];
        self.dev.download_f32(&mut out, self.ws.logits.ptr())?;
        Ok(out)
    }
}
