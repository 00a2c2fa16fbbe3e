//! The Z-Image DiT (`ZImageTransformer2DModel`, diffusers 0.42.1
//! `models/transformers/transformer_z_image.py`), basic (non-omni) mode, f32 activations.
//!
//! Dimension letters: D = dim (3840), H = heads (30), E = head dim (128), F = FFN hidden (10240),
//! A = adaLN width (min(D, 256)), C = latent channels (16), P = patch features (2·2·C = 64),
//! Lc = caption rows (padded to a multiple of 32: Lp), Ni = image tokens (padded: Np).
//!
//! One forward (`ZImageDit::velocity`):
//! 1. patchify the latent `[C, h, w]` into `[Ni, P]`, embed (`all_x_embedder.2-1`), pad rows to Np
//!    with `x_pad_token`; RoPE ids `(Lp + 1, row, col)`, pad rows `(0, 0, 0)`;
//! 2. the noise refiner (modulated blocks) over the image rows;
//! 3. the caption, embedded and refined once per prompt (`ZImageDit::condition`): RMSNorm →
//!    `cap_embedder.1`, pad rows to Lp with `cap_pad_token`, ids `(1 + j, 0, 0)` for every row j
//!    (pad rows too), the context refiner (unmodulated blocks);
//! 4. the joint sequence `[image (Np) ; caption (Lp)]` through the main layers;
//! 5. the final layer on the Ni real image rows, unpatchified to `[C, h, w]`.
//!
//! Pad rows are *not* masked (diffusers masks only batch padding, which does not exist here
//! because each item of a batch attends over its own rows only).

use crate::ops;
use crate::tensors::{Linear, Loader};
use crate::ZimageError;
use cmf_gpu::dit::{DitBlockWeights, DitGeometry, DitLinear, DitModel, DitPrecision, Fp8Attention};
use cmf_kernels::RopeTable;
use rayon::prelude::*;
use std::collections::HashMap;

/// Rows are padded to a multiple of this (diffusers `SEQ_MULTI_OF`).
pub const SEQ_MULTI_OF: usize = 32;
/// Width of the sinusoidal timestep features (`frequency_embedding_size`).
const FREQ_DIM: usize = 256;
/// Max width of the adaLN conditioning vector (`ADALN_EMBED_DIM`).
const ADALN_EMBED_DIM: usize = 256;
/// Hidden width of the timestep MLP (`TimestepEmbedder(mid_size=1024)`).
const T_MID: usize = 1024;
/// RMSNorm eps of the per-head q/k norms (`Attention(eps=1e-5)`, fixed in diffusers).
const QK_NORM_EPS: f32 = 1e-5;
/// LayerNorm eps of the final layer (`FinalLayer.norm_final`).
const FINAL_NORM_EPS: f32 = 1e-6;

/// The transformer config (`dit.config_json` = diffusers `transformer/config.json`).
#[derive(Clone, Debug, PartialEq)]
pub struct DitConfig {
    pub dim: usize,
    pub n_layers: usize,
    pub n_refiner_layers: usize,
    pub n_heads: usize,
    pub norm_eps: f32,
    pub cap_feat_dim: usize,
    pub in_channels: usize,
    pub rope_theta: f64,
    pub t_scale: f32,
    pub axes_dims: [usize; 3],
    pub axes_lens: [usize; 3],
}

