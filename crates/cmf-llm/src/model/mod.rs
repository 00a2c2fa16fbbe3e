//! The Llama / Mistral / Qwen2 / Qwen3 decoder: one graph for the four families.
//!
//! ```text
//! x = embed[token]                                   x: [n, H]
//! per layer:  h = rmsnorm(x)·w_in
//!             q,k,v = h·Wqᵀ(+b), h·Wkᵀ(+b), h·Wvᵀ(+b)  (Qwen3: per-head rmsnorm of q, k)
//!             q,k = rope(q,k, pos);  cache ← k,v
//!             x += attn(q, cache)·Woᵀ
//!             h = rmsnorm(x)·w_post;  x += (silu(h·Wgᵀ) ⊙ h·Wuᵀ)·Wdᵀ
//! logits = rmsnorm(x)·w_final · lm_headᵀ
//! ```
//! Prefill runs the tokens in chunks of [`PREFILL_CHUNK`] rows through `cmf_kernels::matmul`
//! (GEMM); decode runs one row through `cmf_kernels::matvec`. The reference numerics are
//! transformers' `modeling_llama.py` / `modeling_qwen2.py` / `modeling_qwen3.py` /
//! `modeling_mistral.py`. Qwen3-Next (`modeling_qwen3_next.py`) swaps the token mixer per layer:
//! GatedDeltaNet layers ([`gdn`]) and output-gated attention ([`gated_attention`]).

mod batched;
pub mod config;
pub mod gated_attention;
pub mod gdn;
pub mod kv_cache;
mod load;
pub mod moe;
pub mod rope;
pub mod weights;

use crate::error::{LlmError, Result};
use crate::profile::{time, Op};
pub(crate) use batched::{RowLogits, SeqRows};
use cmf_kernels::ops::{self, NormStyle, RopeStyle, RopeTable};
pub use cmf_kernels::GdnGeometry;
use cmf_kernels::{AttnParams, KvDtype};
pub use config::{Family, Mixer, ModelConfig};
use gated_attention::GateScratch;
use gdn::GdnScratch;
pub use gdn::GdnState;
pub use kv_cache::KvCache;
pub use load::CmfSource;
use rope::Rope;
pub use weights::{
    AttentionWeights, Ffn, GdnWeights, LayerWeights, Linear, MixerWeights, ModelWeights, TensorRef,
    TensorSource,
};

/// Rows per prefill GEMM pass: large enough to amortise reading each weight once per chunk,
/// small enough that the activations stay a few MB.
pub const PREFILL_CHUNK: usize = 256;
/// Logit rows computed per lm_head GEMM when every position's logits are wanted (perplexity).
const LOGIT_ROWS: usize = 16;

pub struct Model<'a> {
    pub config: ModelConfig,
    pub weights: ModelWeights<'a>,
    pub rope: Rope,
}

/// The state of one sequence: its KV cache (attention layers), the recurrent state of each
/// GatedDeltaNet layer, and the activation buffers reused across passes (so decoding allocates
/// nothing per token).
pub struct State {
    pub kv: KvCache,
    /// Per layer: the GDN conv window and delta state; None for attention layers.
    recurrent: Vec<Option<GdnState>>,
    buf: Buffers,
}

impl State {
    /// Tokens processed so far (the next token's position).
    pub fn len(&self) -> usize {
        self.kv.len()
    }

    pub fn is_empty(&self) -> bool {
        self.kv.is_empty()
    }

    /// Starts a new sequence, keeping the allocations.
    pub fn clear(&mut self) {
        self.kv.clear();
        self.recurrent
            .iter_mut()
            .flatten()
            .for_each(GdnState::clear);
    }

    /// Keeps the first `len` tokens. A recurrent state cannot be rewound, so a model with GDN
    /// layers keeps either everything (len ≥ the current length) or nothing: callers read
    /// [`State::len`] afterwards to learn how much was kept.
    pub fn truncate(&mut self, len: usize) {
        if len >= self.len() {
            return;
        }
        if self.recurrent.iter().any(Option::is_some) {
            self.clear();
        } else {
            self.kv.truncate(len);
        }
    }

