//! A neutral description of a decoder-only LLM, as the GPU backends consume it: geometry plus
//! per-layer weights borrowed from the model file in their storage codec. Model crates
//! (cmf-llm) build one of these; cmf-gpu never depends on them.
//!
//! Shapes (letters used throughout the crate): H hidden, I intermediate, NH query heads,
//! NKV key/value heads, D head dim, V vocabulary, T tokens in a batch, S positions in the cache.
//! The graph is the Llama family's: pre-norm RMSNorm, GQA attention with RoPE (rotate-half),
//! optional q/k/v biases (Qwen2) and per-head q/k RMSNorm (Qwen3); the feed-forward block is a
//! SwiGLU MLP or a mixture of SwiGLU experts (Qwen3-MoE, Qwen2-MoE with its shared expert).
//! Hybrid models (Qwen3-Next) mix GatedDeltaNet layers ([`GdnWeights`]) with output-gated
//! attention and use zero-centred `(1 + w)` norms ([`LlmSpec::norm_style`]).

pub mod batch;
pub mod batch_check;
pub mod reference;
pub mod sample;
pub mod synth;

use crate::facade::refusal::{Refusal, RefusalReason};
use cmf_kernels::Weight;
pub use cmf_kernels::{GdnGeometry, NormStyle};

/// Rotary embedding, precomputed by the model crate so every scaling scheme (linear, Llama-3,
/// YaRN) reduces to a frequency table and a magnitude.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeSpec {
    /// `inv_freq[i]` for i < rotary_dim / 2; angle = position · inv_freq[i]. Dimensions past
    /// `2 · inv_freq.len()` (partial rotary) pass through unrotated.
    pub inv_freq: Vec<f32>,
    /// Multiplies cos and sin (YaRN's attention factor; 1 otherwise).
    pub attention_factor: f32,
}

/// Model geometry and the numeric constants the graph needs.
#[derive(Debug, Clone, PartialEq)]
pub struct LlmSpec {
    pub hidden: usize,
    pub intermediate: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub rms_eps: f32,
    pub rope: RopeSpec,
    /// Per layer: keys at positions > q − window are visible (None: all previous keys).
    pub sliding_window: Vec<Option<usize>>,
    /// Multiplies q·k before the softmax (1/√D for every supported family).
    pub attn_scale: f32,
    /// How the layer norms, the q/k norms and the final norm apply their weight: `x̂·w`, or
    /// `x̂·(1 + w)` (Qwen3-Next). The GatedDeltaNet's gated norm is always `x̂·w`.
    pub norm_style: NormStyle,
}

impl LlmSpec {
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

/// One transformer layer: pre-norm token mixer, then pre-norm feed-forward block, each added
/// to the residual stream. Norm vectors and biases are f32 (the model crate converts them
/// once; they are small).
#[derive(Debug, Clone)]
pub struct LayerWeights<'a> {
    /// [H] input_layernorm.
    pub attn_norm: &'a [f32],
    pub mixer: Mixer<'a>,
    /// [H] post_attention_layernorm.
    pub ffn_norm: &'a [f32],
    pub ffn: Ffn<'a>,
}

/// The token mixer of a layer.
#[derive(Debug, Clone)]
pub enum Mixer<'a> {
    Attention(AttentionWeights<'a>),
    /// A GatedDeltaNet linear-attention layer (Qwen3-Next).
    GatedDelta(GdnWeights<'a>),
}

/// A GatedDeltaNet mixer, as transformers' `Qwen3NextGatedDeltaNet`:
///
/// ```text
/// q,k,v,z = xn·W_qkvzᵀ   b,a = xn·W_baᵀ        (rows grouped per key head:
///                                              [q | k | v (r heads) | z (r heads)], [b (r) | a (r)])
/// q,k,v   = silu(causal depthwise conv(q|k|v))
/// q,k     = l2norm(q)/√dk, l2norm(k);  β = sigmoid(b);  g = −exp(A_log)·softplus(a + dt_bias)
/// per value head, state S [dk, dv]:  S ← e^g·S;  S ← S + k ⊗ β(v − Sᵀk);  o = Sᵀq
/// x += (rmsnorm(o)·w ⊙ silu(z))·W_outᵀ
/// ```
#[derive(Debug, Clone, Copy)]
pub struct GdnWeights<'a> {
    pub geometry: GdnGeometry,
    /// [2·Kd + 2·Vd, H]
    pub qkvz: Weight<'a>,
    /// [2·v_heads, H]
    pub ba: Weight<'a>,
    /// [C, W] taps per channel, oldest input first.
    pub conv: &'a [f32],
    /// [v_heads] each.
    pub a_log: &'a [f32],
    pub dt_bias: &'a [f32],
    /// [dv] the gated norm's weight (plain `x̂·w`).
    pub norm: &'a [f32],
    /// [H, Vd]
    pub out: Weight<'a>,
}