impl DitConfig {
    pub fn from_json(v: &serde_json::Value, origin: &str) -> Result<DitConfig, ZimageError> {
        let bad = |field: &str, why: &str| ZimageError::Config {
            origin: origin.to_string(),
            blob: "dit.config_json".into(),
            field: field.into(),
            why: why.into(),
        };
        let u = |k: &str, d: usize| -> Result<usize, ZimageError> {
            match v.get(k) {
                None | Some(serde_json::Value::Null) => Ok(d),
                Some(x) => x
                    .as_u64()
                    .map(|x| x as usize)
                    .ok_or_else(|| bad(k, "expected an unsigned integer")),
            }
        };
        let f = |k: &str, d: f64| -> Result<f64, ZimageError> {
            match v.get(k) {
                None | Some(serde_json::Value::Null) => Ok(d),
                Some(x) => x.as_f64().ok_or_else(|| bad(k, "expected a number")),
            }
        };
        let triple = |k: &str, d: [usize; 3]| -> Result<[usize; 3], ZimageError> {
            match v.get(k) {
                None | Some(serde_json::Value::Null) => Ok(d),
                Some(x) => {
                    let a: Vec<usize> = x
                        .as_array()
                        .ok_or_else(|| bad(k, "expected a list"))?
                        .iter()
                        .map(|e| e.as_u64().map(|e| e as usize))
                        .collect::<Option<_>>()
                        .ok_or_else(|| bad(k, "expected unsigned integers"))?;
                    a.try_into().map_err(|_| bad(k, "expected three axes"))
                }
            }
        };
        let cfg = DitConfig {
            dim: u("dim", 3840)?,
            n_layers: u("n_layers", 30)?,
            n_refiner_layers: u("n_refiner_layers", 2)?,
            n_heads: u("n_heads", 30)?,
            norm_eps: f("norm_eps", 1e-5)? as f32,
            cap_feat_dim: u("cap_feat_dim", 2560)?,
            in_channels: u("in_channels", 16)?,
            rope_theta: f("rope_theta", 256.0)?,
            t_scale: f("t_scale", 1000.0)? as f32,
            axes_dims: triple("axes_dims", [32, 48, 48])?,
            axes_lens: triple("axes_lens", [1024, 512, 512])?,
        };
        if u("n_kv_heads", cfg.n_heads)? != cfg.n_heads {
            return Err(bad(
                "n_kv_heads",
                "grouped K/V heads are not part of Z-Image; expected n_kv_heads = n_heads",
            ));
        }
        if v.get("qk_norm").and_then(|x| x.as_bool()) == Some(false) {
            return Err(bad(
                "qk_norm",
                "Z-Image uses q/k RMSNorm; false is not supported",
            ));
        }
        let has = |k: &str, want: u64| {
            v.get(k)
                .and_then(|x| x.as_array())
                .is_none_or(|a| a.iter().any(|e| e.as_u64() == Some(want)))
        };
        if !has("all_patch_size", 2) || !has("all_f_patch_size", 1) {
            return Err(bad(
                "all_patch_size",
                "only the 2×2 (f = 1) patch is supported",
            ));
        }
        if cfg.n_heads == 0 || !cfg.dim.is_multiple_of(cfg.n_heads) {
            return Err(bad("n_heads", "must divide dim"));
        }
        let hd = cfg.dim / cfg.n_heads;
        if cfg.axes_dims.iter().sum::<usize>() != hd || cfg.axes_dims.iter().any(|d| d % 2 != 0) {
            return Err(bad("axes_dims", "must be even and sum to the head dim"));
        }
        Ok(cfg)
    }

    pub fn head_dim(&self) -> usize {
        self.dim / self.n_heads
    }
    pub fn adaln_dim(&self) -> usize {
        self.dim.min(ADALN_EMBED_DIM)
    }
    /// Features of one 2×2 patch.
    pub fn patch_dim(&self) -> usize {
        4 * self.in_channels
    }
}

/// One transformer block (`ZImageTransformerBlock`); `ada` is `None` for the context refiner.
struct Block<'a> {
    to_q: Linear<'a>,
    to_k: Linear<'a>,
    to_v: Linear<'a>,
    to_out: Linear<'a>,
    norm_q: Vec<f32>,
    norm_k: Vec<f32>,
    attention_norm1: Vec<f32>,
    attention_norm2: Vec<f32>,
    ffn_norm1: Vec<f32>,
    ffn_norm2: Vec<f32>,
    w1: Linear<'a>,
    w2: Linear<'a>,
    w3: Linear<'a>,
    ada: Option<Linear<'a>>,
}

/// Per-item adaLN values of one block: `1 + scale`, `tanh(gate)` for attention and FFN, each `[D]`.
struct Modulation {
    scale_msa: Vec<f32>,
    gate_msa: Vec<f32>,
    scale_mlp: Vec<f32>,
    gate_mlp: Vec<f32>,
}

/// A run of rows of one batch item inside a block's input.
struct Segment<'s> {
    start: usize,
    len: usize,
    /// RoPE rows `rope_row0 .. rope_row0 + len` of `rope` belong to these rows.
    rope: &'s RopeTable,
    rope_row0: usize,
    modulation: Option<&'s Modulation>,
}

