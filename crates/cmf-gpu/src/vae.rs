//! The neutral description of a FLUX-style VAE decoder (diffusers `AutoencoderKL.decoder`) that a
//! model crate hands to a device backend: geometry plus borrowed weights. cmf-gpu does not depend
//! on model crates; cmf-zimage fills this from its loaded `VaeDecoder` (`VaeDecoder::gpu_model`).
//!
//! Layout of the weights (as stored in the CMF file, read in place): a 3×3 conv kernel is a
//! [`Weight`] `[out, in·9]` with columns in PyTorch's `(in, ky, kx)` order, a 1×1 conv
//! `[out, in]`, an attention projection (`to_q`, `to_k`, `to_v`, `to_out.0`) `[out, in]`.
//! Biases and GroupNorm affine parameters are f32 slices.
//!
//! Decoder graph (the CPU reference is `cmf-zimage/src/vae.rs`): `conv_in` → mid resnet 0 →
//! mid attention (optional) → mid resnet 1 → up blocks (`layers_per_block + 1` resnets each, a
//! nearest-×2 upsample + 3×3 conv on all but the last) → GroupNorm → SiLU → `conv_out`.

use cmf_kernels::Weight;

/// Geometry of the decoder (the decoder half of diffusers' `vae/config.json`).
#[derive(Clone, Debug, PartialEq)]
pub struct VaeGeometry {
    pub latent_channels: usize,
    pub out_channels: usize,
    /// Encoder order, as in the config: `[128, 256, 512, 512]` for FLUX. The decoder walks it
    /// in reverse.
    pub block_out_channels: Vec<usize>,
    pub layers_per_block: usize,
    pub norm_groups: usize,
    /// GroupNorm eps (1e-6 in the FLUX decoder).
    pub eps: f32,
    pub mid_attention: bool,
}

impl VaeGeometry {
    /// Channels of the lowest-resolution stage (conv_in output, mid block).
    pub fn top_channels(&self) -> usize {
        *self.block_out_channels.last().unwrap_or(&0)
    }

    /// Pixels per latent cell along each axis (8 for four blocks).
    pub fn scale_factor(&self) -> usize {
        1 << self.block_out_channels.len().saturating_sub(1)
    }

    /// Up blocks as `(in channels of the first resnet, out channels, upsamples)`.
    pub fn up_blocks(&self) -> Vec<(usize, usize, bool)> {
        let rev: Vec<usize> = self.block_out_channels.iter().rev().copied().collect();
        let mut prev = self.top_channels();
        rev.iter()
            .enumerate()
            .map(|(i, &out)| {
                let b = (prev, out, i + 1 < rev.len());
                prev = out;
                b
            })
            .collect()
    }
}

/// GroupNorm affine parameters, one value per channel.
#[derive(Clone, Copy, Debug)]
pub struct GroupNormW<'a> {
    pub weight: &'a [f32],
    pub bias: &'a [f32],
}

/// A convolution (3×3 or 1×1, stride 1, "same" padding) or a Linear layer: weight `[out, cols]`
/// and a bias of `out` values (empty: no bias).
#[derive(Clone, Copy, Debug)]
pub struct ConvW<'a> {
    pub weight: Weight<'a>,
    pub bias: &'a [f32],
}

/// `ResnetBlock2D`: norm1 → SiLU → conv1 → norm2 → SiLU → conv2, plus the input (through the
/// 1×1 `conv_shortcut` when the channel count changes).
#[derive(Clone, Debug)]
pub struct ResnetW<'a> {
    pub norm1: GroupNormW<'a>,
    pub conv1: ConvW<'a>,
    pub norm2: GroupNormW<'a>,
    pub conv2: ConvW<'a>,
    pub shortcut: Option<ConvW<'a>>,
}

/// The mid-block attention: GroupNorm, one head over all pixels, output projection, residual.
#[derive(Clone, Debug)]
pub struct AttentionW<'a> {
    pub norm: GroupNormW<'a>,
    pub q: ConvW<'a>,
    pub k: ConvW<'a>,
    pub v: ConvW<'a>,
    pub out: ConvW<'a>,
}

#[derive(Clone, Debug)]
pub struct UpBlockW<'a> {
    pub resnets: Vec<ResnetW<'a>>,
    /// The 3×3 conv after the nearest ×2 upsample (all blocks but the last).
    pub upsampler: Option<ConvW<'a>>,
}

/// A whole decoder, weights borrowed from the model file.
#[derive(Clone, Debug)]
pub struct VaeModel<'a> {
    pub geometry: VaeGeometry,
    pub conv_in: ConvW<'a>,
    pub mid_resnets: [ResnetW<'a>; 2],
    pub mid_attention: Option<AttentionW<'a>>,
    pub up_blocks: Vec<UpBlockW<'a>>,
    pub norm_out: GroupNormW<'a>,
    pub conv_out: ConvW<'a>,
}