/// GQA attention with RoPE (partial rotary when the spec's RoPE covers fewer dimensions).
#[derive(Debug, Clone, Copy)]
pub struct AttentionWeights<'a> {
    /// [NH·D, H] ([2·NH·D, H] with `output_gate`), [NKV·D, H], [NKV·D, H], [H, NH·D].
    pub q: Weight<'a>,
    pub k: Weight<'a>,
    pub v: Weight<'a>,
    pub o: Weight<'a>,
    /// Qwen2: [NH·D], [NKV·D], [NKV·D].
    pub q_bias: Option<&'a [f32]>,
    pub k_bias: Option<&'a [f32]>,
    pub v_bias: Option<&'a [f32]>,
    /// Qwen3: [D] RMSNorm over each head of q and k, before RoPE.
    pub q_norm: Option<&'a [f32]>,
    pub k_norm: Option<&'a [f32]>,
    /// Qwen3-Next: q emits per head D query values then D gate values, and the attention
    /// output is multiplied by `sigmoid(gate)` before `o`.
    pub output_gate: bool,
}

/// The feed-forward block of a layer.
#[derive(Debug, Clone)]
pub enum Ffn<'a> {
    /// One SwiGLU MLP of width I (`spec.intermediate`).
    Dense(Mlp<'a>),
    /// A mixture of experts.
    Moe(MoeWeights<'a>),
}

/// A SwiGLU MLP without biases: `down(silu(gate·x) ⊙ up·x)`; gate / up [F, H], down [H, F].
#[derive(Debug, Clone, Copy)]
pub struct Mlp<'a> {
    pub gate: Weight<'a>,
    pub up: Weight<'a>,
    pub down: Weight<'a>,
}

impl<'a> Mlp<'a> {
    /// Intermediate width F.
    pub fn width(&self) -> usize {
        self.gate.rows
    }
    pub fn matrices(&self) -> [Weight<'a>; 3] {
        [self.gate, self.up, self.down]
    }
}

/// How a router turns its scores into the chosen experts and their weights (the same
/// algorithms as the CPU model, transformers' Qwen3-MoE / Qwen2-MoE / DeepSeek-V3 routers).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Routing<'a> {
    /// Softmax over all experts; the k largest probabilities (ties: the lower id), renormalised
    /// to sum 1 when `norm_topk_prob`.
    Softmax,
    /// DeepSeek-V3's `noaux_tc`: per-expert sigmoid scores; selection on score + `bias`
    /// within the `topk_group` best of `n_group` groups (a group's score: its two best); the
    /// weights are the unbiased scores (renormalised when `norm_topk_prob`) times
    /// `routed_scaling_factor`. The CUDA backend refuses it.
    SigmoidGroup {
        n_group: usize,
        topk_group: usize,
        routed_scaling_factor: f32,
        /// [E]
        bias: &'a [f32],
    },
}

/// An always-on shared expert, scaled by `sigmoid(gate · x)` when it has a gate (Qwen2-MoE).
#[derive(Debug, Clone, Copy)]
pub struct SharedExpert<'a> {
    pub mlp: Mlp<'a>,
    /// [1, H] `shared_expert_gate`.
    pub gate: Option<Weight<'a>>,
}

/// A mixture-of-experts block: `Σ_{e ∈ top_k} w_e · expert_e(x) (+ shared(x))`.
#[derive(Debug, Clone)]
pub struct MoeWeights<'a> {
    /// [E, H] router.
    pub router: Weight<'a>,
    /// E routed experts of one width F, each in any codec the dense MLP accepts.
    pub experts: Vec<Mlp<'a>>,
    pub top_k: usize,
    pub norm_topk_prob: bool,
    pub routing: Routing<'a>,
    pub shared: Option<SharedExpert<'a>>,
}