    /// The recurrent state of layer `l` (None for an attention layer).
    pub fn gdn_state(&self, l: usize) -> Option<&GdnState> {
        self.recurrent.get(l).and_then(Option::as_ref)
    }
}

impl<'a> Model<'a> {
    /// Binds the weights of `config`'s model from `source`; tensor names are looked up under
    /// `prefix` (empty for a plain LLM file, `te.` for a Z-Image pack's text encoder).
    pub fn from_source(
        source: &dyn TensorSource<'a>,
        config: ModelConfig,
        prefix: &str,
    ) -> Result<Model<'a>> {
        Self::bind_layers(source, config, prefix, None)
    }

    /// Binds only the first `layers` decoder layers (no final norm); for [`Model::hidden_states`]
    /// users that never need the rest (the Z-Image text encoder stops one layer early).
    pub fn from_source_layers(
        source: &dyn TensorSource<'a>,
        config: ModelConfig,
        prefix: &str,
        layers: usize,
    ) -> Result<Model<'a>> {
        Self::bind_layers(source, config, prefix, Some(layers))
    }

    fn bind_layers(
        source: &dyn TensorSource<'a>,
        config: ModelConfig,
        prefix: &str,
        layers: Option<usize>,
    ) -> Result<Model<'a>> {
        let n = layers.unwrap_or(config.num_layers);
        if n > config.num_layers {
            return Err(LlmError::Other(format!(
                "{n} layers requested, the model has {}",
                config.num_layers
            )));
        }
        let weights = weights::bind(&weights::Binder { source, prefix }, &config, n)?;
        let rope = Rope::new(&config.rope);
        Ok(Model {
            config,
            weights,
            rope,
        })
    }

    /// A fresh sequence state that may hold up to `limit` tokens (capped at the model's maximum
    /// positions), with an f32 KV cache (exact; what the parity tests use).
    pub fn new_state(&self, limit: usize) -> Result<State> {
        self.new_state_with(limit, KvDtype::F32)
    }

    /// [`Model::new_state`] with the KV cache element type chosen (f16 halves the cache and the
    /// bytes attention streams per token).
    pub fn new_state_with(&self, limit: usize, kv_dtype: KvDtype) -> Result<State> {
        let limit = limit.min(self.config.max_position_embeddings.max(1));
        self.state_for_layers(self.weights.layers.len(), limit, kv_dtype)
    }

    fn state_for_layers(&self, layers: usize, limit: usize, kv_dtype: KvDtype) -> Result<State> {
        let c = &self.config;
        let recurrent = self.recurrent_states(layers);
        Ok(State {
            kv: KvCache::new(layers, c.num_kv_heads, c.head_dim, limit, kv_dtype)?,
            recurrent,
            buf: Buffers::default(),
        })
    }

    /// Fresh recurrent states of the first `layers` layers: a GatedDeltaNet layer's conv window
    /// and delta state, None for an attention layer.
    pub(crate) fn recurrent_states(&self, layers: usize) -> Vec<Option<GdnState>> {
        let c = &self.config;
        c.mixers[..layers]
            .iter()
            .map(|m| match (m, &c.gdn) {
                (Mixer::GatedDeltaNet, Some(g)) => Some(GdnState::new(g)),
                _ => None,
            })
            .collect()
    }

    /// Runs `tokens` after what `st` holds and returns the logits of the last one ([vocab]).
    pub fn prefill<'s>(&self, st: &'s mut State, tokens: &[u32]) -> Result<&'s [f32]> {
        if tokens.is_empty() {
            return Err(LlmError::Other("prefill called with no tokens".into()));
        }
        self.check_room(st, tokens)?;
        let layers = self.weights.layers.len();
        // One hand-off to the kernels' pool per pass: the kernels called inside split their work
        // from a pool thread, without a wake-up and a blocking wait per call.
        cmf_kernels::run_in_pool(|| {
            for chunk in tokens.chunks(PREFILL_CHUNK) {
                self.run_rows(st, chunk, layers)?;
            }
            let n = tokens.len() - (tokens.len() - 1) / PREFILL_CHUNK * PREFILL_CHUNK;
            self.logits_rows(&mut st.buf.act, n - 1, 1);
            Ok(())
        })?;
        Ok(&st.buf.act.logits[..self.config.vocab_size])
    }

    /// Runs one token (the decode step) and returns its logits.
    pub fn decode<'s>(&self, st: &'s mut State, token: u32) -> Result<&'s [f32]> {
        self.prefill(st, &[token])
    }

    /// Runs `tokens` and calls `f(i, logits_i)` for every `i >= first_scored` (teacher-forced
    /// scoring for perplexity). Logits are computed [`LOGIT_ROWS`] rows at a time.
    pub fn forward_scored(
        &self,
        st: &mut State,
        tokens: &[u32],
        first_scored: usize,
        mut f: impl FnMut(usize, &[f32]) + Send,
    ) -> Result<()> {
        self.check_room(st, tokens)?;
        cmf_kernels::run_in_pool(|| self.forward_scored_in_pool(st, tokens, first_scored, &mut f))
    }

    fn forward_scored_in_pool(
        &self,
        st: &mut State,
        tokens: &[u32],
        first_scored: usize,
        f: &mut (dyn FnMut(usize, &[f32]) + Send),
    ) -> Result<()> {
        let layers = self.weights.layers.len();
        let vocab = self.config.vocab_size;
        for (c, chunk) in tokens.chunks(PREFILL_CHUNK).enumerate() {
            self.run_rows(st, chunk, layers)?;
            let base = c * PREFILL_CHUNK;
            let from = first_scored.saturating_sub(base).min(chunk.len());
            let mut r = from;
            while r < chunk.len() {
                let m = LOGIT_ROWS.min(chunk.len() - r);
                self.logits_rows(&mut st.buf.act, r, m);
                for j in 0..m {
                    f(base + r + j, &st.buf.act.logits[j * vocab..(j + 1) * vocab]);
                }
                r += m;
            }
        }
        Ok(())
    }

    /// Hidden states after the first `k` decoder layers, without the final norm: `[seq, hidden]`
    /// row-major (transformers `output_hidden_states=True` → `hidden_states[k]`). Runs on a
    /// fresh cache; `k` may be at most the number of bound layers.
    pub fn hidden_states(&self, tokens: &[u32], k: usize) -> Result<Vec<f32>> {
        if k > self.weights.layers.len() {
            return Err(LlmError::Other(format!(
                "{k} layers requested, {} are loaded",
                self.weights.layers.len()
            )));
        }
        let vocab = self.config.vocab_size;
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(LlmError::TokenOutOfRange { id, vocab });
        }
        let mut st = self.state_for_layers(k, tokens.len(), KvDtype::F32)?;
        let h = self.config.hidden_size;
        let mut out = Vec::with_capacity(tokens.len() * h);
        cmf_kernels::run_in_pool(|| {
            for chunk in tokens.chunks(PREFILL_CHUNK) {
                self.run_rows(&mut st, chunk, k)?;
                out.extend_from_slice(&st.buf.act.x[..chunk.len() * h]);
            }
            Ok(out)
        })
    }

    fn check_room(&self, st: &State, tokens: &[u32]) -> Result<()> {
        if self.weights.layers.len() != self.config.num_layers {
            return Err(LlmError::Other(format!(
                "only {} of {} layers are loaded: use hidden_states, not logits",
                self.weights.layers.len(),
                self.config.num_layers
            )));
        }
        let needed = st.len() + tokens.len();
        if needed > st.kv.limit() {
            return Err(LlmError::ContextFull {
                needed,
                limit: st.kv.limit(),
            });
        }
        let vocab = self.config.vocab_size;
        match tokens.iter().find(|&&t| t as usize >= vocab) {
            Some(&id) => Err(LlmError::TokenOutOfRange { id, vocab }),
            None => Ok(()),
        }
    }

    /// Runs `tokens` (one chunk) through the first `layers` layers; leaves the residual stream
    /// of each row in `st.buf.x` and appends to the cache.
    /// (Called inside `cmf_kernels::run_in_pool`.)
    fn run_rows(&self, st: &mut State, tokens: &[u32], layers: usize) -> Result<()> {
        let cfg = &self.config;
        let n = tokens.len();
        let start = st.kv.len();
        st.buf.ensure(cfg, n);
        let b = &mut st.buf;
        let h = cfg.hidden_size;
        time(Op::Embed, || {
            for (i, &t) in tokens.iter().enumerate() {
                let row = &mut b.act.x[i * h..(i + 1) * h];
                cmf_kernels::reference::decode_row(&self.weights.embed, t as usize, row);
            }
        });
        // cos/sin per row, shared by every layer and head.
        let row0 = self.rope_rows(&mut b.rope, start, n);
        let rope = b
            .rope
            .as_ref()
            .map(|r| &r.table)
            .expect("rope_rows filled the table");
        let segs = [Segment {
            row0: 0,
            n,
            start,
            rope,
            rope_row0: row0,
        }];
        for (l, lw) in self.weights.layers[..layers].iter().enumerate() {
            let mix = MixerState {
                gdn: &mut st.recurrent,
                gdn_scratch: &mut b.gdn,
                gate_scratch: &mut b.gate,
            };
            self.layer(l, lw, &mut st.kv, mix, &mut b.act, &segs);
        }
        st.kv.commit(n);
        Ok(())
    }

    /// Makes `cache` hold cos/sin for positions `start..start + n` and returns the table row of
    /// `start`. The table covers [`ROPE_SPAN`] positions from where it was built, so decoding
    /// rebuilds it once per span instead of every token.
    fn rope_rows(&self, cache: &mut Option<RopeCache>, start: usize, n: usize) -> usize {
        let dynamic = matches!(self.rope.config.scaling, rope::RopeScaling::Dynamic { .. });
        if let Some(c) = cache {
            // Dynamic NTK frequencies depend on the sequence length: reuse only within one pass.
            if start >= c.first && start + n <= c.first + c.table.rows() && !dynamic {
                return start - c.first;
            }
        }
        let span = if dynamic { n } else { n.max(ROPE_SPAN) };
        let positions: Vec<f32> = (start..start + span).map(|p| p as f32).collect();
        let inv_freq = self.rope.inv_freq_for(start + n);
        let table = RopeTable::new(&positions, &inv_freq, self.rope.attention_scaling());
        *cache = Some(RopeCache {
            first: start,
            table,
        });
        0
    }

    /// One decoder layer over the rows of `segs` (one segment per sequence): a token mixer
    /// (attention over each sequence's cache, or a GatedDeltaNet over its recurrent state) then
    /// a feed-forward block, each adding to the residual.
    fn layer(
        &self,
        l: usize,
        w: &LayerWeights,
        kv: &mut dyn LayerKv,
        mix: MixerState,
        b: &mut Activations,
        segs: &[Segment],
    ) {
        let cfg = &self.config;
        match (&w.mixer, mix.gdn) {
            (MixerWeights::Attention(a), _) if cfg.attn_output_gate => {
                self.gated_attention_block(l, a, kv, b, mix.gate_scratch, segs)
            }
            (MixerWeights::Attention(a), _) => self.attention_block(l, a, kv, b, segs),
            (MixerWeights::GatedDeltaNet(g), gdn) => {
                let geo = cfg
                    .gdn
                    .as_ref()
                    .expect("bound GDN weights imply a GDN config");
                let h = cfg.hidden_size;
                // Each segment advances its own sequence's state, so the mixer runs per segment
                // (a batch of one is exactly the single-sequence pass).
                time(Op::Attention, || {
                    for (i, s) in segs.iter().enumerate() {
                        gdn::gdn_block(
                            geo,
                            g,
                            &mut b.x[s.row0 * h..],
                            &mut b.xn[s.row0 * h..],
                            s.n,
                            cfg.rms_norm_eps,
                            cfg.norm_style,
                            gdn.state(l, i),
                            mix.gdn_scratch,
                        )
                    }
                });
            }
        }
        self.ffn_block(w, b, rows_of(segs));
    }

    /// `x += attn(rope(norm(x)·Wq,k,v), cache)·Woᵀ`, appending this pass's k, v to the cache.
    /// The projections run over all rows at once (one GEMM for a batch); RoPE, the cache write
    /// and attention run per segment, each over its own sequence's keys.
    fn attention_block(
        &self,
        l: usize,
        w: &AttentionWeights,
        kv: &mut dyn LayerKv,
        b: &mut Activations,
        segs: &[Segment],
    ) {
        let cfg = &self.config;
        let n = rows_of(segs);
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
        let (x, xn, out) = (&mut b.x[..n * h], &mut b.xn[..n * h], &mut b.out[..n * h]);
        let (q, k, v) = (&mut b.q[..n * qd], &mut b.k[..n * kvd], &mut b.v[..n * kvd]);

        time(Op::Norm, || {
            ops::rms_norm(x, h, Some(&w.attn_norm), eps, NormStyle::Plain, xn)
        });
        time(Op::Qkv, || {
            linear_shared_input([&w.q, &w.k, &w.v], xn, n, [q, k, v]);
        });
        let attn = &mut b.attn[..n * qd];
        self.rope_and_attend(l, w, NormStyle::Plain, kv, [q, k, v], attn, segs);
        time(Op::OutProj, || {
            linear(&w.o, attn, n, out);
            ops::add(x, out);
        });
    }

    /// The part of an attention block after the q|k|v projections: q/k norms, RoPE per segment,
    /// each segment's keys and values written to its cache, and `attn` = each segment's queries
    /// attending over its own sequence.
    #[allow(clippy::too_many_arguments)]
    fn rope_and_attend(
        &self,
        l: usize,
        w: &AttentionWeights,
        style: NormStyle,
        kv: &mut dyn LayerKv,
        [q, k, v]: [&mut [f32]; 3],
        attn: &mut [f32],
        segs: &[Segment],
    ) {
        let cfg = &self.config;
        let (hd, eps) = (cfg.head_dim, cfg.rms_norm_eps);
        let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
        time(Op::QkNormRope, || {
            if let (Some(qn), Some(kn)) = (&w.q_norm, &w.k_norm) {
                ops::rms_norm_inplace(q, hd, Some(qn), eps, style);
                ops::rms_norm_inplace(k, hd, Some(kn), eps, style);
            }
            for s in segs {
                let (qs, ks) = (s.rows(q, qd), s.rows(k, kvd));
                ops::rope(qs, s.n, hd, RopeStyle::RotateHalf, s.rope, s.rope_row0);
                ops::rope(ks, s.n, hd, RopeStyle::RotateHalf, s.rope, s.rope_row0);
            }
        });
        time(Op::Attention, || {
            for (i, s) in segs.iter().enumerate() {
                kv.write(l, i, s, s.rows(k, kvd), s.rows(v, kvd));
                let params = AttnParams {
                    n_heads: cfg.num_heads,
                    n_kv_heads: cfg.num_kv_heads,
                    head_dim: hd,
                    scale: 1.0 / (hd as f32).sqrt(),
                    causal: true,
                    q_pos0: s.start,
                    window: cfg.sliding_window[l],
                };
                kv.attend(l, i, s, s.rows(q, qd), &params, s.rows(attn, qd));
            }
        });
    }

    /// `x += ffn(norm(x))` over `n` rows: the dense MLP or the layer's experts.
    fn ffn_block(&self, w: &LayerWeights, b: &mut Activations, n: usize) {
        let cfg = &self.config;
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let (x, xn, out) = (&mut b.x[..n * h], &mut b.xn[..n * h], &mut b.out[..n * h]);
        time(Op::Norm, || {
            ops::rms_norm(x, h, Some(&w.ffn_norm), eps, cfg.norm_style, xn)
        });
        match &w.ffn {
            Ffn::Dense(mlp) => {
                let ff = cfg.intermediate_size;
                let (gate, up) = (&mut b.gate[..n * ff], &mut b.up[..n * ff]);
                time(Op::GateUp, || {
                    linear_shared_input([&mlp.gate, &mlp.up], xn, n, [gate, up]);
                });
                time(Op::Swiglu, || ops::swiglu_inplace(gate, up));
                time(Op::Down, || {
                    linear(&mlp.down, gate, n, out);
                    ops::add(x, out);
                });
            }
            Ffn::Moe(m) => {
                let mc = cfg.moe.as_ref().expect("a MoE layer has a MoE config");
                time(Op::Experts, || {
                    moe::forward(m, mc, xn, n, out, &mut b.moe);
                    ops::add(x, out);
                });
            }
        }
    }

    /// Final norm + lm_head for rows `r..r+m` of the last chunk, into `b.logits[..m·vocab]`.
    fn logits_rows(&self, b: &mut Activations, r: usize, m: usize) {
        let (h, vocab) = (self.config.hidden_size, self.config.vocab_size);
        if b.logits.len() < m * vocab {
            b.logits.resize(m * vocab, 0.0);
        }
        let (x, xn) = (&b.x[r * h..(r + m) * h], &mut b.xn[..m * h]);
        let logits = &mut b.logits[..m * vocab];
        time(Op::LmHead, || {
            ops::rms_norm(
                x,
                h,
                Some(&self.weights.final_norm),
                self.config.rms_norm_eps,
                self.config.norm_style,
                xn,
            );
            let head = Linear {
                w: self.weights.lm_head,
                bias: None,
            };
            linear(&head, xn, m, logits);
        });
    }
}

