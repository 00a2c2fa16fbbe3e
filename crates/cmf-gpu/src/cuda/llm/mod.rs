//! A decoder-only LLM resident on the device: weights in their codecs, the KV cache, the
//! workspaces, the captured whole-token decode graph.
//!
//! Entry points (the [`LlmDevice`] contract): validate first, refuse before any output is
//! touched, run, read back, and only then write the caller's buffers.
//! - `decode`: one CUDA graph replay (embedding → every layer → final norm → lm_head →
//!   sampling) with token and position in device memory; when the caller passes the token the
//!   device just sampled at the next position, nothing is uploaded. One 4-byte readback.
//! - `prefill`: batched through cuBLAS (bf16 tensor cores for bf16/q8/q4 weights, dequantised
//!   per matrix into a transient bf16 scratch; f32 SGEMM for f32/f16 models), flash attention,
//!   chunked by `prefill_chunk`, writing the KV cache in place.
//! - `forward_layers` / `head`: hybrid placement, the caller runs the other layers on the CPU.

mod ahead;
mod batched;
mod forward;
pub mod gdn;
pub(crate) mod kernels;
mod masked;
pub mod moe;
mod profile;
mod sampler;
mod workspace;

use crate::cuda::runtime::blas::Blas;
use crate::cuda::runtime::device::{bytes_of, DBuf, DResult, Dev, DevError, Graph};
use crate::cuda::runtime::weights::{self, DevCodec, DevWeight};
use crate::facade::backend::{Footprint, LlmDevice};
use crate::facade::placement::Placement;
use crate::facade::refusal::{Refusal, RefusalReason};
use crate::llm::batch::{self, BatchOut, BatchSeq, PoolShape};
use crate::llm::{
    DecodeOutput, Ffn, KvPrecision, LayerWeights, LlmModel, LlmOptions, LlmSpec, Logits, Sampler,
};
use ahead::DecodeAhead;
pub use batched::{paged_attention_probe, q8_gemm_probe, PagedKernel};
pub use kernels::CommonKernels;
use kernels::{DecodeAttnConfig, ModelKernels};
use moe::{DevFfn, MoeDecodeWs, MoeKernels, MoePrefillWs};
use std::ops::Range;
use std::sync::Arc;
use workspace::{DecodeWs, PrefillWs};

pub(crate) struct DevLayer {
    pub q: DevWeight,
    pub k: DevWeight,
    pub v: DevWeight,
    pub o: DevWeight,
    /// The feed-forward block: a dense MLP or a mixture of experts.
    pub ffn: DevFfn,
    pub attn_norm: DBuf,
    pub ffn_norm: DBuf,
    pub q_bias: Option<DBuf>,
    pub k_bias: Option<DBuf>,
    pub v_bias: Option<DBuf>,
    pub q_norm: Option<DBuf>,
    pub k_norm: Option<DBuf>,
    /// Sliding window (0: none).
    pub window: i32,
    pub k_cache: DBuf,
    pub v_cache: DBuf,
    /// A GatedDeltaNet layer (gdn.rs): its weights and state; q/k/v/o and the caches are then
    /// empty stand-ins.
    pub gdn: Option<gdn::DevGdn>,
    /// Output-gated attention: q holds [query | gate] rows per head.
    pub gated: bool,
}

pub struct CudaLlm {
    dev: Arc<Dev>,
    ck: Arc<CommonKernels>,
    mk: ModelKernels,
    spec: LlmSpec,
    opts: LlmOptions,
    placement: Placement,
    layers: Vec<Option<DevLayer>>,
    embed: Option<DevWeight>,
    /// None when tied (the embedding is used).
    lm_head: Option<DevWeight>,
    final_norm: Option<DBuf>,
    inv_freq: DBuf,
    kv_f32: bool,
    /// Split-K partitions of decode attention.
    splits: usize,
    chunk_max: usize,
    ws: DecodeWs,
    pf: Option<PrefillWs>,
    /// PrefillWs buffer sizes for this model (computed at load, allocated on first prefill).
    pf_sizes: [usize; 12],
    /// Start position of the prefill chunk in flight.
    pf_start: usize,
    /// The MoE kernels and buffers, when the model has MoE layers (moe.rs).
    moe: Option<MoeKernels>,
    moe_ws: Option<MoeDecodeWs>,
    moe_pf: Option<MoePrefillWs>,
    moe_pf_sizes: Option<[usize; 9]>,
    blas: Option<Blas>,
    /// Captured whole-token graphs: [split-K attention, short contexts]. Index 1 is used while
    /// the position is below `one_block` (see `ShortDecode`).
    graphs: [Option<(Sampler, Graph)>; 2],
    short: ShortDecode,
    /// Visible keys up to which one decode-attention block serves a kv head.
    one_block: usize,
    smem: DecodeSmemBytes,
    /// Whether the decode chain being enqueued is the short-context one (set around capture).
    enqueue_short: std::cell::Cell<bool>,
    /// (token, position) the device-side decode inputs hold now, if known.
    dev_inputs: Option<(u32, usize)>,
    /// The token ring and the graph launched ahead (ahead.rs).
    ahead: DecodeAhead,
    attn: AttnKernel,
    /// The batched step's KV block pool (`kv_pool`).
    pool: Option<batched::KvPool>,
    /// Set while a batched step enqueues: its q8_row GEMMs run on tensor cores (`batched/q8.rs`).
    q8_step: std::cell::Cell<bool>,
    /// Kernels, scratch and state position of GatedDeltaNet / output-gated layers (gdn.rs).
    hybrid: Option<gdn::Hybrid>,
}

