//! The FLUX `AutoencoderKL` decoder (diffusers 0.42.1 `models/autoencoders/vae.py::Decoder`,
//! `unets/unet_2d_blocks.py::{UNetMidBlock2D, UpDecoderBlock2D}`, `resnet.py::ResnetBlock2D`,
//! `upsampling.py::Upsample2D`, the mid-block `Attention` with `AttnProcessor2_0`).
//!
//! Activations are `[C, H, W]` f32 (torch's NCHW at batch 1). Convolutions, GroupNorm(+SiLU) and
//! the mid-block attention are cmf-kernels ops (a 3×3 conv is a banded im2col GEMM against the
//! stored kernel `[out, in·9]`, so the weights are read in place). Each resnet keeps at most three
//! feature maps alive (input, normalised input, conv output).
//!
//! Decoder: `conv_in` → mid (resnet, single-head attention over all pixels, resnet) → up blocks
//! (`layers_per_block + 1` resnets each, an upsampler on all but the last) → GroupNorm → SiLU →
//! `conv_out`. The pipeline feeds `z / scaling_factor + shift_factor` and maps the output with
//! `clamp(x / 2 + 0.5, 0, 1)`.

use crate::ops;
use crate::tensors::{Linear, Loader};
use crate::ZimageError;
use cmf_gpu::vae as gpu;
use cmf_kernels::Weight;
use rayon::prelude::*;

/// GroupNorm eps in the decoder (`resnet_eps=1e-6`, `conv_norm_out eps=1e-6`).
const GN_EPS: f32 = 1e-6;

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

impl GroupNorm {
    /// `gn(x)`, followed by SiLU when `silu`.
    fn forward(&self, x: &Tensor3, silu: bool) -> Tensor3 {
        let mut out = vec![0f32; x.data.len()];
        ops::group_norm(
            &x.data,
            x.c,
            x.h * x.w,
            self.groups,
            &self.weight,
            &self.bias,
            GN_EPS,
            silu,
            &mut out,
        );
        Tensor3 {
            c: x.c,
            h: x.h,
            w: x.w,
            data: out,
        }
    }
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

    /// `x` `[cin, h, w]` → `[cout, h, w]`.
    fn forward(&self, x: &Tensor3) -> Tensor3 {
        assert_eq!(x.c, self.cin);
        let mut out = vec![0f32; self.cout * x.h * x.w];
        let layer = cmf_kernels::Conv2d {
            weight: &self.w,
            k: self.k,
            bias: Some(&self.bias),
        };
        ops::conv2d(layer, &x.data, x.h, x.w, &mut out);
        Tensor3 {
            c: self.cout,
            h: x.h,
            w: x.w,
            data: out,
        }
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
        let h = self.conv1.forward(&self.norm1.forward(&x, true));
        let mut out = self.conv2.forward(&self.norm2.forward(&h, true));
        drop(h);
        let skip = match &self.shortcut {
            Some(sc) => sc.forward(&x),
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
        let normed = self.norm.forward(&x, false);
        // [C, HW] → [HW, C]
        let mut t = vec![0f32; hw * c];
        t.par_chunks_mut(c).enumerate().for_each(|(p, row)| {
            for (ch, v) in row.iter_mut().enumerate() {
                *v = normed.data[ch * hw + p];
            }
        });
        drop(normed);
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
        let mut x = self.conv_in.forward(&x);
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
                // `Upsample2D`: nearest ×2, then the 3×3 conv.
                let data = ops::upsample_nearest2x(&x.data, x.c, x.h, x.w);
                let big = Tensor3 {
                    c: x.c,
                    h: 2 * x.h,
                    w: 2 * x.w,
                    data,
                };
                drop(x);
                x = up.forward(&big);
            }
        }
        self.conv_out.forward(&self.norm_out.forward(&x, true))
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
        let img = self.decode(&self.decoder_input(latents), h, w);
        checked_rgb8(&img, "VAE decode")
    }

    /// What the decoder takes: `z / scaling_factor + shift_factor` (the pipeline's latents are
    /// in the DiT's scale).
    pub fn decoder_input(&self, latents: &[f32]) -> Vec<f32> {
        latents
            .iter()
            .map(|&v| v / self.cfg.scaling_factor + self.cfg.shift_factor)
            .collect()
    }
}

/// The neutral description the device backend takes (`cmf_gpu::cuda::vae::CudaVae::load`),
/// borrowing this decoder's weights. Conv kernels stay `[out, in·k·k]` in their stored codec.
impl VaeDecoder<'_> {
    pub fn gpu_model(&self) -> gpu::VaeModel<'_> {
        fn conv<'s>(c: &'s Conv2d<'_>) -> gpu::ConvW<'s> {
            gpu::ConvW {
                weight: c.w,
                bias: &c.bias,
            }
        }
        fn lin<'s>(l: &'s Linear<'_>) -> gpu::ConvW<'s> {
            gpu::ConvW {
                weight: l.w,
                bias: l.b.as_deref().unwrap_or(&[]),
            }
        }
        fn gn(g: &GroupNorm) -> gpu::GroupNormW<'_> {
            gpu::GroupNormW {
                weight: &g.weight,
                bias: &g.bias,
            }
        }
        fn resnet<'s>(r: &'s Resnet<'_>) -> gpu::ResnetW<'s> {
            gpu::ResnetW {
                norm1: gn(&r.norm1),
                conv1: conv(&r.conv1),
                norm2: gn(&r.norm2),
                conv2: conv(&r.conv2),
                shortcut: r.shortcut.as_ref().map(conv),
            }
        }
        let c = &self.cfg;
        gpu::VaeModel {
            geometry: gpu::VaeGeometry {
                latent_channels: c.latent_channels,
                out_channels: c.out_channels,
                block_out_channels: c.block_out_channels.clone(),
                layers_per_block: c.layers_per_block,
                norm_groups: c.norm_num_groups,
                eps: GN_EPS,
                mid_attention: self.mid_attention.is_some(),
            },
            conv_in: conv(&self.conv_in),
            mid_resnets: [resnet(&self.mid_resnets[0]), resnet(&self.mid_resnets[1])],
            mid_attention: self.mid_attention.as_ref().map(|a| gpu::AttentionW {
                norm: gn(&a.norm),
                q: lin(&a.q),
                k: lin(&a.k),
                v: lin(&a.v),
                out: lin(&a.out),
            }),
            up_blocks: self
                .up_blocks
                .iter()
                .map(|b| gpu::UpBlockW {
                    resnets: b.resnets.iter().map(resnet).collect(),
                    upsampler: b.upsampler.as_ref().map(conv),
                })
                .collect(),
            norm_out: gn(&self.norm_out),
            conv_out: conv(&self.conv_out),
        }
    }
}

