//! The FLUX `AutoencoderKL` decoder (diffusers 0.42.1 `models/autoencoders/vae.py::Decoder`,
//! `unets/unet_2d_blocks.py::{UNetMidBlock2D, UpDecoderBlock2D}`, `resnet.py::ResnetBlock2D`,
//! `upsampling.py::Upsample2D`, the mid-block `Attention` with `AttnProcessor2_0`).
//!
//! Activations are `[C, H, W]` f32 (torch's NCHW at batch 1). A 3×3 convolution is a GEMM over
//! column tiles (`im2col` of a band of output rows) against the stored kernel `[out, in·9]`, so the
//! weights are read in place in any matrix codec. The column gather applies, when asked, the
//! GroupNorm + SiLU that precede a conv in a resnet and the nearest ×2 upsample before the
//! upsampler's conv, so neither the normalised nor the upsampled tensor is ever materialised.
//!
//! Decoder: `conv_in` → mid (resnet, single-head attention over all pixels, resnet) → up blocks
//! (`layers_per_block + 1` resnets each, an upsampler on all but the last) → GroupNorm → SiLU →
//! `conv_out`. The pipeline feeds `z / scaling_factor + shift_factor` and maps the output with
//! `clamp(x / 2 + 0.5, 0, 1)`.

use crate::ops;
use crate::tensors::{Linear, Loader};
use crate::ZimageError;
use cmf_kernels::Weight;
use rayon::prelude::*;

/// GroupNorm eps in the decoder (`resnet_eps=1e-6`, `conv_norm_out eps=1e-6`).
const GN_EPS: f32 = 1e-6;
/// Target size of one im2col tile in f32 elements (~32 MB).
const TILE_ELEMS: usize = 8 << 20;

/// The decoder part of `vae.config_json` (diffusers `vae/config.json`).
#[derive(Clone, Debug, PartialEq)]
pub struct VaeConfig {
    pub latent_channels: usize,
    pub out_channels: usize,
    pub block_out_channels: Vec<usize>,
    pub layers_per_block: usize,
    pub norm_num_groups: usize,
    pub scaling_factor: f32,
    pub shift_factor: f32,
    pub mid_block_add_attention: bool,
}

impl VaeConfig {
    pub fn from_json(v: &serde_json::Value, origin: &str) -> Result<VaeConfig, ZimageError> {
        let bad = |field: &str, why: &str| ZimageError::Config {
            origin: origin.to_string(),
            blob: "vae.config_json".into(),
            field: field.into(),
            why: why.into(),
        };
        let u = |k: &str, d: usize| match v.get(k) {
            None | Some(serde_json::Value::Null) => Ok(d),
            Some(x) => x
                .as_u64()
                .map(|x| x as usize)
                .ok_or_else(|| bad(k, "expected an unsigned integer")),
        };
        let f = |k: &str, d: f64| match v.get(k) {
            None | Some(serde_json::Value::Null) => Ok(d),
            Some(x) => x.as_f64().ok_or_else(|| bad(k, "expected a number")),
        };
        let blocks: Vec<usize> = match v.get("block_out_channels") {
            None => vec![128, 256, 512, 512],
            Some(x) => x
                .as_array()
                .and_then(|a| a.iter().map(|e| e.as_u64().map(|e| e as usize)).collect())
                .ok_or_else(|| bad("block_out_channels", "expected a list of integers"))?,
        };
        if blocks.is_empty() || blocks.contains(&0) {
            return Err(bad(
                "block_out_channels",
                "must be a non-empty list of positive channel counts",
            ));
        }
        if let Some(types) = v.get("up_block_types").and_then(|x| x.as_array()) {
            if types.len() != blocks.len()
                || types.iter().any(|t| t.as_str() != Some("UpDecoderBlock2D"))
            {
                return Err(bad(
                    "up_block_types",
                    "only UpDecoderBlock2D blocks, one per block_out_channels entry",
                ));
            }
        }
        if v.get("use_post_quant_conv").and_then(|x| x.as_bool()) == Some(true) {
            return Err(bad(
                "use_post_quant_conv",
                "a post-quant conv is not part of the FLUX VAE; not supported",
            ));
        }
        if v.get("norm_type")
            .and_then(|x| x.as_str())
            .is_some_and(|t| t != "group")
        {
            return Err(bad("norm_type", "only GroupNorm decoders are supported"));
        }
        let cfg = VaeConfig {
            latent_channels: u("latent_channels", 16)?,
            out_channels: u("out_channels", 3)?,
            layers_per_block: u("layers_per_block", 2)?,
            norm_num_groups: u("norm_num_groups", 32)?,
            scaling_factor: f("scaling_factor", 0.3611)? as f32,
            shift_factor: f("shift_factor", 0.1159)? as f32,
            mid_block_add_attention: v
                .get("mid_block_add_attention")
                .and_then(|x| x.as_bool())
                .unwrap_or(true),
            block_out_channels: blocks,
        };
        if cfg.norm_num_groups == 0
            || cfg
                .block_out_channels
                .iter()
                .any(|c| c % cfg.norm_num_groups != 0)
        {
            return Err(bad(
                "norm_num_groups",
                "must divide every block's channel count",
            ));
        }
        Ok(cfg)
    }

