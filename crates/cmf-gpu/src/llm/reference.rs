//! A plain f32 forward pass over an [`LlmModel`], one token at a time, on the CPU.
//!
//! It is the oracle the device backends are checked against (and what the fake backend runs),
//! written for obviousness: every matrix product goes through `cmf_kernels::reference::matvec`.
//! Numerics follow Hugging Face transformers `modeling_qwen3.py` / `modeling_llama.py`:
//! RMSNorm `x · rsqrt(mean(x²) + eps) · w`, rotate-half RoPE, q/k norm before RoPE, softmax
//! over scaled scores, SwiGLU `silu(gate) · up`; mixture-of-experts blocks as cmf-llm's `model::moe`
//! (transformers `Qwen3MoeSparseMoeBlock` / `Qwen2MoeSparseMoeBlock`). Hybrid models follow
//! `modeling_qwen3_next.py`: GatedDeltaNet layers as cmf-llm's `model::gdn` decode path (the
//! recurrence one token at a time), output-gated attention, `(1 + w)` norms.

use super::{
    AttentionWeights, Ffn, GdnGeometry, GdnWeights, LayerWeights, LlmModel, LlmSpec, Mixer, Mlp,
    MoeWeights, NormStyle, Routing,
};
use cmf_kernels::reference::decode_row;
use std::cell::Cell;

/// How the input of a q8_row matrix product is rounded, as the device rounds it: its prefill
/// GEMMs read bf16 rows, its decode matvecs (and the CPU engine's) quantise the row in blocks of
/// 32 to s8 at scale amax / 127, ties to even.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Q8Inputs {
    /// f32, unrounded (the default).
    F32,
    Bf16,
    S8Blocks32,
}

thread_local! {
    /// Set inside [`with_q8_inputs`].
    static Q8_INPUTS: Cell<Q8Inputs> = const { Cell::new(Q8Inputs::F32) };
}

/// Runs `f` with the input of every q8_row matrix product rounded as `r` says, so that an 8-bit
/// device result can be held to the arithmetic it runs rather than to f32 inputs. Small random
/// models can be far more sensitive to that rounding than trained ones: the hybrid test model
/// moves 1.7e-1 from s8 inputs alone and 1.1e-1 from bf16 inputs.
pub fn with_q8_inputs<T>(r: Q8Inputs, f: impl FnOnce() -> T) -> T {
    struct Reset(Q8Inputs);
    impl Drop for Reset {
        fn drop(&mut self) {
            Q8_INPUTS.with(|s| s.set(self.0));
        }
    }
    let _reset = Reset(Q8_INPUTS.with(|s| s.replace(r)));
    f()
}

/// `y = w · x`, a q8_row matrix's input rounded first as [`with_q8_inputs`] says.
fn matvec(w: &cmf_kernels::Weight, x: &[f32], y: &mut [f32]) {
    let rounding = Q8_INPUTS.with(Cell::get);
    if w.dtype != cmf_format::Dtype::Q8Row || rounding == Q8Inputs::F32 {
        return cmf_kernels::reference::matvec(w, x, y);
    }
    let mut q = x.to_vec();
    if rounding == Q8Inputs::Bf16 {
        q.iter_mut()
            .for_each(|v| *v = half::bf16::from_f32(*v).to_f32());
    } else {
        for block in q.chunks_mut(32) {
            let (d, s8) = s8_block(block);
            for (v, s) in block.iter_mut().zip(s8) {
                *v = s as f32 * d;
            }
        }
    }
    cmf_kernels::reference::matvec(w, &q, y)
}

/// One block of inputs quantised as the device's (and the CPU engine's) q8 kernels quantise it:
/// s8 values at scale `d = amax / 127`, ties to even (all zeros when the block is); `(d, values)`.
pub fn s8_block(block: &[f32]) -> (f32, Vec<i32>) {
    let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
    (
        d,
        block
            .iter()
            .map(|v| (v * inv).round_ties_even() as i32)
            .collect(),
    )
}

