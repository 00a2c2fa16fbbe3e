//! A plain f32 forward pass over an [`LlmModel`], one token at a time, on the CPU.
//!
//! It is the oracle the device backends are checked against (and what the fake backend runs),
//! written for obviousness: every matrix product goes through `cmf_kernels::reference::matvec`.
//! Numerics follow Hugging Face transformers `modeling_qwen3.py` / `modeling_llama.py`:
//! RMSNorm `x · rsqrt(mean(x²) + eps) · w`, rotate-half RoPE, q/k norm before RoPE, softmax
//! over scaled scores, SwiGLU `silu(gate) · up`; mixture-of-experts blocks as cmf-llm's `model::moe`
//! (transformers `Qwen3MoeSparseMoeBlock` / `Qwen2MoeSparseMoeBlock`).

use super::{Ffn, LayerWeights, LlmModel, LlmSpec, Mlp, MoeWeights, Routing};
use cmf_kernels::reference::{decode_row, matvec};

/// The KV cache of the reference forward: per layer, `[S, NKV·D]` keys and values.
#[derive(Debug, Clone, Default)]
pub struct RefCache {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl RefCache {
    pub fn new(num_layers: usize) -> RefCache {
        RefCache {
            k: vec![Vec::new(); num_layers],
            v: vec![Vec::new(); num_layers],
        }
    }

    /// Forgets positions ≥ `len`.
    pub fn truncate(&mut self, len: usize, kv_dim: usize) {
        for l in 0..self.k.len() {
            self.k[l].truncate(len * kv_dim);
            self.v[l].truncate(len * kv_dim);
        }
    }

    /// A cache holding per layer `[S, NKV·D]` keys `k[l]` and values `v[l]`.
    pub fn from_rows(k: Vec<Vec<f32>>, v: Vec<Vec<f32>>) -> RefCache {
        RefCache { k, v }
    }

    /// Layer `l`'s keys and values, `[S, NKV·D]` each.
    pub fn rows(&self, l: usize) -> (&[f32], &[f32]) {
        (&self.k[l], &self.v[l])
    }

    /// Forgets positions ≥ `len` of one layer.
    pub fn truncate_layer(&mut self, layer: usize, len: usize, kv_dim: usize) {
        self.k[layer].truncate(len * kv_dim);
        self.v[layer].truncate(len * kv_dim);
    }
}

pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (ms + eps).sqrt();
    for ((o, a), b) in out.iter_mut().zip(x).zip(w) {
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
    let a = w.attention();
    let (d, nh, nkv) = (s.head_dim, s.num_heads, s.num_kv_heads);
    let mut xn = vec![0f32; s.hidden];
    rms_norm(x, w.attn_norm, s.rms_eps, &mut xn);
    let mut q = vec![0f32; s.q_dim()];
    let mut k = vec![0f32; s.kv_dim()];
    let mut v = vec![0f32; s.kv_dim()];
    matvec(&a.q, &xn, &mut q);
    matvec(&a.k, &xn, &mut k);
    matvec(&a.v, &xn, &mut v);
    for (t, b) in [(&mut q, a.q_bias), (&mut k, a.k_bias), (&mut v, a.v_bias)] {
        if let Some(b) = b {
            t.iter_mut().zip(b).for_each(|(a, b)| *a += b);
        }
    }
    let mut tmp = vec![0f32; d];
    for (heads, norm) in [(&mut q, a.q_norm), (&mut k, a.k_norm)] {
        for h in heads.chunks_mut(d) {
            if let Some(nw) = norm {
                rms_norm(h, nw, s.rms_eps, &mut tmp);
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
    let mut o = vec![0f32; s.hidden];
    matvec(&a.o, &att, &mut o);
    x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);

    rms_norm(x, w.ffn_norm, s.rms_eps, &mut xn);
    match &w.ffn {
        Ffn::Dense(m) => mlp(m, &xn, &mut o),
        Ffn::Moe(m) => moe(m, &xn, &mut o),
    }
    x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
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
    let mut xn = vec![0f32; model.spec.hidden];
    rms_norm(x, model.final_norm, model.spec.rms_eps, &mut xn);
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