    /// Pixels per latent cell along each axis (8 for four blocks).
    pub fn scale_factor(&self) -> usize {
        1 << (self.block_out_channels.len() - 1)
    }
}

/// A feature map `[c, h, w]`.
pub struct Tensor3 {
    pub c: usize,
    pub h: usize,
    pub w: usize,
    pub data: Vec<f32>,
}

struct GroupNorm {
    weight: Vec<f32>,
    bias: Vec<f32>,
    groups: usize,
}

/// Per-channel affine `(a, b)` that GroupNorm reduces to once the group statistics are known:
/// `gn(x)[c] = a[c]·x + b[c]`.
fn group_norm_affine(x: &Tensor3, gn: &GroupNorm) -> Vec<(f32, f32)> {
    let cpg = x.c / gn.groups;
    let hw = x.h * x.w;
    let stats: Vec<(f32, f32)> = (0..gn.groups)
        .into_par_iter()
        .map(|g| {
            let s = &x.data[g * cpg * hw..(g + 1) * cpg * hw];
            let n = s.len() as f64;
            let mean = s.iter().map(|&v| v as f64).sum::<f64>() / n;
            let var = s.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
            (mean as f32, 1.0 / (var as f32 + GN_EPS).sqrt())
        })
        .collect();
    (0..x.c)
        .map(|c| {
            let (mean, rstd) = stats[c / cpg];
            let a = rstd * gn.weight[c];
            (a, gn.bias[c] - mean * a)
        })
        .collect()
}

/// What the column gather applies to the conv input on the fly.
#[derive(Clone, Copy)]
enum Prologue<'p> {
    None,
    /// GroupNorm (as per-channel affine) then SiLU.
    NormSilu(&'p [(f32, f32)]),
    /// Nearest-neighbour ×2 upsample.
    Upsample2x,
}

/// A 2-D convolution, stride 1, "same" padding, kernel `k` ∈ {1, 3}, with bias.
struct Conv2d<'a> {
    w: Weight<'a>,
    bias: Vec<f32>,
    cin: usize,
    cout: usize,
    k: usize,
}

impl<'a> Conv2d<'a> {
    fn load(
        ld: &Loader<'a>,
        name: &str,
        cin: usize,
        cout: usize,
        k: usize,
    ) -> Result<Self, ZimageError> {
        let shape = ld.shape(&format!("{name}.weight"))?;
        let want = [cout, cin, k, k];
        if shape != want && !(k == 1 && shape == [cout, cin]) {
            return Err(ZimageError::Tensor {
                origin: ld.origin(),
                name: format!("{name}.weight"),
                why: format!("shape {shape:?}, expected {want:?}"),
            });
        }
        Ok(Conv2d {
            w: ld.weight(&format!("{name}.weight"), cout, cin * k * k)?,
            bias: ld.vec_f32(&format!("{name}.bias"), cout)?,
            cin,
            cout,
            k,
        })
    }