/// y[n, rows] = x[n, cols]·Wᵀ (+ b): matvec for one row (decode), GEMM otherwise (prefill).
fn linear(l: &Linear, x: &[f32], n: usize, y: &mut [f32]) {
    if n == 1 {
        cmf_kernels::matvec(&l.w, x, y);
    } else {
        cmf_kernels::matmul(&l.w, x, n, y);
    }
    if let Some(b) = &l.bias {
        ops::add_rows(y, b);
    }
}

/// `linear` for several weights reading the same input. Decode runs them as one
/// `cmf_kernels::matvec_multi` (one input quantization and one pool dispatch for the group:
/// q|k|v and gate|up are 5 of a layer's 7 products), a batch's step as one
/// `cmf_kernels::matmul_multi` (the same for a few rows; one GEMM each for more).
fn linear_shared_input<const N: usize>(
    ls: [&Linear; N],
    x: &[f32],
    n: usize,
    mut ys: [&mut [f32]; N],
) {
    let ws = ls.map(|l| &l.w);
    if n == 1 {
        cmf_kernels::matvec_multi(&ws, x, &mut ys);
    } else {
        cmf_kernels::matmul_multi(&ws, x, n, &mut ys);
    }
    for (l, y) in ls.iter().zip(ys.iter_mut()) {
        if let Some(b) = &l.bias {
            ops::add_rows(y, b);
        }
    }
}

