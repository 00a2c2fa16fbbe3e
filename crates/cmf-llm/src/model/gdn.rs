//! The GatedDeltaNet token mixer (Qwen3-Next's linear-attention layers), after transformers'
//! `Qwen3NextGatedDeltaNet` with its pure-torch kernels (`torch_recurrent_gated_delta_rule`,
//! `torch_chunk_gated_delta_rule`, `causal_conv1d_update` / `_fn`):
//!
//! ```text
//! q,k,v,z = xn·W_qkvzᵀ   b,a = xn·W_baᵀ          (rows grouped per key head, split here)
//! q,k,v   = silu(causal depthwise conv(q|k|v))   (kernel W over the last W−1 inputs + this one)
//! q,k     = l2norm(q), l2norm(k);  q /= √dk
//! β = sigmoid(b);  g = −exp(A_log)·softplus(a + dt_bias)
//! per value head h (reading key head h / (v_heads / k_heads)), state S [dk, dv]:
//!     S ← e^g·S;  S ← S + k ⊗ β(v − Sᵀk);  o = Sᵀq
//! x += (rmsnorm(o)·w ⊙ silu(z))·W_outᵀ
//! ```
//! Decode (one row) runs the recurrence; longer passes run the chunked (WY / UT-transform) form
//! over chunks of [`GDN_CHUNK`] rows, which computes the same outputs and final state with
//! matrix products instead of a per-token state update.

use super::weights::GdnWeights;
use super::{linear, linear_shared_input};
use cmf_kernels::ops::{self, NormStyle};
use cmf_kernels::GdnGeometry;

/// Rows per chunk of the chunked delta rule (transformers' `chunk_size`).
pub const GDN_CHUNK: usize = 64;

/// The recurrent state one sequence keeps for one GatedDeltaNet layer.
#[derive(Clone, Debug, PartialEq)]
pub struct GdnState {
    /// The last W−1 convolution inputs per channel: `[conv channels, W − 1]`, oldest first.
    conv: Vec<f32>,
    /// One `[dk, dv]` delta-rule state per value head: `[v_heads, dk, dv]`.
    delta: Vec<f32>,
}

impl GdnState {
    pub fn new(g: &GdnGeometry) -> GdnState {
        GdnState {
            conv: vec![0.0; g.conv_dim() * (g.conv_kernel - 1)],
            delta: vec![0.0; g.num_v_heads * g.k_head_dim * g.v_head_dim],
        }
    }

    /// Back to the state before any token.
    pub fn clear(&mut self) {
        self.conv.fill(0.0);
        self.delta.fill(0.0);
    }

    /// `[conv channels (q|k|v), W − 1]`, oldest input first.
    pub fn conv(&self) -> &[f32] {
        &self.conv
    }

    /// `[v_heads, dk, dv]`.
    pub fn delta(&self) -> &[f32] {
        &self.delta
    }

    /// Bytes this state occupies (fixed: it does not grow with the context).
    pub fn bytes(&self) -> usize {
        (self.conv.len() + self.delta.len()) * 4
    }
}

/// Per-pass buffers of the GDN mixer, grown on demand and shared by every GDN layer.
#[derive(Default)]
pub(crate) struct GdnScratch {
    qkvz: Vec<f32>,
    ba: Vec<f32>,
    /// q|k|v per row before the convolution, then after it (in place of `conv_in`).
    conv_in: Vec<f32>,
    mixed: Vec<f32>,
    z: Vec<f32>,
    beta: Vec<f32>,
    decay: Vec<f32>,
    core: Vec<f32>,
    out: Vec<f32>,
}

impl GdnScratch {
    fn ensure(&mut self, g: &GdnGeometry, h: usize, n: usize) {
        for (buf, width) in [
            (&mut self.qkvz, g.qkvz_dim()),
            (&mut self.ba, 2 * g.num_v_heads),
            (&mut self.conv_in, g.conv_dim()),
            (&mut self.mixed, g.conv_dim()),
            (&mut self.z, g.value_dim()),
            (&mut self.beta, g.num_v_heads),
            (&mut self.decay, g.num_v_heads),
            (&mut self.core, g.value_dim()),
            (&mut self.out, h),
        ] {
            if buf.len() < n * width {
                buf.resize(n * width, 0.0);
            }
        }
    }
}