impl<'a> MoeWeights<'a> {
    /// Every matrix of the block: router, experts, shared expert (and its gate).
    pub fn matrices(&self) -> Vec<Weight<'a>> {
        let mut v = vec![self.router];
        v.extend(self.experts.iter().flat_map(|e| e.matrices()));
        if let Some(sh) = &self.shared {
            v.extend(sh.mlp.matrices());
            v.extend(sh.gate);
        }
        v
    }
}

impl<'a> Ffn<'a> {
    /// Every matrix of the block.
    pub fn matrices(&self) -> Vec<Weight<'a>> {
        match self {
            Ffn::Dense(m) => m.matrices().to_vec(),
            Ffn::Moe(m) => m.matrices(),
        }
    }
}

impl<'a> LayerWeights<'a> {
    /// The attention weights; None for a GatedDeltaNet layer.
    pub fn attention(&self) -> Option<&AttentionWeights<'a>> {
        match &self.mixer {
            Mixer::Attention(a) => Some(a),
            Mixer::GatedDelta(_) => None,
        }
    }

    /// The GatedDeltaNet weights; None for an attention layer.
    pub fn gated_delta(&self) -> Option<&GdnWeights<'a>> {
        match &self.mixer {
            Mixer::GatedDelta(g) => Some(g),
            Mixer::Attention(_) => None,
        }
    }

    /// Every matrix of the layer: the mixer's (q, k, v, o or qkvz, ba, out), then the
    /// feed-forward block's.
    pub fn matrices(&self) -> Vec<Weight<'a>> {
        let mut v = match &self.mixer {
            Mixer::Attention(a) => vec![a.q, a.k, a.v, a.o],
            Mixer::GatedDelta(g) => vec![g.qkvz, g.ba, g.out],
        };
        v.extend(self.ffn.matrices());
        v
    }

    /// Matrix bytes one decode step reads: everything but the experts not chosen (k of E).
    pub fn bytes_per_token(&self) -> u64 {
        let all: u64 = self.matrices().iter().map(|w| w.data.len() as u64).sum();
        match &self.ffn {
            Ffn::Dense(_) => all,
            Ffn::Moe(m) => {
                let idle = m.experts.len().saturating_sub(m.top_k) as u64;
                let one: u64 = m.experts.first().map_or(0, |e| {
                    e.matrices().iter().map(|w| w.data.len() as u64).sum()
                });
                all - idle * one
            }
        }
    }
}

/// A whole model: spec, embedding, layers, final norm, lm_head (the same matrix as the
/// embedding when tied; backends upload it once then).
#[derive(Debug, Clone)]
pub struct LlmModel<'a> {
    pub spec: LlmSpec,
    /// [V, H].
    pub embed: Weight<'a>,
    pub layers: Vec<LayerWeights<'a>>,
    /// [H].
    pub final_norm: &'a [f32],
    /// [V, H].
    pub lm_head: Weight<'a>,
}

/// Precision of the device KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvPrecision {
    /// f32 when every weight is f32/f16 (parity with the CPU path matters more than speed on
    /// such models), else f16.
    #[default]
    Auto,
    F16,
    F32,
}

/// How a device session is set up.
#[derive(Debug, Clone, PartialEq)]
pub struct LlmOptions {
    /// Positions the device KV cache holds.
    pub max_context: usize,
    pub kv: KvPrecision,
    /// Longest prompt piece one prefill pass takes; longer prompts are chunked.
    pub prefill_chunk: usize,
    /// f32 everywhere the backend would otherwise round for speed: f32 KV cache, prefill
    /// GEMMs in f32 (weights dequantised to f32, no bf16 operands). For parity checks.
    pub precise: bool,
    /// The batched step's kernels (default: [`ENV_BATCH_KERNELS`], else the verified ones).
    pub batch_kernels: BatchKernels,
}

/// Diagnostics switch: `CMF_GPU_BATCH_KERNELS=next` runs the batched step on kernels whose parity
/// tests compile but have not yet run on a device ([`BatchKernels::Next`]).
pub const ENV_BATCH_KERNELS: &str = "CMF_GPU_BATCH_KERNELS";

/// Which kernels the device's batched step runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchKernels {
    /// Run on an H100 (2026-12-07): the paged attention in rounds of 32 keys (a block per row
    /// and kv head) and the int8 GEMM (s8 inputs in blocks of 32) in steps of up to 16 rows.
    Verified,
    /// Not yet run on a device: the paged attention split over the keys (flash-decoding) and the
    /// W8A16 GEMM (bf16 inputs, s8 weights widened in registers) in steps of up to 256 rows.
    Next,
}