/// The per-sequence mixer state one layer reads besides the KV cache.
pub(crate) struct MixerState<'s> {
    pub gdn: &'s mut dyn LayerRecurrent,
    pub gdn_scratch: &'s mut GdnScratch,
    pub gate_scratch: &'s mut GateScratch,
}

/// One sequence's rows within a forward pass: activation rows `row0..row0 + n`, at positions
/// `start..start + n` of that sequence, with their cos/sin from row `rope_row0` of `rope`.
#[derive(Clone, Copy)]
pub(crate) struct Segment<'t> {
    pub row0: usize,
    pub n: usize,
    pub start: usize,
    pub rope: &'t RopeTable,
    pub rope_row0: usize,
}

impl Segment<'_> {
    /// This segment's rows of a `[rows, width]` buffer.
    fn rows<'b>(&self, buf: &'b mut [f32], width: usize) -> &'b mut [f32] {
        &mut buf[self.row0 * width..(self.row0 + self.n) * width]
    }
}

/// Rows of a pass made of `segs` (contiguous, in order).
fn rows_of(segs: &[Segment]) -> usize {
    segs.last().map_or(0, |s| s.row0 + s.n)
}

/// Where a pass's recurrent (GatedDeltaNet) states live: one sequence's layers, or a slot per
/// sequence of a batch (`crate::batch`). Segment `i` of the pass advances its own state.
pub(crate) trait LayerRecurrent {
    /// Segment `i`'s state for GDN layer `layer`.
    fn state(&mut self, layer: usize, i: usize) -> &mut GdnState;
}