/// Which prefill attention kernel runs: `Fa2` where it applies, else `Simple`. The earlier
/// tensor-core kernel with synchronous tile loads took 1.58 ms against fa2's 0.73 ms in a
/// Qwen3-8B q8 prefill layer at 4096 tokens (H200).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnKernel {
    /// Tensor cores, cp.async double buffering (f16 cache, head_dim ≤ 128).
    Fa2,
    /// f32 FMA, one warp per (query, head): any cache precision and head_dim (f32 caches and
    /// head_dim > 128 need it).
    Simple,
}

/// Per-model facts the footprint and the load share.
struct Plan {
    /// `DEC_ONE_BLOCK`
    one_block: usize,
    kv_f32: bool,
    kv_layer_bytes: u64,
    splits: usize,
    chunk_max: usize,
}

/// Fewest keys per decode-attention split beyond one block's share (`DEC_MIN_CHUNK` in
/// attention_decode.cu): more blocks in flight against more merging. No measured comparison of
/// values is recorded (it was 32 before one block served the first 256 keys).
/// [`DecodeTuning::min_chunk`] overrides it for tests.
pub const DEC_MIN_CHUNK: usize = 128;

/// Layers with fewer weight bytes than this wait for their predecessor before anything else in
/// decode attention (`DEC_EARLY_WAIT`); larger ones prefetch their K/V into L2 first. Measured on
/// the H200 (2026-11-30, both orders on the same machine, decode from context 128): Qwen3-0.6B
/// q8, 15 MB of weights per layer, +10 % tok/s waiting first (1173 against 1060); Qwen3-8B q8
/// and bf16, 190 and 380 MB per layer, +2.5 % and +1.8 % with the late wait (379 against 369,
/// 227 against 223), where idle splits exit at once and each block's prefetch overlaps the long
/// q|k|v matvec. The 64 MiB threshold between the two was not measured.
const DEC_EARLY_WAIT_BELOW_BYTES: u64 = 64 << 20;

/// Up to this many visible keys, one decode-attention block per kv head (`DEC_ONE_BLOCK`), and
/// the short-context graph (K/V staged in shared memory: 256 keys of f16 at head dim 128 are
/// 128 KiB). 384 measured slower on the H200 (Qwen3-8B bf16 189 against 230 tok/s from context
/// 128, q8 354 against 389): 192 KiB of staging leaves no room for the matvec blocks that should
/// share the SM with it.
pub const DEC_ONE_BLOCK: usize = 256;

fn decode_early_wait(layer_bytes: u64) -> bool {
    layer_bytes < DEC_EARLY_WAIT_BELOW_BYTES
}

/// Tuning values of the decode attention that tests change to reach paths the defaults leave
/// rare (e.g. many small splits at a short context). Production loads use the default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeTuning {
    /// Fewest keys per split past the one-block length ([`DEC_MIN_CHUNK`]; at least 1).
    pub min_chunk: usize,
}

impl Default for DecodeTuning {
    fn default() -> Self {
        DecodeTuning {
            min_chunk: DEC_MIN_CHUNK,
        }
    }
}

/// Warps per decode-attention block (`DEC_WARPS` in attention_decode.cu).
pub(super) const DEC_WARPS: usize = 8;

/// Dynamic shared memory of `attn_decode` (its layout comment): q (rows padded by 4), scores,
/// per-warp outputs, merge weights, all f32.
pub(super) fn decode_smem_bytes(
    group: usize,
    head_dim: usize,
    chunk_max: usize,
    splits: usize,
) -> usize {
    4 * (group * (head_dim + 4)
        + group * chunk_max
        + DEC_WARPS * group * head_dim
        + DEC_WARPS * splits)
}

/// Dynamic shared memory of `attn_decode_short`: the staged K and V rows (`one_block` keys
/// each), then `attn_decode`'s layout.
fn decode_short_smem_bytes(p: &Plan, group: usize, head_dim: usize) -> usize {
    let kv_elem = if p.kv_f32 { 4 } else { 2 };
    2 * p.one_block * head_dim * kv_elem + decode_smem_bytes(group, head_dim, p.chunk_max, p.splits)
}