impl<'a> Block<'a> {
    fn load(
        ld: &Loader<'a>,
        p: &str,
        cfg: &DitConfig,
        modulated: bool,
    ) -> Result<Block<'a>, ZimageError> {
        let (d, hd) = (cfg.dim, cfg.head_dim());
        let f = ld.shape(&format!("{p}.feed_forward.w1.weight"))?[0];
        let lin = |n: &str, o: usize, i: usize, b: bool| ld.linear(&format!("{p}.{n}"), o, i, b);
        let vecf = |n: &str, len: usize| ld.vec_f32(&format!("{p}.{n}"), len);
        Ok(Block {
            to_q: lin("attention.to_q", d, d, false)?,
            to_k: lin("attention.to_k", d, d, false)?,
            to_v: lin("attention.to_v", d, d, false)?,
            to_out: lin("attention.to_out.0", d, d, false)?,
            norm_q: vecf("attention.norm_q.weight", hd)?,
            norm_k: vecf("attention.norm_k.weight", hd)?,
            attention_norm1: vecf("attention_norm1.weight", d)?,
            attention_norm2: vecf("attention_norm2.weight", d)?,
            ffn_norm1: vecf("ffn_norm1.weight", d)?,
            ffn_norm2: vecf("ffn_norm2.weight", d)?,
            w1: lin("feed_forward.w1", f, d, false)?,
            w2: lin("feed_forward.w2", d, f, false)?,
            w3: lin("feed_forward.w3", f, d, false)?,
            ada: if modulated {
                Some(lin("adaLN_modulation.0", 4 * d, cfg.adaln_dim(), true)?)
            } else {
                None
            },
        })
    }

    /// adaLN for the conditioning vector `c` `[A]` (no SiLU before this Linear in diffusers).
    fn modulation(&self, c: &[f32]) -> Modulation {
        let ada = self
            .ada
            .as_ref()
            .expect("modulation on an unmodulated block");
        let m = ada.forward(c, 1);
        let d = m.len() / 4;
        let chunk = |i: usize| &m[i * d..(i + 1) * d];
        Modulation {
            scale_msa: chunk(0).iter().map(|s| 1.0 + s).collect(),
            gate_msa: chunk(1).iter().map(|g| g.tanh()).collect(),
            scale_mlp: chunk(2).iter().map(|s| 1.0 + s).collect(),
            gate_mlp: chunk(3).iter().map(|g| g.tanh()).collect(),
        }
    }

    /// `x` `[rows, D]` in place; each segment attends over its own rows only. `ws` holds the
    /// intermediates, reused from block to block.
    fn forward(&self, x: &mut [f32], segs: &[Segment], cfg: &DitConfig, ws: &mut BlockScratch) {
        let d = cfg.dim;
        let (heads, hd) = (cfg.n_heads, cfg.head_dim());
        let rows = x.len() / d;
        let ffn = self.w1.out_dim();
        let BlockScratch {
            h,
            q,
            k,
            v,
            o,
            a,
            b,
        } = ws;
        let [h, q, k, v, o] = [h, q, k, v, o].map(|buf| sized(buf, rows * d));
        let [a, b] = [a, b].map(|buf| sized(buf, rows * ffn));

        // attention: x += tanh(g_msa) · norm2(attn(norm1(x) · (1 + s_msa)))
        ops::rms_norm(x, d, &self.attention_norm1, cfg.norm_eps, h);
        scale_rows(h, d, segs, |m| &m.scale_msa);
        self.to_q.forward_into(h, rows, q);
        self.to_k.forward_into(h, rows, k);
        self.to_v.forward_into(h, rows, v);
        ops::rms_norm_inplace(q, hd, &self.norm_q, QK_NORM_EPS);
        ops::rms_norm_inplace(k, hd, &self.norm_k, QK_NORM_EPS);
        for s in segs {
            let r = s.start * d..(s.start + s.len) * d;
            ops::rope_interleaved(&mut q[r.clone()], s.len, heads, hd, s.rope, s.rope_row0);
            ops::rope_interleaved(&mut k[r.clone()], s.len, heads, hd, s.rope, s.rope_row0);
            ops::attention(
                &q[r.clone()],
                &k[r.clone()],
                &v[r.clone()],
                s.len,
                heads,
                hd,
                &mut h[r],
            );
        }
        self.to_out.forward_into(h, rows, o);
        ops::rms_norm_inplace(o, d, &self.attention_norm2, cfg.norm_eps);
        add_gated(x, o, d, segs, |m| &m.gate_msa);

        // FFN: x += tanh(g_mlp) · ffn_norm2(w2(silu(w1 h) · w3 h)), h = ffn_norm1(x) · (1 + s_mlp)
        ops::rms_norm(x, d, &self.ffn_norm1, cfg.norm_eps, h);
        scale_rows(h, d, segs, |m| &m.scale_mlp);
        self.w1.forward_into(h, rows, a);
        self.w3.forward_into(h, rows, b);
        ops::swiglu_inplace(a, b);
        self.w2.forward_into(a, rows, o);
        ops::rms_norm_inplace(o, d, &self.ffn_norm2, cfg.norm_eps);
        add_gated(x, o, d, segs, |m| &m.gate_mlp);
    }
}

/// A block's intermediates (normed rows, q, k, v, projections, the FFN's two halves), kept across
/// the blocks of a forward: at 1024² they are ~0.65 GB a block, which freshly allocated cost
/// the kernel a page fault and a page clear per 4 KiB every block.
#[derive(Default)]
struct BlockScratch {
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    o: Vec<f32>,
    a: Vec<f32>,
    b: Vec<f32>,
}