impl BatchKernels {
    /// [`ENV_BATCH_KERNELS`]'s choice.
    pub fn from_env() -> BatchKernels {
        match std::env::var(ENV_BATCH_KERNELS).as_deref() {
            Ok("next") => BatchKernels::Next,
            _ => BatchKernels::Verified,
        }
    }
}

impl Default for LlmOptions {
    fn default() -> Self {
        LlmOptions {
            max_context: 4096,
            kv: KvPrecision::Auto,
            prefill_chunk: 4096,
            precise: false,
            batch_kernels: BatchKernels::from_env(),
        }
    }
}

/// Token choice on the device at the end of a decode step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sampler {
    /// The arg-max, ties to the lowest id.
    Greedy,
    /// The whole sampling algorithm of [`sample`] (penalties, temperature, top-k, top-p, min-p,
    /// a draw from (seed, position)); a backend refuses specs past its limits
    /// ([`sample::SampleSpec::device_limit`]).
    Sample(sample::SampleSpec),
}

impl Sampler {
    /// `Greedy` for a greedy spec without penalties (the cheaper graph), else `Sample`.
    pub fn of(spec: &sample::SampleSpec) -> Sampler {
        if spec.is_greedy() && !spec.has_penalties() {
            Sampler::Greedy
        } else {
            Sampler::Sample(*spec)
        }
    }
}

/// Which logits a prefill returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    None,
    /// The last position's [V].
    Last,
    /// Every position's [T, V] (perplexity).
    All,
}

impl Logits {
    /// Floats the caller's buffer must hold for `n` tokens of a `vocab` model.
    pub fn len(self, n: usize, vocab: usize) -> usize {
        match self {
            Logits::None => 0,
            Logits::Last => vocab,
            Logits::All => n * vocab,
        }
    }
}

/// What one decode step returns.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DecodeOutput {
    /// The sampled token.
    pub token: u32,
    /// [V] logits of this step, when asked for (costs a V·4-byte readback).
    pub logits: Vec<f32>,
}

