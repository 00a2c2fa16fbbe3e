//! The interfaces a device backend implements. Two levels, as in ggml's backend interface: the
//! backend answers for its device and loads models; a loaded model answers per entry point,
//! each of which does its whole job or refuses before touching an output.

use super::devices::{DeviceInfo, MemStats};
use super::placement::Placement;
use super::refusal::{Refusal, RefusalReason};
use crate::dit::{CondId, DitItemSetup, DitModel, DitStepItem, RopeRows};
use crate::llm::batch::{BatchOut, BatchSeq, PoolShape};
use crate::llm::{DecodeOutput, LlmModel, LlmOptions, Logits, Sampler};
use crate::vae::VaeModel;
use std::ops::Range;

/// Device bytes a model needs, per part (for placement).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Footprint {
    /// Per layer: weights in their codec plus its KV cache.
    pub layer_bytes: Vec<u64>,
    /// Embedding + final norm + lm_head (tied counted once).
    pub head_bytes: u64,
    /// Activations and workspaces, whatever the placement.
    pub fixed_bytes: u64,
}

/// A device backend (one device).
pub trait Backend: Send + Sync {
    /// Name, arch, memory of the device.
    fn info(&self) -> DeviceInfo;
    /// Byte counters (resident, uploaded, downloaded).
    fn stats(&self) -> &MemStats;
    /// Device bytes `model` would need; refuses models the kernels cannot run at all (codec,
    /// head_dim, …) so the caller learns it before any upload.
    fn llm_footprint(&self, model: &LlmModel, opts: &LlmOptions) -> Result<Footprint, Refusal>;
    /// Uploads the parts of `model` that `placement` puts on the device.
    fn load_llm(
        &self,
        model: &LlmModel,
        opts: &LlmOptions,
        placement: &Placement,
    ) -> Result<Box<dyn LlmDevice>, Refusal>;
    /// Uploads a DiT (whole: a step needs every layer). Backends without a DiT path refuse.
    fn load_dit(&self, _model: &DitModel) -> Result<Box<dyn DitDevice>, Refusal> {
        Err(Refusal::new(
            "dit.load",
            RefusalReason::UnsupportedShape("this backend has no DiT path".into()),
        ))
    }
    /// Uploads a VAE decoder. Backends without a VAE path refuse.
    fn load_vae(&self, _model: &VaeModel) -> Result<Box<dyn VaeDevice>, Refusal> {
        Err(Refusal::new(
            "vae.load",
            RefusalReason::UnsupportedShape("this backend has no VAE path".into()),
        ))
    }
}

/// A VAE decoder resident on a device. Honest refusal: on `Err`, `out` is untouched.
pub trait VaeDevice: Send {
    /// `z [latent_channels, h, w]` (already `z / scaling_factor + shift_factor`) into
    /// `out [out_channels, 8h, 8w]`, before the [-1, 1] → [0, 1] mapping.
    fn decode(&mut self, z: &[f32], h: usize, w: usize, out: &mut [f32]) -> Result<(), Refusal>;
    /// As `decode`, writing the image as 8-bit RGB `[8h, 8w, out_channels]` (round half to even
    /// of `clamp(v / 2 + 0.5, 0, 1) · 255`, diffusers' postprocess); `Ok(false)` when a value was
    /// not finite (`out` is written either way). A backend without the fused conversion refuses,
    /// and the caller uses `decode`.
    fn decode_rgb8(
        &mut self,
        _z: &[f32],
        _h: usize,
        _w: usize,
        _out: &mut [u8],
    ) -> Result<bool, Refusal> {
        Err(Refusal::new(
            "vae.decode_rgb8",
            RefusalReason::UnsupportedShape("8-bit output (this backend decodes to f32)".into()),
        ))
    }
    /// Gets ready to decode latents of `h × w` (buffers, plans, first-use set-up) so that the
    /// first `decode` at that size costs what the later ones do. Writes no output; an `Err`
    /// only means the decode will do that work itself. Nothing to do by default.
    fn prepare(&mut self, _h: usize, _w: usize) -> Result<(), Refusal> {
        Ok(())
    }
}