    /// `x` `[cin, h, w]` (or `[cin, h/2, w/2]` under `Upsample2x`) → `[cout, h, w]`.
    fn forward(&self, x: &Tensor3, pro: Prologue) -> Tensor3 {
        assert_eq!(x.c, self.cin);
        let (h, w) = match pro {
            Prologue::Upsample2x => (2 * x.h, 2 * x.w),
            _ => (x.h, x.w),
        };
        let kk = self.k * self.k;
        let cols = self.cin * kk;
        let band = (TILE_ELEMS / (w * cols)).clamp(1, h);
        let mut out = vec![0f32; self.cout * h * w];
        let mut col = vec![0f32; band * w * cols];
        let mut y = vec![0f32; band * w * self.cout];
        for y0 in (0..h).step_by(band) {
            let rows = band.min(h - y0);
            let npix = rows * w;
            self.gather(x, pro, h, w, y0, rows, &mut col[..npix * cols]);
            ops::matmul(
                &self.w,
                &col[..npix * cols],
                npix,
                &mut y[..npix * self.cout],
            );
            // [npix, cout] → out[cout][y0.., :] + bias
            let yb = &y[..npix * self.cout];
            out.par_chunks_mut(h * w)
                .enumerate()
                .for_each(|(o, plane)| {
                    let b = self.bias[o];
                    for (p, v) in plane[y0 * w..y0 * w + npix].iter_mut().enumerate() {
                        *v = yb[p * self.cout + o] + b;
                    }
                });
        }
        Tensor3 {
            c: self.cout,
            h,
            w,
            data: out,
        }
    }

    /// im2col for output rows `y0 .. y0+rows`: `col[pix][i·k² + ky·k + kx]` (the stored kernel's order).
    #[allow(clippy::too_many_arguments)]
    fn gather(
        &self,
        x: &Tensor3,
        pro: Prologue,
        h: usize,
        w: usize,
        y0: usize,
        rows: usize,
        col: &mut [f32],
    ) {
        let (k, cin) = (self.k, self.cin);
        let pad = (k / 2) as isize;
        let kk = k * k;
        col.par_chunks_mut(w * cin * kk)
            .enumerate()
            .take(rows)
            .for_each(|(r, crow)| {
                let yy = (y0 + r) as isize;
                for i in 0..cin {
                    let (a, b) = match pro {
                        Prologue::NormSilu(ab) => ab[i],
                        _ => (1.0, 0.0),
                    };
                    let plane = &x.data[i * x.h * x.w..(i + 1) * x.h * x.w];
                    for ky in 0..k {
                        let sy = yy + ky as isize - pad;
                        for kx in 0..k {
                            let slot = i * kk + ky * k + kx;
                            for xx in 0..w {
                                let sx = xx as isize + kx as isize - pad;
                                let v = if sy < 0 || sy >= h as isize || sx < 0 || sx >= w as isize
                                {
                                    0.0
                                } else {
                                    let (sy, sx) = (sy as usize, sx as usize);
                                    match pro {
                                        Prologue::None => plane[sy * x.w + sx],
                                        Prologue::NormSilu(_) => {
                                            ops::silu(a * plane[sy * x.w + sx] + b)
                                        }
                                        Prologue::Upsample2x => plane[(sy / 2) * x.w + sx / 2],
                                    }
                                };
                                crow[xx * cin * kk + slot] = v;
                            }
                        }
                    }
                }
            });
    }
}

/// `ResnetBlock2D` (pre-norm, SiLU, no time embedding, output scale 1).
struct Resnet<'a> {
    norm1: GroupNorm,
    conv1: Conv2d<'a>,
    norm2: GroupNorm,
    conv2: Conv2d<'a>,
    shortcut: Option<Conv2d<'a>>,
}

impl<'a> Resnet<'a> {
    fn load(
        ld: &Loader<'a>,
        p: &str,
        cin: usize,
        cout: usize,
        groups: usize,
    ) -> Result<Self, ZimageError> {
        Ok(Resnet {
            norm1: load_gn(ld, &format!("{p}.norm1"), cin, groups)?,
            conv1: Conv2d::load(ld, &format!("{p}.conv1"), cin, cout, 3)?,
            norm2: load_gn(ld, &format!("{p}.norm2"), cout, groups)?,
            conv2: Conv2d::load(ld, &format!("{p}.conv2"), cout, cout, 3)?,
            shortcut: if cin != cout {
                Some(Conv2d::load(
                    ld,
                    &format!("{p}.conv_shortcut"),
                    cin,
                    cout,
                    1,
                )?)
            } else {
                None
            },
        })
    }