/// `buf` as exactly `len` values (grown with zeros when short; every user overwrites it).
fn sized(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    buf.resize(len, 0.0);
    &mut buf[..]
}

/// `h[row] *= pick(modulation)` for the rows of each modulated segment.
fn scale_rows(
    h: &mut [f32],
    d: usize,
    segs: &[Segment],
    pick: impl Fn(&Modulation) -> &Vec<f32> + Sync,
) {
    for s in segs {
        if let Some(m) = s.modulation {
            let sc = pick(m);
            h[s.start * d..(s.start + s.len) * d]
                .par_chunks_mut(d)
                .for_each(|row| row.iter_mut().zip(sc).for_each(|(v, &f)| *v *= f));
        }
    }
}

/// `x[row] += gate ⊙ o[row]` (modulated segments) or `x[row] += o[row]` (unmodulated).
fn add_gated(
    x: &mut [f32],
    o: &[f32],
    d: usize,
    segs: &[Segment],
    pick: impl Fn(&Modulation) -> &Vec<f32> + Sync,
) {
    for s in segs {
        let r = s.start * d..(s.start + s.len) * d;
        let gate = s.modulation.map(&pick);
        x[r.clone()]
            .par_chunks_mut(d)
            .zip(o[r].par_chunks(d))
            .for_each(|(xr, or)| match gate {
                Some(g) => xr
                    .iter_mut()
                    .zip(or)
                    .zip(g)
                    .for_each(|((xv, &ov), &gv)| *xv += gv * ov),
                None => xr.iter_mut().zip(or).for_each(|(xv, &ov)| *xv += ov),
            });
    }
}

/// A caption embedded and refined for one prompt: reused by every denoising step.
pub struct Conditioning {
    /// `[Lp, D]` after the context refiner.
    rows: Vec<f32>,
    /// Real caption rows (before padding).
    pub len: usize,
    /// Rows after padding to a multiple of 32.
    pub len_padded: usize,
}

/// One item of a batched forward: the latent, its caption, its time.
pub struct DitItem<'x> {
    /// `[C, h, w]` latent (h, w even).
    pub latents: &'x [f32],
    pub cond: &'x Conditioning,
    /// Model time `t = 1 − σ` in [0, 1]; multiplied by `t_scale` inside.
    pub t: f32,
}

/// The loaded transformer; weights are borrowed from the file.
pub struct ZImageDit<'a> {
    pub cfg: DitConfig,
    x_embedder: Linear<'a>,
    x_pad_token: Vec<f32>,
    cap_norm: Vec<f32>,
    cap_embedder: Linear<'a>,
    cap_pad_token: Vec<f32>,
    t_mlp0: Linear<'a>,
    t_mlp2: Linear<'a>,
    noise_refiner: Vec<Block<'a>>,
    context_refiner: Vec<Block<'a>>,
    layers: Vec<Block<'a>>,
    final_ada: Linear<'a>,
    final_linear: Linear<'a>,
}

impl<'a> ZImageDit<'a> {
    /// Loads from tensors named as in diffusers under the loader's prefix (`dit.` in a pack).
    pub fn load(ld: &Loader<'a>, cfg: DitConfig) -> Result<ZImageDit<'a>, ZimageError> {
        let (d, a, p, cf) = (cfg.dim, cfg.adaln_dim(), cfg.patch_dim(), cfg.cap_feat_dim);
        let blocks =
            |name: &str, n: usize, modulated: bool| -> Result<Vec<Block<'a>>, ZimageError> {
                (0..n)
                    .map(|i| Block::load(ld, &format!("{name}.{i}"), &cfg, modulated))
                    .collect()
            };
        Ok(ZImageDit {
            x_embedder: ld.linear("all_x_embedder.2-1", d, p, true)?,
            x_pad_token: ld.vec_f32("x_pad_token", d)?,
            cap_norm: ld.vec_f32("cap_embedder.0.weight", cf)?,
            cap_embedder: ld.linear("cap_embedder.1", d, cf, true)?,
            cap_pad_token: ld.vec_f32("cap_pad_token", d)?,
            t_mlp0: ld.linear("t_embedder.mlp.0", T_MID, FREQ_DIM, true)?,
            t_mlp2: ld.linear("t_embedder.mlp.2", a, T_MID, true)?,
            noise_refiner: blocks("noise_refiner", cfg.n_refiner_layers, true)?,
            context_refiner: blocks("context_refiner", cfg.n_refiner_layers, false)?,
            layers: blocks("layers", cfg.n_layers, true)?,
            final_ada: ld.linear("all_final_layer.2-1.adaLN_modulation.1", d, a, true)?,
            final_linear: ld.linear("all_final_layer.2-1.linear", p, d, true)?,
            cfg,
        })
    }