/// How decode attention runs at contexts of at most `one_block` keys, where the token's
/// position picks a second captured graph: `Staged` where its shared memory fits, else `Grid`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShortDecode {
    /// A graph with one block per kv head running `attn_decode`.
    Grid,
    /// A graph with one block per kv head running `attn_decode_short` (K/V staged in shared
    /// memory before the wait for the q|k|v matvec).
    Staged,
}

fn short_decode_choice(staged_fits: bool) -> ShortDecode {
    if staged_fits {
        ShortDecode::Staged
    } else {
        ShortDecode::Grid
    }
}

/// Dynamic shared memory of the decode-attention kernels, computed once at load.
#[derive(Debug, Clone, Copy)]
pub(super) struct DecodeSmemBytes {
    /// attn_decode
    pub decode: usize,
    /// attn_decode_short (with the staged K/V rows)
    pub decode_short: usize,
}

fn plan(
    dev: &Dev,
    model: &LlmModel,
    opts: &LlmOptions,
    tuning: DecodeTuning,
) -> Result<Plan, Refusal> {
    let s = &model.spec;
    let shape = |m: String| Refusal::new("llm.load", RefusalReason::UnsupportedShape(m));
    if !(s.head_dim % 32 == 0 || s.head_dim == 16) || s.head_dim > 256 {
        return Err(shape(format!(
            "head_dim {} (the kernels take 16 or a multiple of 32, at most 256)",
            s.head_dim
        )));
    }
    let group = s.num_heads / s.num_kv_heads;
    if group * s.head_dim.div_ceil(32) > 64 {
        return Err(shape(format!(
            "{group} query heads per kv head at head_dim {}",
            s.head_dim
        )));
    }
    if s.vocab > 256 * 256 * 8 {
        return Err(shape(format!(
            "vocab {} (the sampler takes at most 524288)",
            s.vocab
        )));
    }
    if opts.max_context == 0 || opts.max_context > i32::MAX as usize / 2 || opts.prefill_chunk == 0
    {
        return Err(shape(format!(
            "max_context {} / prefill_chunk {}",
            opts.max_context, opts.prefill_chunk
        )));
    }
    gdn::check(model)?;
    weights::check(&model.embed, "embed")?;
    weights::check(&model.lm_head, "lm_head")?;
    let mut all_float = true;
    for (l, w) in model.layers.iter().enumerate() {
        let Some(a) = w.attention() else {
            // A GatedDeltaNet layer (gdn::check took its matrices).
            if let Ffn::Moe(m) = &w.ffn {
                moe::check(m, l)?;
            }
            if let Ffn::Dense(m) = &w.ffn {
                let g = weights::check(&m.gate, &format!("layer {l} gate"))?;
                let u = weights::check(&m.up, &format!("layer {l} up"))?;
                weights::check(&m.down, &format!("layer {l} down"))?;
                if g != u {
                    return Err(shape(format!("layer {l}: gate/up in different codecs")));
                }
            }
            all_float &= w
                .matrices()
                .iter()
                .all(|m| matches!(m.dtype, cmf_format::Dtype::F32 | cmf_format::Dtype::F16));
            continue;
        };
        let mut named = vec![("q", a.q), ("k", a.k), ("v", a.v), ("o", a.o)];
        if let Ffn::Dense(m) = &w.ffn {
            named.extend([("gate", m.gate), ("up", m.up), ("down", m.down)]);
        }
        let mut codecs = Vec::new();
        for (n, m) in named {
            codecs.push(weights::check(&m, &format!("layer {l} {n}"))?);
        }
        if codecs[0] != codecs[1] || codecs[1] != codecs[2] || codecs.get(4) != codecs.get(5) {
            return Err(shape(format!(
                "layer {l}: q/k/v or gate/up in different codecs"
            )));
        }
        if let Ffn::Moe(m) = &w.ffn {
            moe::check(m, l)?;
        }
        all_float &= w
            .matrices()
            .iter()
            .all(|m| matches!(m.dtype, cmf_format::Dtype::F32 | cmf_format::Dtype::F16));
    }
    let kv_f32 = opts.precise
        || match opts.kv {
            KvPrecision::F32 => true,
            KvPrecision::F16 => false,
            KvPrecision::Auto => all_float,
        };
    let kv_elem = if kv_f32 { 4 } else { 2 };
    let kv_layer_bytes = (2 * s.num_kv_heads * opts.max_context * s.head_dim * kv_elem) as u64;
    // Up to about four blocks per SM for decode attention at long contexts (the kernel uses
    // fewer splits, at least `min_chunk` keys each, at short ones); more splits where a
    // split's scores would not fit in shared memory beside its q and per-warp outputs.
    let mut splits = (4 * dev.sm_count as usize)
        .div_ceil(s.num_kv_heads)
        .clamp(1, 128);
    // A split holds at most this many keys at the fewest (one block, or the smallest split).
    let one_block = DEC_ONE_BLOCK;
    let floor = tuning.min_chunk.max(one_block);
    let chunk = |p: usize| opts.max_context.div_ceil(p).max(floor);
    while decode_smem_bytes(group, s.head_dim, chunk(splits), splits) > 96 * 1024
        && chunk(splits) > floor
    {
        splits *= 2;
    }
    Ok(Plan {
        one_block,
        kv_f32,
        kv_layer_bytes,
        splits,
        chunk_max: chunk(splits),
    })
}