    fn forward(&self, x: Tensor3) -> Tensor3 {
        let ab1 = group_norm_affine(&x, &self.norm1);
        let h = self.conv1.forward(&x, Prologue::NormSilu(&ab1));
        let ab2 = group_norm_affine(&h, &self.norm2);
        let mut out = self.conv2.forward(&h, Prologue::NormSilu(&ab2));
        drop(h);
        let skip = match &self.shortcut {
            Some(sc) => sc.forward(&x, Prologue::None),
            None => x,
        };
        out.data
            .par_chunks_mut(1 << 14)
            .zip(skip.data.par_chunks(1 << 14))
            .for_each(|(o, s)| {
                o.iter_mut().zip(s).for_each(|(ov, &sv)| *ov += sv);
            });
        out
    }
}

fn load_gn(ld: &Loader, name: &str, c: usize, groups: usize) -> Result<GroupNorm, ZimageError> {
    Ok(GroupNorm {
        weight: ld.vec_f32(&format!("{name}.weight"), c)?,
        bias: ld.vec_f32(&format!("{name}.bias"), c)?,
        groups,
    })
}

/// The mid-block attention: one head over all pixels, GroupNorm first, residual added.
struct MidAttention<'a> {
    norm: GroupNorm,
    q: Linear<'a>,
    k: Linear<'a>,
    v: Linear<'a>,
    out: Linear<'a>,
}

impl MidAttention<'_> {
    fn forward(&self, mut x: Tensor3) -> Tensor3 {
        let (c, hw) = (x.c, x.h * x.w);
        let ab = group_norm_affine(&x, &self.norm);
        // [C, HW] → normalised [HW, C]
        let mut t = vec![0f32; hw * c];
        t.par_chunks_mut(c).enumerate().for_each(|(p, row)| {
            for (ch, v) in row.iter_mut().enumerate() {
                let (a, b) = ab[ch];
                *v = a * x.data[ch * hw + p] + b;
            }
        });
        let q = self.q.forward(&t, hw);
        let k = self.k.forward(&t, hw);
        let v = self.v.forward(&t, hw);
        ops::attention(&q, &k, &v, hw, 1, c, &mut t);
        drop((q, k, v));
        let o = self.out.forward(&t, hw);
        x.data
            .par_chunks_mut(hw)
            .enumerate()
            .for_each(|(ch, plane)| {
                for (p, v) in plane.iter_mut().enumerate() {
                    *v += o[p * c + ch];
                }
            });
        x
    }
}

struct UpBlock<'a> {
    resnets: Vec<Resnet<'a>>,
    upsampler: Option<Conv2d<'a>>,
}

/// The loaded decoder; weights are borrowed from the file.
pub struct VaeDecoder<'a> {
    pub cfg: VaeConfig,
    conv_in: Conv2d<'a>,
    mid_resnets: [Resnet<'a>; 2],
    mid_attention: Option<MidAttention<'a>>,
    up_blocks: Vec<UpBlock<'a>>,
    norm_out: GroupNorm,
    conv_out: Conv2d<'a>,
}