    /// Embeds and refines a caption `[len, cap_feat_dim]` (the text encoder's `hidden_states[-2]`).
    pub fn condition(&self, cap: &[f32], len: usize) -> Conditioning {
        let (d, cf) = (self.cfg.dim, self.cfg.cap_feat_dim);
        assert_eq!(
            cap.len(),
            len * cf,
            "caption features must be [len, cap_feat_dim]"
        );
        let lp = pad_to(len.max(1));
        let mut normed = vec![0f32; len * cf];
        ops::rms_norm(cap, cf, &self.cap_norm, self.cfg.norm_eps, &mut normed);
        let mut rows = vec![0f32; lp * d];
        self.cap_embedder
            .forward_into(&normed, len, &mut rows[..len * d]);
        for r in len..lp {
            rows[r * d..(r + 1) * d].copy_from_slice(&self.cap_pad_token);
        }
        let rope = self.rope_table(&caption_ids(lp));
        let seg = [Segment {
            start: 0,
            len: lp,
            rope: &rope,
            rope_row0: 0,
            modulation: None,
        }];
        let mut ws = BlockScratch::default();
        for b in &self.context_refiner {
            b.forward(&mut rows, &seg, &self.cfg, &mut ws);
        }
        Conditioning {
            rows,
            len,
            len_padded: lp,
        }
    }

    /// Convenience: one forward of one item from raw caption features.
    pub fn forward(
        &self,
        latents: &[f32],
        h: usize,
        w: usize,
        t: f32,
        cap: &[f32],
        cap_len: usize,
    ) -> Vec<f32> {
        let cond = self.condition(cap, cap_len);
        self.velocity(
            &[DitItem {
                latents,
                cond: &cond,
                t,
            }],
            h,
            w,
        )
        .remove(0)
    }

    /// The model output for each item (same latent size `h × w` for all), each `[C, h, w]`.
    /// Items share every weight read (one matmul over all their rows) and attend separately.
    pub fn velocity(&self, items: &[DitItem], h: usize, w: usize) -> Vec<Vec<f32>> {
        let cfg = &self.cfg;
        let (d, c) = (cfg.dim, cfg.in_channels);
        assert!(
            h.is_multiple_of(2) && w.is_multiple_of(2),
            "latent size must be even"
        );
        let (ht, wt) = (h / 2, w / 2);
        let ni = ht * wt;
        let np = pad_to(ni);
        let nb = items.len();

        // t embedding → adaLN for every modulated block, per item.
        let t_emb: Vec<Vec<f32>> = items
            .iter()
            .map(|it| self.timestep_embedding(it.t))
            .collect();
        let refiner_mods: Vec<Vec<Modulation>> = self
            .noise_refiner
            .iter()
            .map(|b| t_emb.iter().map(|e| b.modulation(e)).collect())
            .collect();
        let layer_mods: Vec<Vec<Modulation>> = self
            .layers
            .iter()
            .map(|b| t_emb.iter().map(|e| b.modulation(e)).collect())
            .collect();

        // 1. patchify + embed + pad, all items stacked: [nb·Np, D]
        let mut img = vec![0f32; nb * np * d];
        for (i, it) in items.iter().enumerate() {
            assert_eq!(it.latents.len(), c * h * w, "latents must be [C, h, w]");
            let patches = patchify(it.latents, c, h, w);
            let dst = &mut img[i * np * d..(i + 1) * np * d];
            self.x_embedder
                .forward_into(&patches, ni, &mut dst[..ni * d]);
            for r in ni..np {
                dst[r * d..(r + 1) * d].copy_from_slice(&self.x_pad_token);
            }
        }

        // RoPE of the joint sequence [image (Np) ; caption (Lp)] per item; the image ids depend on
        // the caption length. The noise refiner uses its first Np rows.
        let ropes: Vec<RopeTable> = items
            .iter()
            .map(|it| {
                let mut ids = image_ids(ht, wt, it.cond.len_padded);
                ids.extend(caption_ids(it.cond.len_padded));
                self.rope_table(&ids)
            })
            .collect();

        // 2. noise refiner over the image rows of each item.
        let mut ws = BlockScratch::default();
        for (b, mods) in self.noise_refiner.iter().zip(&refiner_mods) {
            let segs: Vec<Segment> = (0..nb)
                .map(|i| Segment {
                    start: i * np,
                    len: np,
                    rope: &ropes[i],
                    rope_row0: 0,
                    modulation: Some(&mods[i]),
                })
                .collect();
            b.forward(&mut img, &segs, cfg, &mut ws);
        }

        // 3./4. joint sequence [image ; caption] per item, through the main layers.
        let lens: Vec<usize> = items.iter().map(|it| np + it.cond.len_padded).collect();
        let starts: Vec<usize> = lens
            .iter()
            .scan(0, |acc, &l| Some(std::mem::replace(acc, *acc + l)))
            .collect();
        let total: usize = lens.iter().sum();
        let mut x = vec![0f32; total * d];
        for (i, it) in items.iter().enumerate() {
            let s = starts[i] * d;
            x[s..s + np * d].copy_from_slice(&img[i * np * d..(i + 1) * np * d]);
            x[s + np * d..s + lens[i] * d].copy_from_slice(&it.cond.rows);
        }
        drop(img);
        for (b, mods) in self.layers.iter().zip(&layer_mods) {
            let segs: Vec<Segment> = (0..nb)
                .map(|i| Segment {
                    start: starts[i],
                    len: lens[i],
                    rope: &ropes[i],
                    rope_row0: 0,
                    modulation: Some(&mods[i]),
                })
                .collect();
            b.forward(&mut x, &segs, cfg, &mut ws);
        }

        // 5. final layer on the real image rows, unpatchify.
        items
            .iter()
            .enumerate()
            .map(|(i, _)| {
                let rows = &x[starts[i] * d..(starts[i] + ni) * d];
                let mut silu_c = t_emb[i].clone();
                ops::silu_inplace(&mut silu_c);
                let scale: Vec<f32> = self
                    .final_ada
                    .forward(&silu_c, 1)
                    .iter()
                    .map(|s| 1.0 + s)
                    .collect();
                let mut hn = vec![0f32; ni * d];
                ops::layer_norm_plain(rows, d, FINAL_NORM_EPS, &mut hn);
                hn.par_chunks_mut(d)
                    .for_each(|r| r.iter_mut().zip(&scale).for_each(|(v, &s)| *v *= s));
                let out = self.final_linear.forward(&hn, ni);
                unpatchify(&out, c, h, w)
            })
            .collect()
    }