/// The KV cache of the reference forward: per layer, `[S, NKV·D]` keys and values; for a
/// GatedDeltaNet layer its recurrent state instead.
#[derive(Debug, Clone, Default)]
pub struct RefCache {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    gdn: Vec<Option<GdnState>>,
}

/// One GatedDeltaNet layer's recurrent state after `len` tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct GdnState {
    /// The last W−1 convolution inputs per channel, `[C, W − 1]`, oldest first.
    pub conv: Vec<f32>,
    /// `[v_heads, dk, dv]`.
    pub delta: Vec<f32>,
    /// Tokens folded in.
    pub len: usize,
}

impl GdnState {
    pub fn new(g: &GdnGeometry) -> GdnState {
        let (conv, delta) = g.state_floats();
        GdnState {
            conv: vec![0.0; conv],
            delta: vec![0.0; delta],
            len: 0,
        }
    }
}

impl RefCache {
    pub fn new(num_layers: usize) -> RefCache {
        RefCache {
            k: vec![Vec::new(); num_layers],
            v: vec![Vec::new(); num_layers],
            gdn: vec![None; num_layers],
        }
    }

    /// Forgets positions ≥ `len`. A recurrent state cannot be cut back: it is cleared at
    /// `len` 0 and otherwise kept (callers check [`RefCache::can_resume`] first).
    pub fn truncate(&mut self, len: usize, kv_dim: usize) {
        for l in 0..self.k.len() {
            self.truncate_layer(l, len, kv_dim);
        }
    }

    /// Whether the next token may go at `pos`: every recurrent state is at `pos` (or is
    /// restarted, at 0).
    pub fn can_resume(&self, pos: usize) -> bool {
        pos == 0 || self.gdn.iter().flatten().all(|s| s.len == pos)
    }

    /// The recurrent state of layer `l`, once a token went through it.
    pub fn gdn_state(&self, l: usize) -> Option<&GdnState> {
        self.gdn.get(l).and_then(Option::as_ref)
    }

    /// A cache holding per layer `[S, NKV·D]` keys `k[l]` and values `v[l]`.
    pub fn from_rows(k: Vec<Vec<f32>>, v: Vec<Vec<f32>>) -> RefCache {
        let gdn = vec![None; k.len()];
        RefCache { k, v, gdn }
    }

    /// Layer `l`'s keys and values, `[S, NKV·D]` each.
    pub fn rows(&self, l: usize) -> (&[f32], &[f32]) {
        (&self.k[l], &self.v[l])
    }

    /// Forgets positions ≥ `len` of one layer (a recurrent state only at `len` 0).
    pub fn truncate_layer(&mut self, layer: usize, len: usize, kv_dim: usize) {
        self.k[layer].truncate(len * kv_dim);
        self.v[layer].truncate(len * kv_dim);
        if len == 0 {
            self.gdn[layer] = None;
        }
    }
}

pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    rms_norm_styled(x, w, eps, NormStyle::Plain, out)
}

/// RMSNorm with the weight applied as `style` says (`w` or `1 + w`).
pub fn rms_norm_styled(x: &[f32], w: &[f32], eps: f32, style: NormStyle, out: &mut [f32]) {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (ms + eps).sqrt();
    for ((o, a), b) in out.iter_mut().zip(x).zip(w) {
        let b = match style {
            NormStyle::Plain => *b,
            NormStyle::OnePlus => 1.0 + b,
        };
        *o = a * inv * b;
    }
}