impl<'a> VaeDecoder<'a> {
    /// Loads `decoder.*` under the loader's prefix (`vae.` in a pack).
    pub fn load(ld: &Loader<'a>, cfg: VaeConfig) -> Result<VaeDecoder<'a>, ZimageError> {
        let g = cfg.norm_num_groups;
        let top = *cfg.block_out_channels.last().unwrap();
        let mid = "decoder.mid_block";
        let mid_attention = if cfg.mid_block_add_attention {
            let p = format!("{mid}.attentions.0");
            Some(MidAttention {
                norm: load_gn(ld, &format!("{p}.group_norm"), top, g)?,
                q: ld.linear(&format!("{p}.to_q"), top, top, true)?,
                k: ld.linear(&format!("{p}.to_k"), top, top, true)?,
                v: ld.linear(&format!("{p}.to_v"), top, top, true)?,
                out: ld.linear(&format!("{p}.to_out.0"), top, top, true)?,
            })
        } else {
            None
        };
        let rev: Vec<usize> = cfg.block_out_channels.iter().rev().copied().collect();
        let mut prev = rev[0];
        let mut up_blocks = Vec::new();
        for (i, &out) in rev.iter().enumerate() {
            let resnets = (0..cfg.layers_per_block + 1)
                .map(|j| {
                    let cin = if j == 0 { prev } else { out };
                    Resnet::load(
                        ld,
                        &format!("decoder.up_blocks.{i}.resnets.{j}"),
                        cin,
                        out,
                        g,
                    )
                })
                .collect::<Result<Vec<_>, _>>()?;
            let upsampler = if i + 1 < rev.len() {
                Some(Conv2d::load(
                    ld,
                    &format!("decoder.up_blocks.{i}.upsamplers.0.conv"),
                    out,
                    out,
                    3,
                )?)
            } else {
                None
            };
            up_blocks.push(UpBlock { resnets, upsampler });
            prev = out;
        }
        Ok(VaeDecoder {
            conv_in: Conv2d::load(ld, "decoder.conv_in", cfg.latent_channels, top, 3)?,
            mid_resnets: [
                Resnet::load(ld, &format!("{mid}.resnets.0"), top, top, g)?,
                Resnet::load(ld, &format!("{mid}.resnets.1"), top, top, g)?,
            ],
            mid_attention,
            up_blocks,
            norm_out: load_gn(ld, "decoder.conv_norm_out", cfg.block_out_channels[0], g)?,
            conv_out: Conv2d::load(
                ld,
                "decoder.conv_out",
                cfg.block_out_channels[0],
                cfg.out_channels,
                3,
            )?,
            cfg,
        })
    }

    /// `Decoder.forward` on the decoder input `z` `[latent_channels, h, w]` (already unscaled);
    /// returns `[out_channels, 8h, 8w]` before the [-1, 1] → [0, 1] mapping.
    pub fn decode(&self, z: &[f32], h: usize, w: usize) -> Tensor3 {
        assert_eq!(z.len(), self.cfg.latent_channels * h * w);
        let x = Tensor3 {
            c: self.cfg.latent_channels,
            h,
            w,
            data: z.to_vec(),
        };
        let mut x = self.conv_in.forward(&x, Prologue::None);
        x = self.mid_resnets[0].forward(x);
        if let Some(a) = &self.mid_attention {
            x = a.forward(x);
        }
        x = self.mid_resnets[1].forward(x);
        for b in &self.up_blocks {
            for r in &b.resnets {
                x = r.forward(x);
            }
            if let Some(up) = &b.upsampler {
                x = up.forward(&x, Prologue::Upsample2x);
            }
        }
        let ab = group_norm_affine(&x, &self.norm_out);
        self.conv_out.forward(&x, Prologue::NormSilu(&ab))
    }

    /// The pipeline's decode: latents `[C, h, w]` from the sampler → RGB u8 `[8h, 8w, 3]`
    /// (`z / scaling_factor + shift_factor`, decode, `clamp(x/2 + 0.5, 0, 1)`, `round(x·255)`
    /// half to even as numpy).
    pub fn decode_to_rgb(
        &self,
        latents: &[f32],
        h: usize,
        w: usize,
    ) -> Result<Vec<u8>, ZimageError> {
        let z: Vec<f32> = latents
            .iter()
            .map(|&v| v / self.cfg.scaling_factor + self.cfg.shift_factor)
            .collect();
        let img = self.decode(&z, h, w);
        if img.data.iter().any(|v| !v.is_finite()) {
            return Err(ZimageError::NonFinite {
                stage: "VAE decode".into(),
                why: "NaN or infinity in the image".into(),
            });
        }
        Ok(to_rgb8(&img))
    }
}

/// `[3, H, W]` in [-1, 1] → interleaved RGB u8 (diffusers `VaeImageProcessor.postprocess` + `numpy_to_pil`).
pub fn to_rgb8(img: &Tensor3) -> Vec<u8> {
    let hw = img.h * img.w;
    let mut out = vec![0u8; hw * img.c];
    for p in 0..hw {
        for ch in 0..img.c {
            let v = (img.data[ch * hw + p] / 2.0 + 0.5).clamp(0.0, 1.0);
            out[p * img.c + ch] = (v * 255.0).round_ties_even() as u8;
        }
    }
    out
}