/// `x[n, H] += gdn(norm(x))`, advancing `st` over the `n` rows.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gdn_block(
    g: &GdnGeometry,
    w: &GdnWeights,
    x: &mut [f32],
    xn: &mut [f32],
    n: usize,
    eps: f32,
    norm_style: NormStyle,
    st: &mut GdnState,
    s: &mut GdnScratch,
) {
    let h = w.in_norm.len();
    s.ensure(g, h, n);
    let (x, xn) = (&mut x[..n * h], &mut xn[..n * h]);
    ops::rms_norm(x, h, Some(&w.in_norm), eps, norm_style, xn);
    let (qkvz, ba) = (
        &mut s.qkvz[..n * g.qkvz_dim()],
        &mut s.ba[..n * 2 * g.num_v_heads],
    );
    linear_shared_input([&w.qkvz, &w.ba], xn, n, [&mut *qkvz, &mut *ba]);

    let (conv_in, z) = (
        &mut s.conv_in[..n * g.conv_dim()],
        &mut s.z[..n * g.value_dim()],
    );
    let (beta, decay) = (
        &mut s.beta[..n * g.num_v_heads],
        &mut s.decay[..n * g.num_v_heads],
    );
    split_projections(g, qkvz, ba, conv_in, z, beta, decay);
    gates(w, beta, decay);

    let mixed = &mut s.mixed[..n * g.conv_dim()];
    causal_conv(g, &w.conv, conv_in, &mut st.conv, mixed);
    normalize_qk(g, mixed);

    let core = &mut s.core[..n * g.value_dim()];
    if n == 1 {
        delta_rule_recurrent(g, mixed, beta, decay, &mut st.delta, core);
    } else {
        delta_rule_chunked(g, mixed, beta, decay, &mut st.delta, core);
    }
    gated_norm(g, core, z, &w.norm, eps);
    let out = &mut s.out[..n * h];
    linear(&w.out, core, n, out);
    ops::add(x, out);
}

/// Splits the projections, grouped per key head as transformers'
/// `fix_query_key_value_ordering` reads them (`[q | k | v(r heads) | z(r heads)]` and
/// `[b(r) | a(r)]` per key head, r value heads per key head), into the conv input
/// `[q (all heads) | k | v]`, the gate z and raw b, a.
fn split_projections(
    g: &GdnGeometry,
    qkvz: &[f32],
    ba: &[f32],
    conv_in: &mut [f32],
    z: &mut [f32],
    b: &mut [f32],
    a: &mut [f32],
) {
    let (dk, dv, r, nk, nv) = (
        g.k_head_dim,
        g.v_head_dim,
        g.v_per_k(),
        g.num_k_heads,
        g.num_v_heads,
    );
    let (kd, vd) = (g.key_dim(), g.value_dim());
    let group = 2 * dk + 2 * r * dv;
    let rows = qkvz.chunks_exact(g.qkvz_dim()).zip(ba.chunks_exact(2 * nv));
    for (t, (src, src_ba)) in rows.enumerate() {
        let dst = &mut conv_in[t * g.conv_dim()..(t + 1) * g.conv_dim()];
        let zt = &mut z[t * vd..(t + 1) * vd];
        for hk in 0..nk {
            let gsrc = &src[hk * group..(hk + 1) * group];
            let (q, rest) = gsrc.split_at(dk);
            let (k, rest) = rest.split_at(dk);
            let (v, zz) = rest.split_at(r * dv);
            dst[hk * dk..(hk + 1) * dk].copy_from_slice(q);
            dst[kd + hk * dk..kd + (hk + 1) * dk].copy_from_slice(k);
            dst[2 * kd + hk * r * dv..2 * kd + (hk + 1) * r * dv].copy_from_slice(v);
            zt[hk * r * dv..(hk + 1) * r * dv].copy_from_slice(zz);
            let gba = &src_ba[hk * 2 * r..(hk + 1) * 2 * r];
            b[t * nv + hk * r..t * nv + (hk + 1) * r].copy_from_slice(&gba[..r]);
            a[t * nv + hk * r..t * nv + (hk + 1) * r].copy_from_slice(&gba[r..]);
        }
    }
}