/// Rotate-half RoPE on one head vector `x[D]` at `pos`.
pub fn rope(x: &mut [f32], pos: usize, spec: &LlmSpec) {
    let half = spec.rope.inv_freq.len();
    for (i, f) in spec.rope.inv_freq.iter().enumerate() {
        let a = pos as f32 * f;
        let (s, c) = a.sin_cos();
        let (s, c) = (
            s * spec.rope.attention_factor,
            c * spec.rope.attention_factor,
        );
        let (x1, x2) = (x[i], x[i + half]);
        x[i] = x1 * c - x2 * s;
        x[i + half] = x2 * c + x1 * s;
    }
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Embedding row of `token` as f32 [H].
pub fn embed(model: &LlmModel, token: u32) -> Vec<f32> {
    let mut x = vec![0f32; model.spec.hidden];
    decode_row(&model.embed, token as usize, &mut x);
    x
}

/// One layer over the hidden state `x[H]` of the token at `pos`; appends to `cache`.
pub fn layer(model: &LlmModel, l: usize, x: &mut [f32], pos: usize, cache: &mut RefCache) {
    let s = &model.spec;
    let w: &LayerWeights = &model.layers[l];
    let mut xn = vec![0f32; s.hidden];
    rms_norm_styled(x, w.attn_norm, s.rms_eps, s.norm_style, &mut xn);
    let mut o = vec![0f32; s.hidden];
    match &w.mixer {
        Mixer::Attention(a) => attention(s, a, l, &xn, pos, cache, &mut o),
        Mixer::GatedDelta(g) => {
            let st = cache.gdn[l].get_or_insert_with(|| GdnState::new(&g.geometry));
            assert_eq!(
                st.len, pos,
                "reference recurrent state out of step at layer {l}"
            );
            gated_delta(g, &xn, s.rms_eps, st, &mut o);
        }
    }
    x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);

    rms_norm_styled(x, w.ffn_norm, s.rms_eps, s.norm_style, &mut xn);
    match &w.ffn {
        Ffn::Dense(m) => mlp(m, &xn, &mut o),
        Ffn::Moe(m) => moe(m, &xn, &mut o),
    }
    x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
}

/// out[H] = attention of the normed `xn[H]` at `pos` (output-gated when the weights say so);
/// appends this token's k, v to `cache`.
fn attention(
    s: &LlmSpec,
    a: &AttentionWeights,
    l: usize,
    xn: &[f32],
    pos: usize,
    cache: &mut RefCache,
    out: &mut [f32],
) {
    let (d, nh, nkv) = (s.head_dim, s.num_heads, s.num_kv_heads);
    let q_rows = if a.output_gate {
        2 * s.q_dim()
    } else {
        s.q_dim()
    };
    let mut qg = vec![0f32; q_rows];
    let mut k = vec![0f32; s.kv_dim()];
    let mut v = vec![0f32; s.kv_dim()];
    matvec(&a.q, xn, &mut qg);
    matvec(&a.k, xn, &mut k);
    matvec(&a.v, xn, &mut v);
    // Per head the gated projection holds [query | gate].
    let (mut q, gate) = if a.output_gate {
        let q: Vec<f32> = qg
            .chunks_exact(2 * d)
            .flat_map(|h| &h[..d])
            .copied()
            .collect();
        let g: Vec<f32> = qg
            .chunks_exact(2 * d)
            .flat_map(|h| &h[d..])
            .copied()
            .collect();
        (q, Some(g))
    } else {
        (qg, None)
    };
    for (t, b) in [(&mut q, a.q_bias), (&mut k, a.k_bias), (&mut v, a.v_bias)] {
        if let Some(b) = b {
            t.iter_mut().zip(b).for_each(|(a, b)| *a += b);
        }
    }
    let mut tmp = vec![0f32; d];
    for (heads, norm) in [(&mut q, a.q_norm), (&mut k, a.k_norm)] {
        for h in heads.chunks_mut(d) {
            if let Some(nw) = norm {
                rms_norm_styled(h, nw, s.rms_eps, s.norm_style, &mut tmp);
                h.copy_from_slice(&tmp);
            }
            rope(h, pos, s);
        }
    }
    assert_eq!(
        cache.k[l].len(),
        pos * s.kv_dim(),
        "reference cache out of step at layer {l}"
    );
    cache.k[l].extend_from_slice(&k);
    cache.v[l].extend_from_slice(&v);

    let first = match s.sliding_window[l] {
        Some(win) => (pos + 1).saturating_sub(win),
        None => 0,
    };
    let mut att = vec![0f32; s.q_dim()];
    let group = nh / nkv;
    for h in 0..nh {
        let kh = h / group;
        let qh = &q[h * d..(h + 1) * d];
        let scores: Vec<f32> = (first..=pos)
            .map(|j| {
                let kj = &cache.k[l][j * s.kv_dim() + kh * d..][..d];
                qh.iter().zip(kj).map(|(a, b)| a * b).sum::<f32>() * s.attn_scale
            })
            .collect();
        let m = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f32> = scores.iter().map(|v| (v - m).exp()).collect();
        let sum: f32 = e.iter().sum();
        let out = &mut att[h * d..(h + 1) * d];
        for (p, j) in e.iter().zip(first..=pos) {
            let vj = &cache.v[l][j * s.kv_dim() + kh * d..][..d];
            for (o, vv) in out.iter_mut().zip(vj) {
                *o += p / sum * vv;
            }
        }
    }
    if let Some(gate) = gate {
        att.iter_mut()
            .zip(&gate)
            .for_each(|(a, g)| *a *= sigmoid(*g));
    }
    matvec(&a.o, &att, out);
}