fn layer_weight_bytes(w: &LayerWeights) -> u64 {
    let a = w.attention();
    w.matrices().iter().map(weights::device_bytes).sum::<u64>()
        + w.gated_delta().map_or(0, gdn::vector_bytes)
        + 4 * (2 * w.attn_norm.len()
            + a.and_then(|a| a.q_bias).map_or(0, |b| b.len()) * 3
            + a.and_then(|a| a.q_norm).map_or(0, |b| b.len()) * 2) as u64
        + match &w.ffn {
            // The expert table.
            Ffn::Moe(m) => 72 * m.experts.len() as u64,
            Ffn::Dense(_) => 0,
        }
}

/// The bytes of a layer one decode step reads: [`layer_weight_bytes`] less the experts the
/// router does not choose.
fn layer_decode_bytes(w: &LayerWeights) -> u64 {
    let all: u64 = w.matrices().iter().map(weights::device_bytes).sum();
    layer_weight_bytes(w) - (all - w.bytes_per_token())
}

/// The MoE blocks of a model's layers.
fn moe_blocks<'a>(model: &'a LlmModel<'a>) -> impl Iterator<Item = &'a crate::llm::MoeWeights<'a>> {
    model.layers.iter().filter_map(|l| match &l.ffn {
        Ffn::Moe(m) => Some(m),
        Ffn::Dense(_) => None,
    })
}

pub fn footprint(dev: &Dev, model: &LlmModel, opts: &LlmOptions) -> Result<Footprint, Refusal> {
    let p = plan(dev, model, opts, DecodeTuning::default())?;
    // A GatedDeltaNet layer keeps its recurrent state instead of a KV cache.
    let layer_bytes = model
        .layers
        .iter()
        .map(|w| layer_weight_bytes(w) + w.gated_delta().map_or(p.kv_layer_bytes, gdn::state_bytes))
        .collect();
    let head_bytes = weights::device_bytes(&model.embed)
        + if model.head_is_tied() {
            0
        } else {
            weights::device_bytes(&model.lm_head)
        }
        + 4 * model.spec.hidden as u64;
    let fixed_bytes = DecodeWs::bytes(&model.spec, p.splits)
        + PrefillWs::bytes(model, opts.prefill_chunk, opts.precise)
        + MoeDecodeWs::bytes(moe_blocks(model), model.spec.hidden)
        + MoePrefillWs::sizes(moe_blocks(model), model.spec.hidden, opts.prefill_chunk)
            .map_or(0, |z| z.iter().sum::<usize>() as u64)
        + gdn::GdnWs::bytes(model, 1)
        + gdn::GdnWs::bytes(model, opts.prefill_chunk);
    Ok(Footprint {
        layer_bytes,
        head_bytes,
        fixed_bytes,
    })
}

fn upload_f32(dev: &Dev, v: &[f32]) -> DResult<DBuf> {
    dev.upload_new(bytes_of(v))
}

fn upload_opt(dev: &Dev, v: Option<&[f32]>) -> DResult<Option<DBuf>> {
    v.map(|v| upload_f32(dev, v)).transpose()
}

/// The decode attention's compile-time choices for `model` under plan `p`.
fn decode_attn_config(model: &LlmModel, p: &Plan, tuning: DecodeTuning) -> DecodeAttnConfig {
    DecodeAttnConfig {
        min_chunk: tuning.min_chunk,
        one_block: p.one_block,
        early_wait: decode_early_wait(model.layers.first().map_or(0, layer_decode_bytes)),
    }
}