impl LlmModel<'_> {
    /// Checks every shape against the spec; the refusal names the layer and tensor at fault.
    pub fn validate(&self) -> Result<(), Refusal> {
        let s = &self.spec;
        let bad = |what: String| {
            Err(Refusal::new(
                "llm.load",
                RefusalReason::UnsupportedShape(what),
            ))
        };
        let check = |name: &str, w: &Weight, rows: usize, cols: usize| -> Result<(), Refusal> {
            if w.rows != rows || w.cols != cols {
                return bad(format!(
                    "{name} is [{}, {}], expected [{rows}, {cols}]",
                    w.rows, w.cols
                ));
            }
            match w.dtype.expected_nbytes(&[rows as u64, cols as u64]) {
                Some(n) if n == w.data.len() as u64 => Ok(()),
                _ => bad(format!(
                    "{name}: {} bytes do not match {} [{rows}, {cols}]",
                    w.data.len(),
                    w.dtype
                )),
            }
        };
        let vec = |name: &str, v: &[f32], n: usize| -> Result<(), Refusal> {
            if v.len() != n {
                return bad(format!("{name} has {} values, expected {n}", v.len()));
            }
            Ok(())
        };
        if s.num_heads == 0 || s.num_kv_heads == 0 || s.num_heads % s.num_kv_heads != 0 {
            return bad(format!(
                "{} heads over {} kv heads",
                s.num_heads, s.num_kv_heads
            ));
        }
        if self.layers.len() != s.num_layers || s.sliding_window.len() != s.num_layers {
            return bad(format!(
                "{} layers given, spec says {}",
                self.layers.len(),
                s.num_layers
            ));
        }
        if s.rope.inv_freq.len() * 2 > s.head_dim {
            return bad(format!(
                "rotary dims {} exceed head_dim {}",
                s.rope.inv_freq.len() * 2,
                s.head_dim
            ));
        }
        check("embed", &self.embed, s.vocab, s.hidden)?;
        check("lm_head", &self.lm_head, s.vocab, s.hidden)?;
        vec("final_norm", self.final_norm, s.hidden)?;
        let (h, i, q, kv) = (s.hidden, s.intermediate, s.q_dim(), s.kv_dim());
        for (l, w) in self.layers.iter().enumerate() {
            let n = |t: &str| format!("layer {l} {t}");
            vec(&n("attn_norm"), w.attn_norm, h)?;
            vec(&n("ffn_norm"), w.ffn_norm, h)?;
            match &w.mixer {
                Mixer::Attention(a) => {
                    let q_rows = if a.output_gate { 2 * q } else { q };
                    check(&n("q"), &a.q, q_rows, h)?;
                    check(&n("k"), &a.k, kv, h)?;
                    check(&n("v"), &a.v, kv, h)?;
                    check(&n("o"), &a.o, h, q)?;
                    if a.output_gate && a.q_bias.is_some() {
                        return bad(n("q_bias with an output gate"));
                    }
                    for (t, b, len) in [
                        ("q_bias", a.q_bias, q),
                        ("k_bias", a.k_bias, kv),
                        ("v_bias", a.v_bias, kv),
                    ] {
                        if let Some(b) = b {
                            vec(&n(t), b, len)?;
                        }
                    }
                    for (t, b) in [("q_norm", a.q_norm), ("k_norm", a.k_norm)] {
                        if let Some(b) = b {
                            vec(&n(t), b, s.head_dim)?;
                        }
                    }
                }
                Mixer::GatedDelta(g) => {
                    let geo = &g.geometry;
                    if geo.num_k_heads == 0
                        || geo.num_v_heads % geo.num_k_heads != 0
                        || geo.k_head_dim == 0
                        || geo.v_head_dim == 0
                        || geo.conv_kernel == 0
                    {
                        return bad(n(&format!("gated delta geometry {geo:?}")));
                    }
                    check(&n("in_proj_qkvz"), &g.qkvz, geo.qkvz_dim(), h)?;
                    check(&n("in_proj_ba"), &g.ba, 2 * geo.num_v_heads, h)?;
                    check(&n("out_proj"), &g.out, h, geo.value_dim())?;
                    vec(&n("conv1d"), g.conv, geo.conv_dim() * geo.conv_kernel)?;
                    vec(&n("A_log"), g.a_log, geo.num_v_heads)?;
                    vec(&n("dt_bias"), g.dt_bias, geo.num_v_heads)?;
                    vec(&n("gated norm"), g.norm, geo.v_head_dim)?;
                }
            }
            let mlp = |what: &str, m: &Mlp, f: usize| -> Result<(), Refusal> {
                check(&n(&format!("{what}gate")), &m.gate, f, h)?;
                check(&n(&format!("{what}up")), &m.up, f, h)?;
                check(&n(&format!("{what}down")), &m.down, h, f)
            };
            match &w.ffn {
                Ffn::Dense(m) => mlp("", m, i)?,
                Ffn::Moe(m) => {
                    let e = m.experts.len();
                    if e == 0 || m.top_k == 0 || m.top_k > e {
                        return bad(n(&format!("moe: top {} of {e} experts", m.top_k)));
                    }
                    check(&n("router"), &m.router, e, h)?;
                    let f = m.experts[0].width();
                    for (x, ex) in m.experts.iter().enumerate() {
                        mlp(&format!("expert {x} "), ex, f)?;
                    }
                    if let Some(sh) = &m.shared {
                        mlp("shared_expert ", &sh.mlp, sh.mlp.width())?;
                        if let Some(g) = &sh.gate {
                            check(&n("shared_expert_gate"), g, 1, h)?;
                        }
                    }
                    if let Routing::SigmoidGroup {
                        n_group,
                        topk_group,
                        bias,
                        ..
                    } = m.routing
                    {
                        if n_group == 0 || e % n_group != 0 || topk_group > n_group {
                            return bad(n(&format!(
                                "moe: {e} experts in {n_group} groups, {topk_group} kept"
                            )));
                        }
                        vec(&n("router bias"), bias, e)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Whether any layer is a GatedDeltaNet (its state cannot be rewound to a shorter prefix).
    pub fn is_recurrent(&self) -> bool {
        self.layers.iter().any(|l| l.gated_delta().is_some())
    }

    /// Whether lm_head is the embedding matrix itself (tied), by identity of the bytes.
    pub fn head_is_tied(&self) -> bool {
        std::ptr::eq(self.embed.data.as_ptr(), self.lm_head.data.as_ptr())
            && self.embed.dtype == self.lm_head.dtype
    }
}