/// torch's `softplus` (beta 1, threshold 20: linear above it).
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// out[H] = the GatedDeltaNet mixer of the normed `xn[H]` for one token, advancing `st`.
pub fn gated_delta(g: &GdnWeights, xn: &[f32], eps: f32, st: &mut GdnState, out: &mut [f32]) {
    let geo = &g.geometry;
    let mut qkvz = vec![0f32; geo.qkvz_dim()];
    let mut ba = vec![0f32; 2 * geo.num_v_heads];
    matvec(&g.qkvz, xn, &mut qkvz);
    matvec(&g.ba, xn, &mut ba);
    let (mixed, z, beta, decay) = gdn_inputs(g, &qkvz, &ba);
    let mut mixed = mixed;
    gdn_conv(geo, g.conv, &mut mixed, &mut st.conv);
    gdn_l2norm(geo, &mut mixed);
    let mut core = vec![0f32; geo.value_dim()];
    gdn_recurrence(geo, &mixed, &beta, &decay, &mut st.delta, &mut core);
    gdn_gated_norm(geo, &mut core, &z, g.norm, eps);
    matvec(&g.out, &core, out);
    st.len += 1;
}

/// The projections of one token split into the conv input `[q | k | v]` (all heads), z,
/// β = sigmoid(b) and the log decay g = −exp(A_log)·softplus(a + dt_bias), undoing the
/// per-key-head grouping of the fused projections.
pub fn gdn_inputs(
    g: &GdnWeights,
    qkvz: &[f32],
    ba: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let geo = &g.geometry;
    let (dk, dv, r, nk, nv) = (
        geo.k_head_dim,
        geo.v_head_dim,
        geo.v_per_k(),
        geo.num_k_heads,
        geo.num_v_heads,
    );
    let kd = geo.key_dim();
    let group = 2 * dk + 2 * r * dv;
    let mut mixed = vec![0f32; geo.conv_dim()];
    let mut z = vec![0f32; geo.value_dim()];
    let (mut beta, mut decay) = (vec![0f32; nv], vec![0f32; nv]);
    for hk in 0..nk {
        let src = &qkvz[hk * group..(hk + 1) * group];
        mixed[hk * dk..(hk + 1) * dk].copy_from_slice(&src[..dk]);
        mixed[kd + hk * dk..kd + (hk + 1) * dk].copy_from_slice(&src[dk..2 * dk]);
        mixed[2 * kd + hk * r * dv..2 * kd + (hk + 1) * r * dv]
            .copy_from_slice(&src[2 * dk..2 * dk + r * dv]);
        z[hk * r * dv..(hk + 1) * r * dv].copy_from_slice(&src[2 * dk + r * dv..]);
        for j in 0..r {
            let hv = hk * r + j;
            beta[hv] = sigmoid(ba[hk * 2 * r + j]);
            let a = ba[hk * 2 * r + r + j];
            decay[hv] = -g.a_log[hv].exp() * softplus(a + g.dt_bias[hv]);
        }
    }
    (mixed, z, beta, decay)
}