impl CudaLlm {
    /// Loads `model`; `common` gives the shared kernels, called once the model's own modules
    /// are compiling, so a first run waits for the longer of the two, not their sum.
    pub fn load(
        dev: Arc<Dev>,
        common: impl FnOnce() -> Result<Arc<CommonKernels>, DevError>,
        model: &LlmModel,
        opts: &LlmOptions,
        placement: &Placement,
        tuning: DecodeTuning,
    ) -> Result<CudaLlm, Refusal> {
        if tuning.min_chunk == 0 {
            return Err(Self::refuse("llm.load", "decode min_chunk 0".into()));
        }
        let p = plan(&dev, model, opts, tuning)?;
        let s = &model.spec;
        let err = |e: DevError| e.refusal("llm.load");
        let (group, attn) = (
            s.num_heads / s.num_kv_heads,
            decode_attn_config(model, &p, tuning),
        );
        crate::cuda::runtime::kernels::prefetch(ModelKernels::jobs(
            &dev, s.head_dim, group, p.kv_f32, attn,
        ));
        let ck = common().map_err(err)?;
        let mk = ModelKernels::load(&dev, s.head_dim, group, p.kv_f32, attn).map_err(err)?;
        let smem = decode_smem_bytes(
            s.num_heads / s.num_kv_heads,
            s.head_dim,
            p.chunk_max,
            p.splits,
        );
        mk.attn_decode
            .allow_smem(smem.max(48 * 1024))
            .map_err(err)?;
        let short_smem = decode_short_smem_bytes(&p, s.num_heads / s.num_kv_heads, s.head_dim);
        let short = short_decode_choice(short_smem <= ck.max_block_smem);
        if short == ShortDecode::Staged {
            mk.attn_decode_short
                .allow_smem(short_smem.max(48 * 1024))
                .map_err(err)?;
        }
        let kv_half = (p.kv_layer_bytes / 2) as usize;
        // The layers on the device upload on several threads (Dev::each_parallel).
        let on_device: Vec<usize> = (0..s.num_layers)
            .filter(|&l| placement.on_device[l])
            .collect();
        let uploaded = dev
            .each_parallel(&on_device, Dev::LOADER_THREADS, |&l| {
                let w = &model.layers[l];
                let norm = |v: &[f32]| upload_f32(&dev, &gdn::norm_weight(s, v));
                let Some(a) = w.attention() else {
                    let g = w
                        .gated_delta()
                        .expect("a layer is attention or GatedDeltaNet");
                    let none = || gdn::no_weight(&dev);
                    return Ok(DevLayer {
                        q: none()?,
                        k: none()?,
                        v: none()?,
                        o: none()?,
                        ffn: DevFfn::upload(&dev, &w.ffn)?,
                        attn_norm: norm(w.attn_norm)?,
                        ffn_norm: norm(w.ffn_norm)?,
                        q_bias: None,
                        k_bias: None,
                        v_bias: None,
                        q_norm: None,
                        k_norm: None,
                        window: 0,
                        k_cache: dev.alloc(0)?,
                        v_cache: dev.alloc(0)?,
                        gdn: Some(gdn::DevGdn::upload(&dev, g)?),
                        gated: false,
                    });
                };
                let up = |m| DevWeight::upload(&dev, m);
                Ok(DevLayer {
                    q: up(&a.q)?,
                    k: up(&a.k)?,
                    v: up(&a.v)?,
                    o: up(&a.o)?,
                    ffn: DevFfn::upload(&dev, &w.ffn)?,
                    attn_norm: norm(w.attn_norm)?,
                    ffn_norm: norm(w.ffn_norm)?,
                    q_bias: upload_opt(&dev, a.q_bias)?,
                    k_bias: upload_opt(&dev, a.k_bias)?,
                    v_bias: upload_opt(&dev, a.v_bias)?,
                    q_norm: a.q_norm.map(&norm).transpose()?,
                    k_norm: a.k_norm.map(&norm).transpose()?,
                    window: s.sliding_window[l].map_or(0, |w| w.min(i32::MAX as usize) as i32),
                    // Zeroed: prefill attention stages whole tiles, and garbage could be NaN.
                    k_cache: dev.alloc_zeroed(kv_half)?,
                    v_cache: dev.alloc_zeroed(kv_half)?,
                    gdn: None,
                    gated: a.output_gate,
                })
            })
            .map_err(err)?;
        let mut layers: Vec<Option<DevLayer>> = (0..s.num_layers).map(|_| None).collect();
        for (l, layer) in on_device.into_iter().zip(uploaded) {
            layers[l] = Some(layer);
        }
        let (embed, lm_head, final_norm) = if placement.head_on_device {
            let embed = DevWeight::upload(&dev, &model.embed).map_err(err)?;
            let lm_head = if model.head_is_tied() {
                None
            } else {
                Some(DevWeight::upload(&dev, &model.lm_head).map_err(err)?)
            };
            (
                Some(embed),
                lm_head,
                Some(upload_f32(&dev, &gdn::norm_weight(s, model.final_norm)).map_err(err)?),
            )
        } else {
            (None, None, None)
        };
        let inv_freq = upload_f32(
            &dev,
            &s.rope
                .inv_freq
                .iter()
                .copied()
                .chain([0.0])
                .collect::<Vec<_>>(),
        )
        .map_err(err)?;
        let ws = DecodeWs::new(&dev, s, p.splits).map_err(err)?;
        let moe_ws = MoeDecodeWs::new(&dev, moe_blocks(model), s.hidden).map_err(err)?;
        let moe = match moe_ws {
            Some(_) => Some(MoeKernels::load(&dev, ck.max_block_smem).map_err(err)?),
            None => None,
        };
        let blas = Blas::new(&dev).ok();
        let hybrid = if gdn::is_hybrid(model) {
            Some(gdn::Hybrid::load(&dev, model, opts.prefill_chunk).map_err(err)?)
        } else {
            None
        };
        // A step launched ahead would advance a recurrent state past what the caller keeps.
        let mut ahead = DecodeAhead::new().map_err(err)?;
        ahead.enabled &= !model.is_recurrent();
        Ok(CudaLlm {
            dev,
            ck,
            mk,
            spec: s.clone(),
            opts: opts.clone(),
            placement: placement.clone(),
            layers,
            embed,
            lm_head,
            final_norm,
            inv_freq,
            kv_f32: p.kv_f32,
            splits: p.splits,
            chunk_max: p.chunk_max,
            ws,
            pf: None,
            pf_sizes: PrefillWs::sizes_for(model, opts.prefill_chunk, opts.precise),
            pf_start: 0,
            moe,
            moe_ws,
            moe_pf: None,
            moe_pf_sizes: MoePrefillWs::sizes(moe_blocks(model), s.hidden, opts.prefill_chunk),
            blas,
            graphs: [None, None],
            q8_step: std::cell::Cell::new(false),
            short,
            one_block: p.one_block,
            smem: DecodeSmemBytes {
                decode: smem,
                decode_short: short_smem,
            },
            enqueue_short: std::cell::Cell::new(false),
            dev_inputs: None,
            ahead,
            attn: AttnKernel::Fa2,
            pool: None,
            hybrid,
        }
        .with_attention(AttnKernel::Fa2))
    }