    /// The timestep embedding of model time `t` (`t_scale` applied, then [`ZImageDit::t_embed`]):
    /// what every forward at `t` conditions on, on the CPU and on the device.
    pub fn timestep_embedding(&self, t: f32) -> Vec<f32> {
        self.t_embed(t * self.cfg.t_scale)
    }

    /// `TimestepEmbedder`: sinusoid [cos, sin] of `t` (already scaled) → Linear → SiLU → Linear.
    pub fn t_embed(&self, t: f32) -> Vec<f32> {
        let f = timestep_features(t);
        let mut hid = self.t_mlp0.forward(&f, 1);
        ops::silu_inplace(&mut hid);
        self.t_mlp2.forward(&hid, 1)
    }

    /// The RoPE table for position ids (`RopeEmbedder`: per axis f64 frequencies `θ^(−2j/d)`,
    /// f64 angles `pos · freq` rounded to f32, axes concatenated along the head's pairs).
    fn rope_table(&self, ids: &[[usize; 3]]) -> RopeTable {
        let freqs: Vec<Vec<f64>> = self
            .cfg
            .axes_dims
            .iter()
            .map(|&dim| {
                (0..dim / 2)
                    .map(|j| 1.0 / self.cfg.rope_theta.powf((2 * j) as f64 / dim as f64))
                    .collect()
            })
            .collect();
        axes_rope_table(&freqs, ids, self.cfg.head_dim() / 2)
    }