/// Causal depthwise conv + SiLU of one token in place: channel c becomes
/// `silu(Σ_j w[c][j]·in[t − (W−1) + j])` over the ring's W−1 older inputs and this one; the
/// ring then holds the newest W−1.
pub fn gdn_conv(geo: &GdnGeometry, w: &[f32], x: &mut [f32], ring: &mut [f32]) {
    let (c, k) = (geo.conv_dim(), geo.conv_kernel);
    let past = k - 1;
    for ch in 0..c {
        let taps = &w[ch * k..(ch + 1) * k];
        let hist = &mut ring[ch * past..(ch + 1) * past];
        let mut acc = taps[past] * x[ch];
        for (tap, &h) in taps.iter().zip(hist.iter()) {
            acc += tap * h;
        }
        if past > 0 {
            hist.copy_within(1.., 0);
            hist[past - 1] = x[ch];
        }
        x[ch] = silu(acc);
    }
}

/// L2-normalises each q and k head (eps 1e-6 inside the sqrt) and scales q by 1/√dk.
pub fn gdn_l2norm(geo: &GdnGeometry, mixed: &mut [f32]) {
    let (dk, kd) = (geo.k_head_dim, geo.key_dim());
    let scale = 1.0 / (dk as f32).sqrt();
    for (i, head) in mixed[..2 * kd].chunks_exact_mut(dk).enumerate() {
        let ss: f32 = head.iter().map(|v| v * v).sum();
        let mut inv = 1.0 / (ss + 1e-6).sqrt();
        if i < geo.num_k_heads {
            inv *= scale;
        }
        head.iter_mut().for_each(|v| *v *= inv);
    }
}

/// The gated delta rule for one token over every value head: `state [v_heads, dk, dv]`,
/// `core [Vd]` the read-out.
pub fn gdn_recurrence(
    geo: &GdnGeometry,
    mixed: &[f32],
    beta: &[f32],
    decay: &[f32],
    state: &mut [f32],
    core: &mut [f32],
) {
    let (dk, dv, kd, r) = (geo.k_head_dim, geo.v_head_dim, geo.key_dim(), geo.v_per_k());
    let mut delta = vec![0f32; dv];
    for hv in 0..geo.num_v_heads {
        let hk = hv / r;
        let q = &mixed[hk * dk..(hk + 1) * dk];
        let k = &mixed[kd + hk * dk..kd + (hk + 1) * dk];
        let v = &mixed[2 * kd + hv * dv..2 * kd + (hv + 1) * dv];
        let s = &mut state[hv * dk * dv..(hv + 1) * dk * dv];
        let e = decay[hv].exp();
        s.iter_mut().for_each(|x| *x *= e);
        delta.copy_from_slice(v);
        for (i, srow) in s.chunks_exact(dv).enumerate() {
            for (d, &sv) in delta.iter_mut().zip(srow) {
                *d -= sv * k[i];
            }
        }
        delta.iter_mut().for_each(|d| *d *= beta[hv]);
        let o = &mut core[hv * dv..(hv + 1) * dv];
        o.fill(0.0);
        for (i, srow) in s.chunks_exact_mut(dv).enumerate() {
            for ((sv, &d), ov) in srow.iter_mut().zip(&delta).zip(o.iter_mut()) {
                *sv += k[i] * d;
                *ov += *sv * q[i];
            }
        }
    }
}

/// Per value head: o ← rmsnorm(o)·w ⊙ silu(z).
pub fn gdn_gated_norm(geo: &GdnGeometry, core: &mut [f32], z: &[f32], w: &[f32], eps: f32) {
    let dv = geo.v_head_dim;
    for (o, zz) in core.chunks_exact_mut(dv).zip(z.chunks_exact(dv)) {
        let ms = o.iter().map(|v| v * v).sum::<f32>() / dv as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for ((ov, &wv), &zv) in o.iter_mut().zip(w).zip(zz) {
            *ov = *ov * inv * wv * silu(zv);
        }
    }
}