    fn head_weight(&self) -> Option<&DevWeight> {
        self.lm_head.as_ref().or(self.embed.as_ref())
    }

    fn bind(&self, op: &'static str) -> Result<(), Refusal> {
        self.dev.bind_to_thread().map_err(|e| e.refusal(op))
    }

    fn need_whole(&self, op: &'static str) -> Result<(), Refusal> {
        if !self.placement.is_whole_model() {
            return Err(Refusal::new(
                op,
                RefusalReason::NotResident("part of the model is on the CPU".into()),
            ));
        }
        Ok(())
    }

    /// One decode step (`step`) after the checks every decode takes: the whole model resident,
    /// the position inside the device context, the token inside the vocabulary, a sampler the
    /// device draws; a hybrid's recurrent state at `pos` before and one past it after.
    fn checked_decode<T>(
        &mut self,
        op: &'static str,
        token: u32,
        pos: usize,
        sampler: &Sampler,
        step: impl FnOnce(&mut Self) -> DResult<T>,
    ) -> Result<T, Refusal> {
        if !self.placement.is_whole_model() {
            return Err(Refusal::new(
                op,
                RefusalReason::NotResident("part of the model is on the CPU".into()),
            ));
        }
        if pos >= self.opts.max_context {
            return Err(Refusal::new(
                op,
                RefusalReason::NotResident(format!(
                    "position {pos} ≥ device context {}",
                    self.opts.max_context
                )),
            ));
        }
        if token as usize >= self.spec.vocab {
            return Err(Self::refuse(
                op,
                format!("token {token} ≥ vocab {}", self.spec.vocab),
            ));
        }
        self.check_sampler(sampler)?;
        self.bind(op)?;
        self.hybrid_begin(op, pos)?;
        let r = step(self);
        self.hybrid_end(r.is_ok().then_some(pos + 1));
        r.map_err(|e| e.refusal(op))
    }

    fn refuse(op: &'static str, why: String) -> Refusal {
        Refusal::new(op, RefusalReason::UnsupportedShape(why))
    }

    fn check_sampler(&self, sampler: &Sampler) -> Result<(), Refusal> {
        if let Sampler::Sample(s) = sampler {
            let why = s.device_limit().or_else(|| {
                let ok = s.temperature.is_finite()
                    && s.temperature >= 0.0
                    && s.top_p > 0.0
                    && s.top_p <= 1.0
                    && (0.0..=1.0).contains(&s.min_p)
                    && s.repeat_penalty.is_finite()
                    && s.repeat_penalty > 0.0
                    && s.presence_penalty.is_finite()
                    && s.frequency_penalty.is_finite();
                (!ok).then(|| format!("sampler {s:?} out of range"))
            });
            if let Some(why) = why {
                return Err(Self::refuse("llm.decode", why));
            }
        }
        Ok(())
    }