/// β = sigmoid(b) in place of b; g = −exp(A_log)·softplus(a + dt_bias) in place of a.
fn gates(w: &GdnWeights, beta: &mut [f32], decay: &mut [f32]) {
    let nv = w.a_log.len();
    for b in beta.iter_mut() {
        *b = 1.0 / (1.0 + (-*b).exp());
    }
    for row in decay.chunks_exact_mut(nv) {
        for ((a, &al), &dt) in row.iter_mut().zip(&w.a_log).zip(&w.dt_bias) {
            *a = -al.exp() * softplus(*a + dt);
        }
    }
}

/// torch's `softplus` (beta 1, threshold 20: linear above it).
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Depthwise causal conv + SiLU over `rows` of C channels: output t of channel c is
/// `Σ_j w[c][j]·in[t − (W−1) + j][c]`, where inputs before this pass come from `state`
/// (the last W−1 inputs, zeros for a fresh sequence), which then holds the newest W−1.
fn causal_conv(g: &GdnGeometry, w: &[f32], rows: &[f32], state: &mut [f32], out: &mut [f32]) {
    let (c, k) = (g.conv_dim(), g.conv_kernel);
    let past = k - 1;
    for (inp, o) in rows.chunks_exact(c).zip(out.chunks_exact_mut(c)) {
        for ch in 0..c {
            let taps = &w[ch * k..(ch + 1) * k];
            let hist = &mut state[ch * past..(ch + 1) * past];
            let mut acc = taps[past] * inp[ch];
            for (tap, &h) in taps.iter().zip(hist.iter()) {
                acc += tap * h;
            }
            o[ch] = acc / (1.0 + (-acc).exp());
            if past > 0 {
                hist.copy_within(1.., 0);
                hist[past - 1] = inp[ch];
            }
        }
    }
}

/// L2-normalises each q and k head (transformers' `l2norm`, eps 1e-6 inside the sqrt) and
/// scales q by 1/√dk.
fn normalize_qk(g: &GdnGeometry, mixed: &mut [f32]) {
    let (dk, kd) = (g.k_head_dim, g.key_dim());
    let scale = 1.0 / (dk as f32).sqrt();
    for row in mixed.chunks_exact_mut(g.conv_dim()) {
        for (i, head) in row[..2 * kd].chunks_exact_mut(dk).enumerate() {
            let ss: f32 = head.iter().map(|v| v * v).sum();
            let mut inv = 1.0 / (ss + 1e-6).sqrt();
            if i < g.num_k_heads {
                inv *= scale;
            }
            head.iter_mut().for_each(|v| *v *= inv);
        }
    }
}

/// The q, k and v of value head `hv` in one row of the conv output.
fn head_qkv<'m>(g: &GdnGeometry, row: &'m [f32], hv: usize) -> (&'m [f32], &'m [f32], &'m [f32]) {
    let (dk, dv, kd) = (g.k_head_dim, g.v_head_dim, g.key_dim());
    let hk = hv / g.v_per_k();
    (
        &row[hk * dk..(hk + 1) * dk],
        &row[kd + hk * dk..kd + (hk + 1) * dk],
        &row[2 * kd + hv * dv..2 * kd + (hv + 1) * dv],
    )
}