/// One sequence's states, one per layer (None for attention layers).
impl LayerRecurrent for Vec<Option<GdnState>> {
    fn state(&mut self, layer: usize, _: usize) -> &mut GdnState {
        self[layer]
            .as_mut()
            .expect("the state of a GDN layer is made with the model's layers")
    }
}

/// Where a pass's keys and values live: one sequence's contiguous [`KvCache`], or the block pool
/// a batch of sequences shares (`crate::batch`). Segment `i` of the pass writes its new rows
/// and then attends over its own sequence.
pub(crate) trait LayerKv {
    /// Stores segment `i`'s keys and values (`[seg.n, kv_dim]`) at positions `seg.start..`.
    fn write(&mut self, layer: usize, i: usize, seg: &Segment, k: &[f32], v: &[f32]);
    /// `out` = attention of segment `i`'s queries over positions `..seg.start + seg.n`.
    fn attend(
        &self,
        layer: usize,
        i: usize,
        seg: &Segment,
        q: &[f32],
        p: &AttnParams,
        out: &mut [f32],
    );
}

impl LayerKv for KvCache {
    fn write(&mut self, layer: usize, _: usize, _: &Segment, k: &[f32], v: &[f32]) {
        KvCache::write(self, layer, k, v)
    }

    fn attend(
        &self,
        layer: usize,
        _: usize,
        seg: &Segment,
        q: &[f32],
        p: &AttnParams,
        out: &mut [f32],
    ) {
        cmf_kernels::attention(q, self.view(layer, seg.start + seg.n), p, None, out);
    }
}