/// A DiT resident on a device: the per-prompt `condition` / `prepare` and the per-step `step`
/// of the image pipeline. Honest refusal as for [`LlmDevice`]: on `Err` no output the caller
/// passed has been written, and the caller runs the CPU model.
pub trait DitDevice: Send {
    /// Embeds (RMSNorm, `cap_embedder`, pad rows) and refines a caption `cap [len,
    /// cap_feat_dim]`; the refined rows stay resident under the returned id. `rope` covers the
    /// padded caption rows.
    fn condition(&mut self, cap: &[f32], len: usize, rope: RopeRows) -> Result<CondId, Refusal>;
    /// Sets up a batch for images of `ni` patches: its items (captions and RoPE rows) and the
    /// activation buffers. Steps then name items by their index here.
    fn prepare(&mut self, items: &[DitItemSetup], ni: usize) -> Result<(), Refusal>;
    /// One forward of the listed items; `out` receives `[items.len(), ni, patch_dim]`.
    fn step(&mut self, items: &[DitStepItem], out: &mut [f32]) -> Result<(), Refusal>;
    /// Frees captions and activation buffers (the weights stay).
    fn release(&mut self);
    /// Block GEMM weight planes that run on 8-bit operands, FP8 or int8 as the precision says
    /// (diagnostics and tests: which path ran).
    fn gemm8_planes(&self) -> usize {
        0
    }
    /// Device bytes the resident weights take (each GEMM plane once, in the encoding it runs
    /// in; 0 where a backend does not count them).
    fn weight_bytes(&self) -> u64 {
        0
    }
}

/// A model resident on a device. Positions are explicit: a call at `start` overwrites KV rows
/// ≥ `start` and reads rows < `start`, so a caller rewinds by passing a smaller position.
///
/// Honest refusal: on `Err`, no output slice or struct passed in has been written. Device-side
/// KV rows ≥ `start` may have been (they are overwritten by the next call at that position).
pub trait LlmDevice: Send {
    fn placement(&self) -> &Placement;
    /// Positions the device KV cache holds.
    fn max_context(&self) -> usize;
    /// One whole token on the device (embedding, every layer, final norm, lm_head, sampling):
    /// `token` at position `pos`. Needs `placement().is_whole_model()`. Logits are returned
    /// in `out.logits` only when `want_logits`.
    fn decode(
        &mut self,
        token: u32,
        pos: usize,
        sampler: &Sampler,
        want_logits: bool,
        out: &mut DecodeOutput,
    ) -> Result<(), Refusal>;
    /// [`Self::decode`] whose draw considers only the tokens a host-side mask allows (a
    /// grammar's): `mask` fills the allowed-token bitset (`llm::sample::mask_words(V)` words,
    /// bit `i % 32` of word `i / 32` for token `i`; all ones on entry) while the device runs the
    /// forward, the device sets the other logits to −∞ (`llm::sample::apply_token_mask`) and
    /// samples as `decode` does. Returns the token; no logits come back. Backends without it
    /// refuse.
    fn decode_masked(
        &mut self,
        _token: u32,
        _pos: usize,
        _sampler: &Sampler,
        _mask: &mut dyn FnMut(&mut [u32]),
    ) -> Result<u32, Refusal> {
        Err(Refusal::new(
            "llm.decode_masked",
            RefusalReason::UnsupportedShape("this backend has no masked decode".into()),
        ))
    }
    /// `tokens` at positions `start..start+T` through the whole model, filling the KV cache;
    /// `out` receives `logits.len(T, V)` floats. Needs `placement().is_whole_model()`.
    fn prefill(
        &mut self,
        tokens: &[u32],
        start: usize,
        logits: Logits,
        out: &mut [f32],
    ) -> Result<(), Refusal>;
    /// Runs resident layers `layers` in place over hidden states `x[T, H]` at positions
    /// `start..start+T` (hybrid placement: the caller runs the other layers).
    fn forward_layers(
        &mut self,
        layers: Range<usize>,
        x: &mut [f32],
        t: usize,
        start: usize,
    ) -> Result<(), Refusal>;
    /// Final norm + lm_head of `x[T, H]` into `logits[T, V]`. Needs the head resident.
    fn head(&mut self, x: &[f32], t: usize, logits: &mut [f32]) -> Result<(), Refusal>;
    /// Device bytes one pool block of `block_size` positions takes over every layer (0: no
    /// batched step on this backend).
    fn kv_block_bytes(&self, _block_size: usize) -> u64 {
        0
    }
    /// Allocates the KV block pool of [`Self::batch_step`] (replacing an earlier one): as many
    /// blocks of `block_size` positions of every layer as `bytes` holds. Needs
    /// `placement().is_whole_model()`. Backends without a batched path refuse.
    fn kv_pool(&mut self, _bytes: u64, _block_size: usize) -> Result<PoolShape, Refusal> {
        Err(Refusal::new(
            "llm.kv_pool",
            RefusalReason::UnsupportedShape("this backend has no batched step".into()),
        ))
    }
    /// One forward pass over the rows of every sequence in `seqs` (decode tokens and prompt
    /// chunks alike), writing their keys and values into the pool through their block tables
    /// and attending to the positions those tables hold; `out` receives the last-row output of
    /// each sequence that wants it. Pool blocks a sequence writes must be its own.
    fn batch_step(&mut self, _seqs: &[BatchSeq], _out: BatchOut) -> Result<(), Refusal> {
        Err(Refusal::new(
            "llm.batch_step",
            RefusalReason::UnsupportedShape("this backend has no batched step".into()),
        ))
    }
}