/// The gated delta rule one token at a time (transformers' `torch_recurrent_gated_delta_rule`).
fn delta_rule_recurrent(
    g: &GdnGeometry,
    mixed: &[f32],
    beta: &[f32],
    decay: &[f32],
    state: &mut [f32],
    core: &mut [f32],
) {
    let (dk, dv, nv) = (g.k_head_dim, g.v_head_dim, g.num_v_heads);
    let mut delta = vec![0f32; dv];
    for (t, row) in mixed.chunks_exact(g.conv_dim()).enumerate() {
        for hv in 0..nv {
            let (q, k, v) = head_qkv(g, row, hv);
            let s = &mut state[hv * dk * dv..(hv + 1) * dk * dv];
            let e = decay[t * nv + hv].exp();
            s.iter_mut().for_each(|x| *x *= e);
            // delta = β(v − Sᵀk)
            delta.copy_from_slice(v);
            for (i, srow) in s.chunks_exact(dv).enumerate() {
                for (d, &sv) in delta.iter_mut().zip(srow) {
                    *d -= sv * k[i];
                }
            }
            let b = beta[t * nv + hv];
            delta.iter_mut().for_each(|d| *d *= b);
            // S += k ⊗ delta;  o = Sᵀq
            let o = &mut core[t * nv * dv + hv * dv..t * nv * dv + (hv + 1) * dv];
            o.fill(0.0);
            for (i, srow) in s.chunks_exact_mut(dv).enumerate() {
                for ((sv, &d), ov) in srow.iter_mut().zip(&delta).zip(o.iter_mut()) {
                    *sv += k[i] * d;
                    *ov += *sv * q[i];
                }
            }
        }
    }
}

/// The gated delta rule over chunks of [`GDN_CHUNK`] rows (transformers'
/// `torch_chunk_gated_delta_rule`). Within a chunk of L rows, with c_i the cumulative log decay:
/// `T = I + strict_lower((β_i k_i·k_j)·e^(c_i − c_j))`, `U = T⁻¹(βv)`, `W = T⁻¹(βk·e^c)`;
/// then `v' = U − W·S`, `o = (q·e^c)·S + tril((q_i·k_j)·e^(c_i − c_j))·v'` and
/// `S ← e^(c_L)·S + (k·e^(c_L − c))ᵀ·v'`. A short last chunk needs no padding.
fn delta_rule_chunked(
    g: &GdnGeometry,
    mixed: &[f32],
    beta: &[f32],
    decay: &[f32],
    state: &mut [f32],
    core: &mut [f32],
) {
    use rayon::prelude::*;
    let (dk, dv, nv, cd) = (g.k_head_dim, g.v_head_dim, g.num_v_heads, g.conv_dim());
    let n = mixed.len() / cd;
    // Value heads are independent: one task each (on the kernels' pool when called inside it),
    // each writing its own state and a [n, dv] output gathered into `core` afterwards.
    let outs: Vec<Vec<f32>> = state
        .par_chunks_mut(dk * dv)
        .enumerate()
        .map(|(hv, s)| {
            let mut c = ChunkBufs::new(dk, dv);
            let mut out = vec![0f32; n * dv];
            let mut t0 = 0;
            while t0 < n {
                let l = GDN_CHUNK.min(n - t0);
                c.load(g, mixed, beta, decay, hv, t0, l);
                c.solve(l);
                c.apply(l, s);
                out[t0 * dv..(t0 + l) * dv].copy_from_slice(&c.out[..l * dv]);
                t0 += l;
            }
            out
        })
        .collect();
    for (hv, out) in outs.iter().enumerate() {
        for (t, o) in out.chunks_exact(dv).enumerate() {
            core[t * nv * dv + hv * dv..t * nv * dv + (hv + 1) * dv].copy_from_slice(o);
        }
    }
}

/// One head's chunk: inputs gathered row-major (`[L, dk]`, `[L, dv]`) and the intermediates.
struct ChunkBufs {
    dk: usize,
    dv: usize,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    beta: Vec<f32>,
    /// cumulative log decay c_i
    cum: Vec<f32>,
    /// strictly lower part of T (row i, col j < i)
    t: Vec<f32>,
    /// U = T⁻¹(βv) [L, dv], then v' = U − W·S
    u: Vec<f32>,
    /// W = T⁻¹(βk·e^c) [L, dk]
    w: Vec<f32>,
    out: Vec<f32>,
}