    /// The weights as a device backend takes them (borrowed, nothing decoded).
    pub fn device_model<'s>(&'s self, precision: DitPrecision) -> DitModel<'s> {
        let lin = |l: &'s Linear<'a>| DitLinear {
            w: l.w,
            b: l.b.as_deref(),
        };
        let blocks = |bs: &'s [Block<'a>]| -> Vec<DitBlockWeights<'s>> {
            bs.iter()
                .map(|b| DitBlockWeights {
                    to_q: b.to_q.w,
                    to_k: b.to_k.w,
                    to_v: b.to_v.w,
                    to_out: b.to_out.w,
                    w1: b.w1.w,
                    w2: b.w2.w,
                    w3: b.w3.w,
                    norm_q: &b.norm_q,
                    norm_k: &b.norm_k,
                    attention_norm1: &b.attention_norm1,
                    attention_norm2: &b.attention_norm2,
                    ffn_norm1: &b.ffn_norm1,
                    ffn_norm2: &b.ffn_norm2,
                    ada: b.ada.as_ref().map(lin),
                })
                .collect()
        };
        let cfg = &self.cfg;
        let ffn = self
            .layers
            .iter()
            .chain(&self.noise_refiner)
            .next()
            .map_or(0, |b| b.w1.out_dim());
        DitModel {
            precision,
            fp8_attention: Fp8Attention::Auto,
            geo: DitGeometry {
                dim: cfg.dim,
                n_heads: cfg.n_heads,
                ffn,
                norm_eps: cfg.norm_eps,
                qk_eps: QK_NORM_EPS,
                final_eps: FINAL_NORM_EPS,
                patch_dim: cfg.patch_dim(),
                cap_feat_dim: cfg.cap_feat_dim,
                adaln_dim: cfg.adaln_dim(),
            },
            x_embedder: lin(&self.x_embedder),
            x_pad_token: &self.x_pad_token,
            cap_norm: &self.cap_norm,
            cap_embedder: lin(&self.cap_embedder),
            cap_pad_token: &self.cap_pad_token,
            noise_refiner: blocks(&self.noise_refiner),
            context_refiner: blocks(&self.context_refiner),
            layers: blocks(&self.layers),
            final_ada: lin(&self.final_ada),
            final_linear: lin(&self.final_linear),
        }
    }

    /// RoPE cos/sin rows `[rows, head_dim / 2]` of an item's joint sequence `[image ; caption]`
    /// for an `h × w` latent and a caption padded to `lp` rows (what the device steps use).
    pub fn joint_rope(&self, h: usize, w: usize, lp: usize) -> (Vec<f32>, Vec<f32>) {
        let mut ids = image_ids(h / 2, w / 2, lp);
        ids.extend(caption_ids(lp));
        self.rope_table(&ids).into_cos_sin()
    }

    /// RoPE rows of a caption padded to `lp` rows (the device context refiner).
    pub fn caption_rope(&self, lp: usize) -> (Vec<f32>, Vec<f32>) {
        self.rope_table(&caption_ids(lp)).into_cos_sin()
    }

    /// The largest caption (padded) and image grid the RoPE tables of this config cover.
    pub fn check_geometry(&self, h_lat: usize, w_lat: usize, cap_len: usize) -> Result<(), String> {
        let lens = self.cfg.axes_lens;
        let cap_padded = pad_to(cap_len.max(1));
        if cap_padded + 1 >= lens[0] {
            return Err(format!(
                "the caption ({cap_len} tokens) exceeds the model's position range {}",
                lens[0]
            ));
        }
        if h_lat / 2 > lens[1] || w_lat / 2 > lens[2] {
            return Err(format!(
                "the image ({}×{} patches) exceeds the model's position range {}×{}",
                h_lat / 2,
                w_lat / 2,
                lens[1],
                lens[2]
            ));
        }
        Ok(())
    }
}

/// The RoPE table of rows with ids `ids`: row r is the concatenation over the axes of
/// cos/sin(f32(id[axis] · freq)) for that axis's frequencies (`pairs` in all). An axis's part of a
/// row depends on that axis's id alone, and the rows repeat few ids (a 1024² image: one for axis
/// 0, 64 rows, 64 columns), so each (axis, id) part is computed once: the same values as
/// computing every row, which took ~10 ms for a 1024² table.
fn axes_rope_table(freqs: &[Vec<f64>], ids: &[[usize; 3]], pairs: usize) -> RopeTable {
    let mut parts: HashMap<(usize, usize), RopeTable> = HashMap::new();
    let (mut cos, mut sin) = (
        Vec::with_capacity(ids.len() * pairs),
        Vec::with_capacity(ids.len() * pairs),
    );
    for id in ids {
        for (axis, fr) in freqs.iter().enumerate().filter(|(_, fr)| !fr.is_empty()) {
            let part = parts.entry((axis, id[axis])).or_insert_with(|| {
                let angles: Vec<f32> = fr.iter().map(|&f| (id[axis] as f64 * f) as f32).collect();
                ops::rope_table(&angles, fr.len())
            });
            cos.extend_from_slice(part.cos(0));
            sin.extend_from_slice(part.sin(0));
        }
    }
    RopeTable::from_cos_sin(cos, sin, pairs)
}

/// RoPE ids of the image tokens: `(cap_padded + 1, row, col)`, pad rows `(0, 0, 0)` (`_pad_with_ids`).
fn image_ids(ht: usize, wt: usize, cap_padded: usize) -> Vec<[usize; 3]> {
    let np = pad_to(ht * wt);
    let mut ids = Vec::with_capacity(np);
    for r in 0..ht {
        for c in 0..wt {
            ids.push([cap_padded + 1, r, c]);
        }
    }
    ids.resize(np, [0, 0, 0]);
    ids
}

