//! Output-gated attention (Qwen3-Next's full-attention layers), after transformers'
//! `Qwen3NextAttention`:
//!
//! ```text
//! [q | gate] = norm(x)·W_qᵀ           (per head: head_dim query values, then head_dim gate values)
//! q, k = rope(qnorm(q), knorm(norm(x)·W_kᵀ))   (partial rotary: the first rotary_dim of a head)
//! x += (attn(q, cache) ⊙ sigmoid(gate))·W_oᵀ
//! ```
//! Norms follow the config's style (`(1 + w)` for Qwen3-Next).

use super::weights::AttentionWeights;
use super::{linear, linear_shared_input, rows_of, Activations, LayerKv, Model, Segment};
use crate::profile::{time, Op};
use cmf_kernels::ops;

/// Query-and-gate rows of one pass, grown on demand.
#[derive(Default)]
pub(crate) struct GateScratch {
    qg: Vec<f32>,
    gate: Vec<f32>,
}

impl Model<'_> {
    /// `x += (attn(q, cache) ⊙ sigmoid(gate))·Woᵀ`, appending this pass's k, v to the cache.
    pub(super) fn gated_attention_block(
        &self,
        l: usize,
        w: &AttentionWeights,
        kv: &mut dyn LayerKv,
        b: &mut Activations,
        s: &mut GateScratch,
        segs: &[Segment],
    ) {
        let cfg = &self.config;
        let (n, style) = (rows_of(segs), cfg.norm_style);
        let (h, hd, eps) = (cfg.hidden_size, cfg.head_dim, cfg.rms_norm_eps);
        let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
        if s.qg.len() < n * 2 * qd {
            s.qg.resize(n * 2 * qd, 0.0);
            s.gate.resize(n * qd, 0.0);
        }
        let (x, xn, out) = (&mut b.x[..n * h], &mut b.xn[..n * h], &mut b.out[..n * h]);
        let (q, k, v) = (&mut b.q[..n * qd], &mut b.k[..n * kvd], &mut b.v[..n * kvd]);
        let (qg, gate) = (&mut s.qg[..n * 2 * qd], &mut s.gate[..n * qd]);

        time(Op::Norm, || {
            ops::rms_norm(x, h, Some(&w.attn_norm), eps, style, xn)
        });
        time(Op::Qkv, || {
            linear_shared_input([&w.q, &w.k, &w.v], xn, n, [&mut *qg, &mut *k, &mut *v]);
        });
        // Per head the projection holds [query | gate]: de-interleave into q and gate.
        for ((src, qh), gh) in qg
            .chunks_exact(2 * hd)
            .zip(q.chunks_exact_mut(hd))
            .zip(gate.chunks_exact_mut(hd))
        {
            qh.copy_from_slice(&src[..hd]);
            gh.copy_from_slice(&src[hd..]);
        }
        let attn = &mut b.attn[..n * qd];
        self.rope_and_attend(l, w, style, kv, [q, k, v], attn, segs);
        for (a, &g) in attn.iter_mut().zip(gate.iter()) {
            *a *= 1.0 / (1.0 + (-g).exp());
        }
        time(Op::OutProj, || {
            linear(&w.o, attn, n, out);
            ops::add(x, out);
        });
    }
}