/// Positions a cached RoPE table covers when it is (re)built.
const ROPE_SPAN: usize = 256;

/// cos/sin for positions `first..first + table.rows()`.
struct RopeCache {
    first: usize,
    table: RopeTable,
}

/// What a sequence reuses between passes: activations, the RoPE table and the hybrid mixers'
/// scratch.
#[derive(Default)]
struct Buffers {
    act: Activations,
    rope: Option<RopeCache>,
    gdn: GdnScratch,
    gate: GateScratch,
}

impl Buffers {
    fn ensure(&mut self, cfg: &ModelConfig, rows: usize) {
        self.act.ensure(cfg, rows)
    }
}

/// Activation buffers for up to `rows` rows, grown on demand and reused.
#[derive(Default)]
pub(crate) struct Activations {
    rows: usize,
    /// residual stream [rows, H]
    x: Vec<f32>,
    /// normed input of the current block [rows, H]
    xn: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    /// projection output added to the residual [rows, H]
    out: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    logits: Vec<f32>,
    /// the MoE blocks' own buffers (router scores, gathered rows, expert outputs)
    moe: moe::Scratch,
}

impl Activations {
    fn ensure(&mut self, cfg: &ModelConfig, rows: usize) {
        if rows <= self.rows {
            return;
        }
        let (h, qd, kvd, ff) = (
            cfg.hidden_size,
            cfg.q_dim(),
            cfg.kv_dim(),
            cfg.intermediate_size,
        );
        for (buf, width) in [
            (&mut self.x, h),
            (&mut self.xn, h),
            (&mut self.q, qd),
            (&mut self.k, kvd),
            (&mut self.v, kvd),
            (&mut self.attn, qd),
            (&mut self.out, h),
            (&mut self.gate, ff),
            (&mut self.up, ff),
        ] {
            buf.resize(rows * width, 0.0);
        }
        self.rows = rows;
    }
}