/// out[H] = down(silu(gate·x) ⊙ up·x).
pub fn mlp(m: &Mlp, x: &[f32], out: &mut [f32]) {
    let f = m.width();
    let mut g = vec![0f32; f];
    let mut u = vec![0f32; f];
    matvec(&m.gate, x, &mut g);
    matvec(&m.up, x, &mut u);
    let act: Vec<f32> = g.iter().zip(&u).map(|(a, b)| silu(*a) * b).collect();
    matvec(&m.down, &act, out);
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// The indices of the `k` largest `v[i]` among those `allowed`, best first; ties keep the lower
/// index (as the CPU model and `torch.topk` on these inputs).
fn top_k_of(v: &[f32], k: usize, allowed: impl Fn(usize) -> bool) -> Vec<usize> {
    let mut out: Vec<usize> = Vec::with_capacity(k);
    for _ in 0..k {
        let mut best: Option<usize> = None;
        for (i, &p) in v.iter().enumerate() {
            if !out.contains(&i) && allowed(i) && best.is_none_or(|b| p > v[b]) {
                best = Some(i);
            }
        }
        out.extend(best);
    }
    out
}

/// Softmax routing: the `k` largest probabilities of `softmax(logits)` (ties: the lower id) and
/// their values, renormalised to sum 1 when `norm`; best first.
pub fn softmax_top_k(logits: &[f32], k: usize, norm: bool) -> Vec<(usize, f32)> {
    let mx = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = logits.iter().map(|v| (v - mx).exp()).collect();
    let sum: f32 = e.iter().sum();
    let p: Vec<f32> = e.iter().map(|v| v / sum).collect();
    let mut r: Vec<(usize, f32)> = top_k_of(&p, k, |_| true)
        .into_iter()
        .map(|i| (i, p[i]))
        .collect();
    if norm {
        let s: f32 = r.iter().map(|x| x.1).sum();
        r.iter_mut().for_each(|x| x.1 /= s);
    }
    r
}

/// The experts a router's `logits` [E] choose and their weights, best first.
pub fn route(m: &MoeWeights, logits: &[f32]) -> Vec<(usize, f32)> {
    let k = m.top_k;
    match m.routing {
        Routing::Softmax => softmax_top_k(logits, k, m.norm_topk_prob),
        Routing::SigmoidGroup {
            n_group,
            topk_group,
            routed_scaling_factor,
            bias,
        } => {
            let sc: Vec<f32> = logits.iter().map(|&v| sigmoid(v)).collect();
            let choice: Vec<f32> = sc.iter().zip(bias).map(|(s, b)| s + b).collect();
            let per = sc.len() / n_group;
            let groups: Vec<f32> = choice
                .chunks(per)
                .map(|g| {
                    let best = top_k_of(g, 2.min(per), |_| true);
                    best.iter().map(|&i| g[i]).sum()
                })
                .collect();
            let kept = top_k_of(&groups, topk_group, |_| true);
            let chosen = top_k_of(&choice, k, |i| kept.contains(&(i / per)));
            let mut r: Vec<(usize, f32)> = chosen.into_iter().map(|i| (i, sc[i])).collect();
            let sum: f32 = r.iter().map(|x| x.1).sum();
            let scale = if m.norm_topk_prob {
                routed_scaling_factor / (sum + 1e-20)
            } else {
                routed_scaling_factor
            };
            r.iter_mut().for_each(|x| x.1 *= scale);
            r
        }
    }
}

/// out[H] = the MoE block of the normed `x[H]`.
pub fn moe(m: &MoeWeights, x: &[f32], out: &mut [f32]) {
    let mut logits = vec![0f32; m.router.rows];
    matvec(&m.router, x, &mut logits);
    out.fill(0.0);
    let mut y = vec![0f32; out.len()];
    for (e, p) in route(m, &logits) {
        mlp(&m.experts[e], x, &mut y);
        out.iter_mut().zip(&y).for_each(|(o, v)| *o += p * v);
    }
    if let Some(sh) = &m.shared {
        mlp(&sh.mlp, x, &mut y);
        let scale = match &sh.gate {
            Some(g) => {
                let mut z = [0f32];
                matvec(g, x, &mut z);
                sigmoid(z[0])
            }
            None => 1.0,
        };
        out.iter_mut().zip(&y).for_each(|(o, v)| *o += scale * v);
    }
}

/// Final norm and lm_head: logits [V] of the hidden state `x[H]`.
pub fn head(model: &LlmModel, x: &[f32]) -> Vec<f32> {
    let s = &model.spec;
    let mut xn = vec![0f32; s.hidden];
    rms_norm_styled(x, model.final_norm, s.rms_eps, s.norm_style, &mut xn);
    let mut logits = vec![0f32; model.spec.vocab];
    matvec(&model.lm_head, &xn, &mut logits);
    logits
}

/// The whole model for one token at `pos` (the cache holds positions 0..pos): logits [V].
pub fn forward_token(model: &LlmModel, token: u32, pos: usize, cache: &mut RefCache) -> Vec<f32> {
    let mut x = embed(model, token);
    for l in 0..model.spec.num_layers {
        layer(model, l, &mut x, pos, cache);
    }
    head(model, &x)
}

/// The logits of the last of `tokens`, run one at a time from position 0 on a fresh cache.
pub fn last_logits(model: &LlmModel, tokens: &[u32]) -> Vec<f32> {
    let mut cache = RefCache::new(model.spec.num_layers);
    let mut logits = Vec::new();
    for (pos, &t) in tokens.iter().enumerate() {
        logits = forward_token(model, t, pos, &mut cache);
    }
    logits
}

/// Index of the largest logit (the first one on ties, as `torch.argmax`).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llm::synth::{random_matrix, Rng};
    use cmf_format::Dtype;

    /// Inside `with_q8_inputs` a q8_row product reads its input rounded (bf16, or s8 in blocks
    /// of 32 with an outlier flattening only its own block), other codecs read it as is, and
    /// the rounding ends with the call, also when it panics.
    #[test]
    fn q8_inputs_round_only_q8_products_and_only_inside() {
        let (n, k) = (8, 96);
        let q8 = random_matrix(Dtype::Q8Row, n, k, 0.1, 1);
        let f32m = random_matrix(Dtype::F32, n, k, 0.1, 2);
        let wq = cmf_kernels::Weight {
            dtype: Dtype::Q8Row,
            rows: n,
            cols: k,
            data: &q8,
        };
        let wf = cmf_kernels::Weight {
            dtype: Dtype::F32,
            data: &f32m,
            ..wq
        };
        let mut x = Rng::new(3).vec(k, 1.0);
        x[40] = 50.0;
        let product = |w: &cmf_kernels::Weight, x: &[f32]| {
            let mut y = vec![0f32; n];
            matvec(w, x, &mut y);
            y
        };
        let plain = product(&wq, &x);
        let bf16: Vec<f32> = x
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect();
        assert_eq!(
            with_q8_inputs(Q8Inputs::Bf16, || product(&wq, &x)),
            product(&wq, &bf16)
        );
        let mut s8 = x.clone();
        for b in s8.chunks_mut(32) {
            let d = b.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
            b.iter_mut()
                .for_each(|v| *v = (*v / d).round_ties_even() * d);
        }
        // The outlier's block is coarse, the others are not.
        assert!((s8[3] - x[3]).abs() < 0.01 && (s8[33] - x[33]).abs() > 0.0);
        assert_eq!(
            with_q8_inputs(Q8Inputs::S8Blocks32, || product(&wq, &x)),
            product(&wq, &s8)
        );
        assert_ne!(product(&wq, &s8), plain);
        assert_eq!(
            with_q8_inputs(Q8Inputs::S8Blocks32, || product(&wf, &x)),
            product(&wf, &x)
        );
        let _ = std::panic::catch_unwind(|| with_q8_inputs(Q8Inputs::Bf16, || panic!("inside")));
        assert_eq!(product(&wq, &x), plain);
    }
}