impl<'a> VaeModel<'a> {
    /// Checks that every tensor has the shape the geometry implies; the error names the part.
    pub fn check_shapes(&self) -> Result<(), String> {
        let g = &self.geometry;
        if g.block_out_channels.is_empty() || g.norm_groups == 0 || g.latent_channels == 0 {
            return Err(
                "geometry: empty block_out_channels, zero groups or zero latent channels".into(),
            );
        }
        let top = g.top_channels();
        let conv = |c: &ConvW, name: &str, cin: usize, cout: usize, k: usize| {
            let (r, cols) = (c.weight.rows, c.weight.cols);
            if (r, cols) != (cout, cin * k * k) {
                return Err(format!(
                    "{name}: weight [{r}, {cols}], expected [{cout}, {}]",
                    cin * k * k
                ));
            }
            if !c.bias.is_empty() && c.bias.len() != cout {
                return Err(format!(
                    "{name}: {} bias values, expected {cout}",
                    c.bias.len()
                ));
            }
            Ok(())
        };
        let gn = |n: &GroupNormW, name: &str, c: usize| {
            if n.weight.len() != c || n.bias.len() != c {
                return Err(format!(
                    "{name}: GroupNorm has {}/{} parameters, expected {c}",
                    n.weight.len(),
                    n.bias.len()
                ));
            }
            Ok(())
        };
        let resnet = |r: &ResnetW, name: &str, cin: usize, cout: usize| {
            gn(&r.norm1, &format!("{name}.norm1"), cin)?;
            conv(&r.conv1, &format!("{name}.conv1"), cin, cout, 3)?;
            gn(&r.norm2, &format!("{name}.norm2"), cout)?;
            conv(&r.conv2, &format!("{name}.conv2"), cout, cout, 3)?;
            match (&r.shortcut, cin == cout) {
                (None, true) => Ok(()),
                (Some(s), false) => conv(s, &format!("{name}.conv_shortcut"), cin, cout, 1),
                (None, false) => Err(format!(
                    "{name}: {cin} → {cout} channels needs a conv_shortcut"
                )),
                (Some(_), true) => {
                    Err(format!("{name}: unexpected conv_shortcut ({cin} → {cout})"))
                }
            }
        };
        conv(&self.conv_in, "conv_in", g.latent_channels, top, 3)?;
        for (i, r) in self.mid_resnets.iter().enumerate() {
            resnet(r, &format!("mid_block.resnets.{i}"), top, top)?;
        }
        match (&self.mid_attention, g.mid_attention) {
            (Some(a), true) => {
                let p = "mid_block.attentions.0";
                gn(&a.norm, &format!("{p}.group_norm"), top)?;
                conv(&a.q, &format!("{p}.to_q"), top, top, 1)?;
                conv(&a.k, &format!("{p}.to_k"), top, top, 1)?;
                conv(&a.v, &format!("{p}.to_v"), top, top, 1)?;
                conv(&a.out, &format!("{p}.to_out.0"), top, top, 1)?;
            }
            (None, false) => {}
            _ => return Err("mid_attention disagrees with the geometry".into()),
        }
        let blocks = g.up_blocks();
        if blocks.len() != self.up_blocks.len() {
            return Err(format!(
                "{} up blocks, the geometry has {}",
                self.up_blocks.len(),
                blocks.len()
            ));
        }
        for (i, (b, &(cin, cout, up))) in self.up_blocks.iter().zip(&blocks).enumerate() {
            if b.resnets.len() != g.layers_per_block + 1 {
                return Err(format!(
                    "up_blocks.{i}: {} resnets, expected {}",
                    b.resnets.len(),
                    g.layers_per_block + 1
                ));
            }
            for (j, r) in b.resnets.iter().enumerate() {
                let ci = if j == 0 { cin } else { cout };
                resnet(r, &format!("up_blocks.{i}.resnets.{j}"), ci, cout)?;
            }
            match (&b.upsampler, up) {
                (Some(u), true) => conv(
                    u,
                    &format!("up_blocks.{i}.upsamplers.0.conv"),
                    cout,
                    cout,
                    3,
                )?,
                (None, false) => {}
                _ => {
                    return Err(format!(
                        "up_blocks.{i}: upsampler present/absent against the geometry"
                    ))
                }
            }
        }
        let c0 = g.block_out_channels[0];
        gn(&self.norm_out, "conv_norm_out", c0)?;
        conv(&self.conv_out, "conv_out", c0, g.out_channels, 3)
    }

    /// Every weight matrix with its name (for codec checks and byte counts).
    pub fn weights(&self) -> Vec<(String, &ConvW<'a>)> {
        let mut v: Vec<(String, &ConvW<'a>)> = vec![("conv_in".into(), &self.conv_in)];
        for (i, r) in self.mid_resnets.iter().enumerate() {
            push_resnet(&mut v, r, format!("mid_block.resnets.{i}"));
        }
        if let Some(a) = &self.mid_attention {
            let p = "mid_block.attentions.0";
            v.push((format!("{p}.to_q"), &a.q));
            v.push((format!("{p}.to_k"), &a.k));
            v.push((format!("{p}.to_v"), &a.v));
            v.push((format!("{p}.to_out.0"), &a.out));
        }
        for (i, b) in self.up_blocks.iter().enumerate() {
            for (j, r) in b.resnets.iter().enumerate() {
                push_resnet(&mut v, r, format!("up_blocks.{i}.resnets.{j}"));
            }
            if let Some(u) = &b.upsampler {
                v.push((format!("up_blocks.{i}.upsamplers.0.conv"), u));
            }
        }
        v.push(("conv_out".into(), &self.conv_out));
        v
    }
}

fn push_resnet<'s, 'a>(v: &mut Vec<(String, &'s ConvW<'a>)>, r: &'s ResnetW<'a>, p: String) {
    v.push((format!("{p}.conv1"), &r.conv1));
    v.push((format!("{p}.conv2"), &r.conv2));
    if let Some(s) = &r.shortcut {
        v.push((format!("{p}.conv_shortcut"), s));
    }
}
