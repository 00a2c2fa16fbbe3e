//! Activation buffers. Decode buffers are allocated once at load (the captured graph bakes
//! their addresses in); prefill buffers on the first prefill, for `prefill_chunk` tokens.

use crate::cuda::runtime::device::{DBuf, DResult, Dev};
use crate::cuda::runtime::weights::DevCodec;
use crate::llm::{Ffn, LlmModel, LlmSpec, Mlp};

/// Candidates per sampler block (`TOPK_MAX` in sample.cu) and blocks (`SAMPLE_BLOCKS`).
pub const TOPK_MAX: usize = crate::llm::sample::DEVICE_TOP_K_MAX;
pub const SAMPLE_BLOCKS: usize = 256;
/// Slots of the penalty ring (a power of two: the longest device penalty window).
pub const HIST_SLOTS: usize = crate::llm::sample::DEVICE_PENALTY_WINDOW;

/// Decode: one token's activations, all f32.
pub struct DecodeWs {
    /// [H] residual stream.
    pub h: DBuf,
    /// [NH·D + 2·NKV·D] q, k, v.
    pub qkv: DBuf,
    /// [NH, splits, D + 2] attention partials.
    pub part: DBuf,
    /// [NH·D] attention output.
    pub attn: DBuf,
    /// [I] SwiGLU output.
    pub act: DBuf,
    /// [V]
    pub logits: DBuf,
    /// Sampler candidates: [SAMPLE_BLOCKS·TOPK_MAX] values and ids.
    pub cand_v: DBuf,
    pub cand_i: DBuf,
    /// f32 [V]: the sampler's weights (scratch).
    pub weights: DBuf,
    /// u64 words the sampler's vocabulary passes share (sampler.rs: `sc`).
    pub sample_scratch: DBuf,
    /// i32 [HIST_SLOTS]: the token at each recent position, at `pos % HIST_SLOTS` (the
    /// penalties' window; written by prefill and by every decode step).
    pub hist: DBuf,
    /// i32 [4]: token (the embedding's input), position, two spare (the sampled token goes to
    /// the token ring: ahead.rs).
    pub io: DBuf,
    /// i32 [NKV]: finished split blocks per kv head (decode attention's merge; self-resetting).
    pub count: DBuf,
}

impl DecodeWs {
    fn sizes(s: &LlmSpec, splits: usize) -> [usize; 13] {
        [
            4 * s.hidden,
            4 * (s.q_dim() + 2 * s.kv_dim()),
            4 * s.num_heads * splits * (s.head_dim + 2),
            4 * s.q_dim(),
            4 * s.intermediate,
            4 * s.vocab,
            4 * SAMPLE_BLOCKS * TOPK_MAX,
            4 * SAMPLE_BLOCKS * TOPK_MAX,
            16,
            4 * s.num_kv_heads,
            4 * s.vocab,
            4 * HIST_SLOTS,
            super::sampler::SCRATCH_BYTES,
        ]
    }

    pub fn bytes(s: &LlmSpec, splits: usize) -> u64 {
        Self::sizes(s, splits).iter().sum::<usize>() as u64
    }

    pub fn new(dev: &Dev, s: &LlmSpec, splits: usize) -> DResult<DecodeWs> {
        let z = Self::sizes(s, splits);
        Ok(DecodeWs {
            h: dev.alloc_zeroed(z[0])?,
            qkv: dev.alloc_zeroed(z[1])?,
            part: dev.alloc_zeroed(z[2])?,
            attn: dev.alloc_zeroed(z[3])?,
            act: dev.alloc_zeroed(z[4])?,
            logits: dev.alloc_zeroed(z[5])?,
            cand_v: dev.alloc_zeroed(z[6])?,
            cand_i: dev.alloc_zeroed(z[7])?,
            io: dev.alloc_zeroed(z[8])?,
            count: dev.alloc_zeroed(z[9])?,
            weights: dev.alloc_zeroed(z[10])?,
            hist: dev.alloc_zeroed(z[11])?,
            sample_scratch: dev.alloc_zeroed(z[12])?,
        })
    }

    pub fn tok(&self) -> u64 {
        self.io.at(0)
    }
    pub fn pos(&self) -> u64 {
        self.io.at(4)
    }
}