/// RoPE ids of the caption rows, pad rows included: `(1 + j, 0, 0)`.
fn caption_ids(lp: usize) -> Vec<[usize; 3]> {
    (0..lp).map(|j| [1 + j, 0, 0]).collect()
}

/// Rounds up to a multiple of 32.
pub fn pad_to(n: usize) -> usize {
    n.div_ceil(SEQ_MULTI_OF) * SEQ_MULTI_OF
}

/// `TimestepEmbedder.timestep_embedding` in f32: `freqs_j = exp(−ln(10⁴)·j / 128)`,
/// features `[cos(t·freqs), sin(t·freqs)]`.
fn timestep_features(t: f32) -> Vec<f32> {
    let half = FREQ_DIM / 2;
    let neg_log = -(10000f64.ln()) as f32;
    let args: Vec<f32> = (0..half)
        .map(|j| {
            let e = (neg_log * j as f32) / half as f32;
            t * (e as f64).exp() as f32
        })
        .collect();
    let mut f: Vec<f32> = args.iter().map(|&a| (a as f64).cos() as f32).collect();
    f.extend(args.iter().map(|&a| (a as f64).sin() as f32));
    f
}

/// `[C, h, w]` → `[(h/2)(w/2), 4C]` with features in (ph, pw, c) order (`_patchify_image`).
pub fn patchify(lat: &[f32], c: usize, h: usize, w: usize) -> Vec<f32> {
    let (ht, wt) = (h / 2, w / 2);
    let mut out = vec![0f32; ht * wt * 4 * c];
    for ty in 0..ht {
        for tx in 0..wt {
            let tok = &mut out[(ty * wt + tx) * 4 * c..][..4 * c];
            for ph in 0..2 {
                for pw in 0..2 {
                    for ch in 0..c {
                        tok[(ph * 2 + pw) * c + ch] =
                            lat[ch * h * w + (ty * 2 + ph) * w + tx * 2 + pw];
                    }
                }
            }
        }
    }
    out
}

/// Inverse of `patchify`.
pub fn unpatchify(tok: &[f32], c: usize, h: usize, w: usize) -> Vec<f32> {
    let (ht, wt) = (h / 2, w / 2);
    let mut out = vec![0f32; c * h * w];
    for ty in 0..ht {
        for tx in 0..wt {
            let t = &tok[(ty * wt + tx) * 4 * c..][..4 * c];
            for ph in 0..2 {
                for pw in 0..2 {
                    for ch in 0..c {
                        out[ch * h * w + (ty * 2 + ph) * w + tx * 2 + pw] =
                            t[(ph * 2 + pw) * c + ch];
                    }
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The memoised table equals computing every row's angles (what it replaced), bit for bit.
    #[test]
    fn axes_rope_table_matches_per_row_angles() {
        let (theta, dims) = (256f64, [32usize, 48, 48]);
        let freqs: Vec<Vec<f64>> = dims
            .iter()
            .map(|&dim| {
                (0..dim / 2)
                    .map(|j| 1.0 / theta.powf((2 * j) as f64 / dim as f64))
                    .collect()
            })
            .collect();
        let lp = 64;
        let mut ids = image_ids(12, 20, lp);
        ids.extend(caption_ids(lp));
        let pairs = 64;
        let mut angles = Vec::new();
        for id in &ids {
            for (axis, fr) in freqs.iter().enumerate() {
                angles.extend(fr.iter().map(|&f| (id[axis] as f64 * f) as f32));
            }
        }
        let want = ops::rope_table(&angles, pairs);
        let got = axes_rope_table(&freqs, &ids, pairs);
        assert_eq!(got.rows(), ids.len());
        for r in 0..ids.len() {
            assert_eq!(got.cos(r), want.cos(r), "cos row {r}");
            assert_eq!(got.sin(r), want.sin(r), "sin row {r}");
        }
    }

    #[test]
    fn patchify_round_trip_and_order() {
        let (c, h, w) = (3, 4, 6);
        let lat: Vec<f32> = (0..c * h * w).map(|i| i as f32).collect();
        let t = patchify(&lat, c, h, w);
        // token (0, 1) = rows 0..2, cols 2..4; feature (ph=1, pw=0, c=2) = lat[2][1][2]
        assert_eq!(t[4 * c + (2 * c) + 2], lat[2 * h * w + w + 2]);
        assert_eq!(unpatchify(&t, c, h, w), lat);
    }

    #[test]
    fn padding() {
        assert_eq!(pad_to(1), 32);
        assert_eq!(pad_to(32), 32);
        assert_eq!(pad_to(33), 64);
    }
}