    /// Records `tokens` at positions `start..` in the penalty ring (the window of later
    /// sampled steps).
    fn record_history(&self, tokens: &[u32], start: usize) -> DResult<()> {
        use workspace::HIST_SLOTS;
        let keep = tokens.len().min(HIST_SLOTS);
        let first = start + tokens.len() - keep;
        let ids: Vec<i32> = tokens[tokens.len() - keep..]
            .iter()
            .map(|&t| t as i32)
            .collect();
        // At most two contiguous runs of the ring.
        let slot = first % HIST_SLOTS;
        let run = keep.min(HIST_SLOTS - slot);
        self.dev
            .upload(self.ws.hist.at(4 * slot), bytes_of(&ids[..run]))?;
        self.dev.upload(self.ws.hist.ptr(), bytes_of(&ids[run..]))
    }

    /// Selects the prefill attention kernel; falls back to `Simple` where the tensor-core
    /// kernel does not apply (f32 cache, head_dim > 128).
    fn with_attention(mut self, k: AttnKernel) -> Self {
        self.set_attention(k);
        self
    }

    /// Test and profiling hook: `Simple` runs the fallback kernel where fa2 would apply.
    pub fn set_attention(&mut self, k: AttnKernel) {
        self.attn = match k {
            AttnKernel::Fa2 if self.mk.attn_prefill_fa2.is_some() => AttnKernel::Fa2,
            _ => AttnKernel::Simple,
        };
    }

    pub fn attention(&self) -> AttnKernel {
        self.attn
    }

    /// Test hook: the short-context decode graph with `Grid` (unstaged) attention where
    /// `Staged` would run; `Staged` only where its shared memory fits. Drops the captured
    /// graphs.
    pub fn set_short_decode(&mut self, mode: ShortDecode) {
        let _ = self.settle();
        self.short = match mode {
            ShortDecode::Staged if self.smem.decode_short <= self.ck.max_block_smem => {
                ShortDecode::Staged
            }
            _ => ShortDecode::Grid,
        };
        self.graphs = [None, None];
    }

    /// Test hook: decoding step by step, each graph launched only after the previous token
    /// was read (tests compare it with decoding one token ahead, the default).
    pub fn set_decode_ahead(&mut self, on: bool) {
        let _ = self.settle();
        // Never for a recurrent model: a step launched ahead advances its state.
        self.ahead.enabled = on && !self.layers.iter().flatten().any(|d| d.gdn.is_some());
    }

    /// Whether the KV cache is f32 (f32/f16 models) rather than f16.
    pub fn kv_is_f32(&self) -> bool {
        self.kv_f32
    }

    /// Decode attention split count (for reports).
    pub fn attention_splits(&self) -> usize {
        self.splits
    }

    /// How short contexts run decode attention (for reports).
    pub fn short_decode(&self) -> ShortDecode {
        self.short
    }
}

impl Drop for CudaLlm {
    fn drop(&mut self) {
        // A graph launched ahead must finish before its graph and token ring are freed.
        let _ = self.settle();
    }
}

impl LlmDevice for CudaLlm {
    fn placement(&self) -> &Placement {
        &self.placement
    }

    fn max_context(&self) -> usize {
        self.opts.max_context
    }

    fn decode(
        &mut self,
        token: u32,
        pos: usize,
        sampler: &Sampler,
        want_logits: bool,
        out: &mut DecodeOutput,
    ) -> Result<(), Refusal> {
        let (tok, logits) = self.checked_decode("llm.decode", token, pos, sampler, |s| {
            s.decode_step(token, pos, sampler, want_logits)
        })?;
        out.token = tok;
        out.logits = logits;
        Ok(())
    }

    fn decode_masked(
        &mut self,
        token: u32,
        pos: usize,
        sampler: &Sampler,
        mask: &mut dyn FnMut(&mut [u32]),
    ) -> Result<u32, Refusal> {
        self.checked_decode("llm.decode_masked", token, pos, sampler, |s| {
            s.decode_masked_step(token, pos, sampler, mask)
        })
    }

    fn prefill(
        &mut self,
        tokens: &[u32],
        start: usize,
        logits: Logits,
        out: &mut [f32],
    ) -> Result<(), Refusal> {
        const OP: &str = "llm.prefill";
        if !self.placement.is_whole_model() {
            return Err(Refusal::new(
                OP,
                RefusalReason::NotResident("part of the model is on the CPU".into()),
            ));
        }
        if tokens.is_empty() || start + tokens.len() > self.opts.max_context {
            return Err(Refusal::new(
                OP,
                RefusalReason::NotResident(format!(
                    "positions {start}..{} past device context {}",
                    start + tokens.len(),
                    self.opts.max_context
                )),
            ));
        }
        if let Some(t) = tokens.iter().find(|&&t| t as usize >= self.spec.vocab) {
            return Err(Self::refuse(
                OP,
                format!("token {t} ≥ vocab {}", self.spec.vocab),
            ));
        }
        if out.len() != logits.len(tokens.len(), self.spec.vocab) {
            return Err(Self::refuse(
                OP,
                format!(
                    "logits buffer of {} floats, {} needed",
                    out.len(),
                    logits.len(tokens.len(), self.spec.vocab)
                ),
            ));
        }
        if self.blas.is_none() {
            return Err(Refusal::new(
                OP,
                RefusalReason::Device("cuBLAS is not available".into()),
            ));
        }
        self.bind(OP)?;
        self.hybrid_begin(OP, start)?;
        self.record_history(tokens, start)
            .map_err(|e| e.refusal(OP))?;
        let result = self.prefill_all(tokens, start, logits);
        self.hybrid_end(result.is_ok().then_some(start + tokens.len()));
        let result = result.map_err(|e| e.refusal(OP))?;
        out.copy_from_slice(&result);
        Ok(())
    }