impl ChunkBufs {
    fn new(dk: usize, dv: usize) -> ChunkBufs {
        let l = GDN_CHUNK;
        ChunkBufs {
            dk,
            dv,
            q: vec![0.0; l * dk],
            k: vec![0.0; l * dk],
            v: vec![0.0; l * dv],
            beta: vec![0.0; l],
            cum: vec![0.0; l],
            t: vec![0.0; l * l],
            u: vec![0.0; l * dv],
            w: vec![0.0; l * dk],
            out: vec![0.0; l * dv],
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn load(
        &mut self,
        g: &GdnGeometry,
        mixed: &[f32],
        beta: &[f32],
        decay: &[f32],
        hv: usize,
        t0: usize,
        l: usize,
    ) {
        let (dk, dv, nv, cd) = (self.dk, self.dv, g.num_v_heads, g.conv_dim());
        let mut acc = 0f32;
        for i in 0..l {
            let t = t0 + i;
            let (q, k, v) = head_qkv(g, &mixed[t * cd..(t + 1) * cd], hv);
            self.q[i * dk..(i + 1) * dk].copy_from_slice(q);
            self.k[i * dk..(i + 1) * dk].copy_from_slice(k);
            self.v[i * dv..(i + 1) * dv].copy_from_slice(v);
            self.beta[i] = beta[t * nv + hv];
            acc += decay[t * nv + hv];
            self.cum[i] = acc;
        }
    }

    /// Forward substitution for U and W (T is unit lower triangular).
    fn solve(&mut self, l: usize) {
        let (dk, dv) = (self.dk, self.dv);
        for i in 0..l {
            for j in 0..i {
                let kk: f32 = dot(&self.k[i * dk..(i + 1) * dk], &self.k[j * dk..(j + 1) * dk]);
                self.t[i * GDN_CHUNK + j] = self.beta[i] * kk * (self.cum[i] - self.cum[j]).exp();
            }
        }
        for i in 0..l {
            let (b, e) = (self.beta[i], self.cum[i].exp());
            for d in 0..dv {
                self.u[i * dv + d] = b * self.v[i * dv + d];
            }
            for d in 0..dk {
                self.w[i * dk + d] = b * e * self.k[i * dk + d];
            }
            for j in 0..i {
                let a = self.t[i * GDN_CHUNK + j];
                let (ui, uj) = self.u.split_at_mut(i * dv);
                axpy(-a, &ui[j * dv..(j + 1) * dv], &mut uj[..dv]);
                let (wi, wj) = self.w.split_at_mut(i * dk);
                axpy(-a, &wi[j * dk..(j + 1) * dk], &mut wj[..dk]);
            }
        }
    }

    /// Outputs of the chunk into `out` and the state carried past it.
    fn apply(&mut self, l: usize, s: &mut [f32]) {
        let (dk, dv) = (self.dk, self.dv);
        // v' = U − W·S;  o = (q·e^c)·S (read before S changes)
        for i in 0..l {
            let ec = self.cum[i].exp();
            let o = &mut self.out[i * dv..(i + 1) * dv];
            o.fill(0.0);
            let u = &mut self.u[i * dv..(i + 1) * dv];
            for r in 0..dk {
                let srow = &s[r * dv..(r + 1) * dv];
                axpy(-self.w[i * dk + r], srow, u);
                axpy(self.q[i * dk + r] * ec, srow, o);
            }
        }
        // o += tril((q_i·k_j)·e^(c_i − c_j))·v'
        for i in 0..l {
            for j in 0..=i {
                let qk = dot(&self.q[i * dk..(i + 1) * dk], &self.k[j * dk..(j + 1) * dk]);
                let a = qk * (self.cum[i] - self.cum[j]).exp();
                let (u, o) = (&self.u[j * dv..(j + 1) * dv], &mut self.out[i * dv..]);
                axpy(a, u, &mut o[..dv]);
            }
        }
        // S ← e^(c_L)·S + Σ_i (k_i·e^(c_L − c_i)) ⊗ v'_i
        let last = self.cum[l - 1];
        let el = last.exp();
        s.iter_mut().for_each(|x| *x *= el);
        for i in 0..l {
            let f = (last - self.cum[i]).exp();
            let u = &self.u[i * dv..(i + 1) * dv];
            for r in 0..dk {
                axpy(self.k[i * dk + r] * f, u, &mut s[r * dv..(r + 1) * dv]);
            }
        }
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// y += a·x
fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (yv, &xv) in y.iter_mut().zip(x) {
        *yv += a * xv;
    }
}

/// Per value head: o ← rmsnorm(o)·w ⊙ silu(z) (transformers' `Qwen3NextRMSNormGated`).
fn gated_norm(g: &GdnGeometry, core: &mut [f32], z: &[f32], w: &[f32], eps: f32) {
    let dv = g.v_head_dim;
    for (o, zz) in core.chunks_exact_mut(dv).zip(z.chunks_exact(dv)) {
        let ms = o.iter().map(|v| v * v).sum::<f32>() / dv as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for ((ov, &wv), &zv) in o.iter_mut().zip(w).zip(zz) {
            *ov = *ov * inv * wv * (zv / (1.0 + (-zv).exp()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> GdnGeometry {
        GdnGeometry {
            num_k_heads: 2,
            num_v_heads: 4,
            k_head_dim: 8,
            v_head_dim: 6,
            conv_kernel: 4,
        }
    }

    /// Deterministic pseudo-random values in [-1, 1).
    fn fill(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn chunked_rule_equals_the_recurrence() {
        let g = cfg();
        // 150 rows: two full chunks and a short one.
        let n = 150;
        let mut mixed = fill(n * g.conv_dim(), 1);
        normalize_qk(&g, &mut mixed);
        let beta: Vec<f32> = fill(n * g.num_v_heads, 2)
            .iter()
            .map(|v| 0.5 + 0.5 * v)
            .collect();
        let decay: Vec<f32> = fill(n * g.num_v_heads, 3)
            .iter()
            .map(|v| -0.3 * (1.0 + v))
            .collect();
        let init = fill(g.num_v_heads * g.k_head_dim * g.v_head_dim, 4);
        let (mut s_rec, mut s_chk) = (init.clone(), init);
        let mut o_rec = vec![0.0; n * g.value_dim()];
        let mut o_chk = vec![0.0; n * g.value_dim()];
        delta_rule_recurrent(&g, &mixed, &beta, &decay, &mut s_rec, &mut o_rec);
        delta_rule_chunked(&g, &mixed, &beta, &decay, &mut s_chk, &mut o_chk);
        let max_diff = |a: &[f32], b: &[f32]| {
            a.iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max)
        };
        assert!(
            max_diff(&o_rec, &o_chk) < 1e-5,
            "{}",
            max_diff(&o_rec, &o_chk)
        );
        assert!(
            max_diff(&s_rec, &s_chk) < 1e-5,
            "{}",
            max_diff(&s_rec, &s_chk)
        );
    }

    #[test]
    fn conv_state_carries_across_passes() {
        let g = cfg();
        let w = fill(g.conv_dim() * g.conv_kernel, 5);
        let rows = fill(7 * g.conv_dim(), 6);
        let mut whole_state = vec![0.0; g.conv_dim() * 3];
        let mut whole = vec![0.0; rows.len()];
        causal_conv(&g, &w, &rows, &mut whole_state, &mut whole);
        let mut st = vec![0.0; g.conv_dim() * 3];
        let mut split = vec![0.0; rows.len()];
        let at = 2 * g.conv_dim();
        causal_conv(&g, &w, &rows[..at], &mut st, &mut split[..at]);
        for t in 2..7 {
            let r = t * g.conv_dim()..(t + 1) * g.conv_dim();
            causal_conv(&g, &w, &rows[r.clone()], &mut st, &mut split[r]);
        }
        assert_eq!(whole, split);
        assert_eq!(whole_state, st);
        // The state holds the last three inputs of each channel, oldest first.
        assert_eq!(
            st[..3],
            [
                rows[4 * g.conv_dim()],
                rows[5 * g.conv_dim()],
                rows[6 * g.conv_dim()]
            ]
        );
    }
}