/// Prefill: `cap` tokens of activations.
pub struct PrefillWs {
    /// i32 [cap] tokens, then i32 start position.
    pub tokens: DBuf,
    pub start: DBuf,
    /// [cap, H] residual stream.
    pub h: DBuf,
    /// [cap, H] normed input (f32).
    pub xn: DBuf,
    /// bf16 [cap, max(H, NH·D, I)]: the bf16 operand of the next GEMM.
    pub xb: DBuf,
    /// [cap, NH·D + 2·NKV·D]
    pub qkv: DBuf,
    /// [cap, NH·D]
    pub qr: DBuf,
    pub attn: DBuf,
    /// [cap, 2·I] gate | up (I: the widest MLP, dense or expert).
    pub gu: DBuf,
    /// [cap, I] f32 SwiGLU output (f32-GEMM models only; else 4 bytes).
    pub act_f: DBuf,
    /// Dequantised weight rows (bf16 or f32), reused matrix after matrix.
    pub scratch: DBuf,
    /// [V] last-row logits.
    pub logits_last: DBuf,
    /// [cap, V] all-row logits, allocated on first use.
    pub logits_all: Option<DBuf>,
}

/// Bytes of dequantisation scratch: the largest layer matrix that needs it, and up to 512 MiB
/// of lm_head rows (the lm_head GEMM is chunked through it).
pub fn scratch_bytes(model: &LlmModel, precise: bool) -> usize {
    let need = |w: &cmf_kernels::Weight| -> usize {
        match DevCodec::of(w.dtype) {
            Ok(DevCodec::F32) => 0,
            _ if precise => 4 * w.rows * w.cols,
            Ok(DevCodec::Q8 | DevCodec::Q4) => 2 * w.rows * w.cols,
            Ok(DevCodec::F16) => 4 * w.rows * w.cols,
            _ => 0,
        }
    };
    let layers = model
        .layers
        .iter()
        .flat_map(|l| l.matrices())
        .map(|w| need(&w))
        .max()
        .unwrap_or(0);
    let head = need(&model.lm_head).min(512 << 20);
    // At least one row of the head (so chunking always progresses).
    layers.max(head).max(4 * model.spec.hidden)
}

/// Every MLP of the model's feed-forward blocks (dense, routed experts, shared experts).
fn mlps<'a>(model: &'a LlmModel<'a>) -> impl Iterator<Item = &'a Mlp<'a>> {
    model.layers.iter().flat_map(|l| -> Vec<&'a Mlp<'a>> {
        match &l.ffn {
            Ffn::Dense(m) => vec![m],
            Ffn::Moe(m) => m
                .experts
                .iter()
                .chain(m.shared.iter().map(|s| &s.mlp))
                .collect(),
        }
    })
}

fn downs<'a>(model: &'a LlmModel<'a>) -> impl Iterator<Item = &'a cmf_kernels::Weight<'a>> {
    mlps(model).map(|m| &m.down)
}

/// The widest intermediate of any MLP (the prefill's gate|up and SwiGLU buffers).
fn ffn_width(model: &LlmModel) -> usize {
    mlps(model).map(|m| m.width()).max().unwrap_or(0)
}

impl PrefillWs {
    fn sizes(model: &LlmModel, cap: usize, precise: bool) -> [usize; 12] {
        let s = &model.spec;
        let f32_act = precise
            || downs(model).any(|d| {
                !DevCodec::of(d.dtype)
                    .map(|c| c.gemm_in_bf16())
                    .unwrap_or(true)
            });
        let ffn = ffn_width(model);
        let widest = s.hidden.max(s.q_dim()).max(ffn);
        [
            4 * cap,
            4,
            4 * cap * s.hidden,
            4 * cap * s.hidden,
            2 * cap * widest,
            4 * cap * (s.q_dim() + 2 * s.kv_dim()),
            4 * cap * s.q_dim(),
            4 * cap * s.q_dim(),
            4 * cap * 2 * ffn,
            if f32_act { 4 * cap * ffn } else { 4 },
            scratch_bytes(model, precise),
            4 * s.vocab,
        ]
    }

    pub fn bytes(model: &LlmModel, cap: usize, precise: bool) -> u64 {
        Self::sizes(model, cap, precise).iter().sum::<usize>() as u64
    }

    pub fn new(dev: &Dev, model_sizes: [usize; 12]) -> DResult<PrefillWs> {
        let z = model_sizes;
        Ok(PrefillWs {
            tokens: dev.alloc(z[0])?,
            start: dev.alloc(z[1])?,
            h: dev.alloc(z[2])?,
            xn: dev.alloc(z[3])?,
            xb: dev.alloc(z[4])?,
            qkv: dev.alloc(z[5])?,
            qr: dev.alloc(z[6])?,
            attn: dev.alloc(z[7])?,
            gu: dev.alloc(z[8])?,
            act_f: dev.alloc(z[9])?,
            scratch: dev.alloc(z[10])?,
            logits_last: dev.alloc(z[11])?,
            logits_all: None,
        })
    }

    pub fn sizes_for(model: &LlmModel, cap: usize, precise: bool) -> [usize; 12] {
        Self::sizes(model, cap, precise)
    }
}