    fn forward_layers(
        &mut self,
        layers: Range<usize>,
        x: &mut [f32],
        t: usize,
        start: usize,
    ) -> Result<(), Refusal> {
        const OP: &str = "llm.forward_layers";
        if layers.end > self.layers.len() || layers.clone().any(|l| self.layers[l].is_none()) {
            return Err(Refusal::new(
                OP,
                RefusalReason::NotResident(format!("layers {layers:?}")),
            ));
        }
        if self.hybrid.is_some() {
            return Err(Self::refuse(
                OP,
                "hybrid placement of GatedDeltaNet or output-gated layers".into(),
            ));
        }
        if t == 0 || x.len() != t * self.spec.hidden || start + t > self.opts.max_context {
            return Err(Self::refuse(
                OP,
                format!("{t} tokens at {start}, x of {} floats", x.len()),
            ));
        }
        if t > 1 && (self.blas.is_none() || t > self.opts.prefill_chunk) {
            return Err(Refusal::new(
                OP,
                RefusalReason::Device("batched layers need cuBLAS and t ≤ prefill_chunk".into()),
            ));
        }
        self.bind(OP)?;
        let y = self
            .run_layers(layers, x, t, start)
            .map_err(|e| e.refusal(OP))?;
        x.copy_from_slice(&y);
        Ok(())
    }

    fn head(&mut self, x: &[f32], t: usize, logits: &mut [f32]) -> Result<(), Refusal> {
        const OP: &str = "llm.head";
        if !self.placement.head_on_device {
            return Err(Refusal::new(
                OP,
                RefusalReason::NotResident("lm_head".into()),
            ));
        }
        if t == 0 || x.len() != t * self.spec.hidden || logits.len() != t * self.spec.vocab {
            return Err(Self::refuse(
                OP,
                format!("{t} rows, x {} / logits {} floats", x.len(), logits.len()),
            ));
        }
        self.bind(OP)?;
        let y = self.run_head(x, t).map_err(|e| e.refusal(OP))?;
        logits.copy_from_slice(&y);
        Ok(())
    }

    fn kv_block_bytes(&self, block_size: usize) -> u64 {
        self.pool_block_bytes(block_size)
    }

    fn kv_pool(&mut self, bytes: u64, block_size: usize) -> Result<PoolShape, Refusal> {
        const OP: &str = "llm.kv_pool";
        self.need_whole(OP)?;
        if self.hybrid.is_some() {
            return Err(Self::refuse(
                OP,
                "the batched step has no GatedDeltaNet or output-gated layers".into(),
            ));
        }
        self.bind(OP)?;
        self.alloc_pool(bytes, block_size)
    }

    fn batch_step(&mut self, seqs: &[BatchSeq], out: BatchOut) -> Result<(), Refusal> {
        const OP: &str = "llm.batch_step";
        self.need_whole(OP)?;
        if self.blas.is_none() {
            return Err(Refusal::new(
                OP,
                RefusalReason::Device("cuBLAS is not available".into()),
            ));
        }
        let shape = self.pool.as_ref().map(|p| p.shape);
        batch::validate(seqs, &out, shape, self.spec.vocab, self.opts.prefill_chunk)?;
        self.bind(OP)?;
        self.run_batch_step(seqs, out).map_err(|e| e.refusal(OP))
    }
}

/// Device bytes of the codec planes only (what "resident in its codec" promises).
pub fn weight_bytes_resident(llm: &CudaLlm) -> u64 {
    let l: u64 = llm
        .layers
        .iter()
        .flatten()
        .map(|d| {
            [&d.q, &d.k, &d.v, &d.o]
                .into_iter()
                .chain(d.gdn.iter().flat_map(|g| g.weights()))
                .chain(d.ffn.weights())
                .map(|w| w.bytes())
                .sum::<u64>()
        })
        .sum();
    l + llm.embed.as_ref().map_or(0, |w| w.bytes()) + llm.lm_head.as_ref().map_or(0, |w| w.bytes())
}

impl CudaLlm {
    /// Codec of layer 0's q projection (for reports).
    pub fn codec(&self) -> Option<DevCodec> {
        self.layers
            .iter()
            .flatten()
            .next()
            .map(|l| l.gdn.as_ref().map_or(l.q.codec, |g| g.qkvz.codec))
    }
}