/// [`to_rgb8`] of a decoded image, refusing NaN or infinity (named as `stage`).
pub fn checked_rgb8(img: &Tensor3, stage: &str) -> Result<Vec<u8>, ZimageError> {
    match convert_rgb8(img) {
        (rgb, true) => Ok(rgb),
        (_, false) => Err(ZimageError::NonFinite {
            stage: stage.into(),
            why: "NaN or infinity in the image".into(),
        }),
    }
}

/// `[3, H, W]` in [-1, 1] → interleaved RGB u8 (diffusers `VaeImageProcessor.postprocess` + `numpy_to_pil`).
/// Non-finite values give unspecified bytes; [`checked_rgb8`] refuses them.
pub fn to_rgb8(img: &Tensor3) -> Vec<u8> {
    convert_rgb8(img).0
}

/// One pass over the image, a row of pixels per task: the bytes and whether every value was
/// finite. `round(clamp(v / 2 + 0.5, 0, 1) · 255)` with ties to even, as numpy's `round`.
fn convert_rgb8(img: &Tensor3) -> (Vec<u8>, bool) {
    let (hw, c, w) = (img.h * img.w, img.c, img.w.max(1));
    let mut out = vec![0u8; hw * c];
    let finite = out
        .par_chunks_mut(w * c)
        .enumerate()
        .map(|(row, px)| {
            let mut finite = true;
            for ch in 0..c {
                let src = &img.data[ch * hw + row * w..][..px.len() / c];
                for (o, &v) in px[ch..].iter_mut().step_by(c).zip(src) {
                    finite &= v.is_finite();
                    *o = round_ties_even_u8((v / 2.0 + 0.5).clamp(0.0, 1.0) * 255.0);
                }
            }
            finite
        })
        .reduce(|| true, |a, b| a & b);
    (out, finite)
}

/// `x.round_ties_even() as u8` for x in [0, 255] (NaN: unspecified), without the libm call
/// `round_ties_even` becomes on baseline x86-64: adding 2²³ leaves no fraction bits, so the
/// addition itself rounds to the nearest integer, ties to even (IEEE's default mode).
#[inline]
fn round_ties_even_u8(x: f32) -> u8 {
    const SHIFT: f32 = 8_388_608.0; // 2²³
    ((x + SHIFT) - SHIFT) as u8
}

#[cfg(test)]
mod rgb8_tests {
    use super::*;

    #[test]
    fn rounding_matches_round_ties_even_on_every_float_in_range() {
        // Every f32 in [0, 255] (about 1.1e9 bit patterns; ~1 s in release).
        let top = 255f32.to_bits();
        let bad = (0..=top)
            .into_par_iter()
            .filter(|&b| {
                let x = f32::from_bits(b);
                round_ties_even_u8(x) != x.round_ties_even() as u8
            })
            .count();
        assert_eq!(bad, 0);
        assert_eq!(round_ties_even_u8(127.5), 128);
        assert_eq!(round_ties_even_u8(126.5), 126);
    }

    #[test]
    fn conversion_matches_the_per_value_formula_and_refuses_non_finite() {
        let (c, h, w) = (3, 5, 7);
        let n = c * h * w;
        // Below, inside and above [-1, 1], and the exact ties (v / 2 + 0.5) · 255 = k + ½.
        let data: Vec<f32> = (0..n)
            .map(|i| match i % 4 {
                0 => (i as f32 / n as f32) * 3.0 - 1.5,
                1 => ((i % 255) as f32 + 0.5) / 255.0 * 2.0 - 1.0,
                2 => -1.0 - i as f32,
                _ => 1.0 + i as f32 / 7.0,
            })
            .collect();
        let mut img = Tensor3 { c, h, w, data };
        let want: Vec<u8> = (0..h * w)
            .flat_map(|p| {
                let img = &img;
                (0..c).map(move |ch| {
                    let v = (img.data[ch * h * w + p] / 2.0 + 0.5).clamp(0.0, 1.0);
                    (v * 255.0).round_ties_even() as u8
                })
            })
            .collect();
        assert_eq!(to_rgb8(&img), want);
        assert_eq!(checked_rgb8(&img, "test").unwrap(), want);
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            img.data[2 * h * w + 11] = bad;
            assert!(matches!(
                checked_rgb8(&img, "test"),
                Err(ZimageError::NonFinite { .. })
            ));
        }
    }
}
