//! Host-side planning of one device decode: which geometries the kernels take, the buffer sizes
//! for a latent of `h × w`, the im2col and attention tilings, and the launch shapes of the
//! per-channel row kernels. Pure arithmetic, tested without a GPU.
//!
//! Buffers of a decode (`P` = pixels of a stage, `C` its channels; activations are NHWC `[P, C]`):
//! - three f32 activation buffers of `act_f32` values (stage input, conv1 output, block output;
//!   they rotate from resnet to resnet);
//! - one bf16 buffer of `act_bf16` values (GroupNorm(+SiLU) output, the next conv's operand);
//! - `scratch`: an im2col tile `[pixels, 9·C]` bf16 for a conv, or a score tile (`S` f32
//!   `[tq, N]`, then `softmax(S)` bf16 `[tq, N]`) for the mid attention; never both at once;
//! - attention: the projection output f32 `[N, C]`, `Q`, `K`, `Vᵀ` bf16 `[N, C]`;
//! - GroupNorm partial (mean, M2) pairs, per-group mean and 1/σ; the latent (f32 NCHW) and the
//!   image (f32 NCHW `[out_channels, H, W]`, or 8-bit RGB `[H, W, out_channels]` and a flag).

use crate::vae::VaeGeometry;

/// Most blocks of the GroupNorm statistics pass (its partial buffer holds a (mean, M2) pair per
/// block and group: `2 × GN_CHUNKS × groups`).
pub const GN_CHUNKS: usize = 1024;
/// Pixels each thread of an element-wise row kernel handles.
pub const PIX_PER_THREAD: usize = 8;
/// Default scratch budget: im2col tiles (1024² output, 256 channels: 19 tiles of ~58k pixels)
/// and attention score tiles (N = 16384: 6 tiles of 2730 query rows).
pub const DEFAULT_SCRATCH_BYTES: usize = 256 << 20;
/// The kernels index an im2col tile with 32-bit integers: keep a tile well under 2³¹ values.
const MAX_SCRATCH_BYTES: usize = 2 << 30;
/// Alignment of the sub-buffers carved out of one allocation.
const ALIGN: usize = 256;

/// Tunables of the device decoder.
#[derive(Clone, Debug, PartialEq)]
pub struct VaeOptions {
    /// Scratch budget for one im2col tile or one attention score tile (at least one pixel or
    /// one query row is always processed, whatever the budget).
    pub scratch_bytes: usize,
    /// 3×3 convs through cuDNN's implicit GEMM where libcudnn loads (cuda/cudnn.rs), else
    /// im2col + cuBLAS (also what runs where libcudnn is missing). Default on: at 1024² cuDNN
    /// decodes 15 ms faster on the H200 (BENCH.md).
    pub cudnn: bool,
}

impl Default for VaeOptions {
    fn default() -> Self {
        VaeOptions {
            scratch_bytes: DEFAULT_SCRATCH_BYTES,
            cudnn: true,
        }
    }
}

/// A 3×3 conv of the decoder, at its output resolution: (height, width, C_in, C_out, whether its
/// input is the nearest ×2 upsampling of a `height/2 × width/2` map).
pub type Conv3Shape = (usize, usize, usize, usize, bool);

/// Every 3×3 conv shape of a decode of an `h × w` latent (conv_out, a direct conv, aside),
/// repeats included.
pub fn conv3_shapes(g: &VaeGeometry, h: usize, w: usize) -> Vec<Conv3Shape> {
    let top = g.top_channels();
    let mut v = vec![(h, w, g.latent_channels, top, false)];
    v.extend([(h, w, top, top, false); 4]);
    let (mut hh, mut ww) = (h, w);
    for (cin, cout, up) in g.up_blocks() {
        v.push((hh, ww, cin, cout, false));
        v.extend(std::iter::repeat_n(
            (hh, ww, cout, cout, false),
            2 * g.layers_per_block + 1,
        ));
        if up {
            hh *= 2;
            ww *= 2;
            v.push((hh, ww, cout, cout, true));
        }
    }
    v
}

/// Whether the kernels implement this geometry; the error names what does not fit.
pub fn check_geometry(g: &VaeGeometry) -> Result<(), String> {
    let mut chans = g.block_out_channels.clone();
    chans.push(g.latent_channels);
    for &c in &chans {
        // 8 channels per 16-byte vector in im2col; row kernels run C·k ≤ 1024 threads a block.
        if c == 0 || c % 8 != 0 || c > 1024 {
            return Err(format!(
                "{c} channels (the device decoder needs a multiple of 8, at most 1024)"
            ));
        }
    }
    for &c in &g.block_out_channels {
        if g.norm_groups == 0 || c % g.norm_groups != 0 {
            return Err(format!(
                "{c} channels in {} GroupNorm groups",
                g.norm_groups
            ));
        }
    }
    if g.out_channels == 0 || g.out_channels > 4 {
        return Err(format!(
            "{} output channels (the device conv_out takes 1 to 4)",
            g.out_channels
        ));
    }
    if !(g.eps.is_finite() && g.eps >= 0.0) {
        return Err(format!("GroupNorm eps {}", g.eps));
    }
    Ok(())
}

/// The scratch budget the tilings use (the option, kept within what 32-bit indices allow).
pub fn scratch_budget(opts: &VaeOptions) -> usize {
    opts.scratch_bytes.clamp(1, MAX_SCRATCH_BYTES)
}

/// Pixels per im2col tile for a conv over `pixels` pixels with `k_cols = 9·C` columns.
pub fn conv_tile(pixels: usize, k_cols: usize, scratch: usize) -> usize {
    (scratch / (2 * k_cols).max(1)).clamp(1, pixels.max(1))
}

fn align(x: usize) -> usize {
    x.div_ceil(ALIGN) * ALIGN
}

/// The mid attention's tiling: `n` tokens (latent pixels) of `c` channels, `tq` query rows
/// per score tile; the softmax tile starts `p_offset` bytes into scratch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnPlan {
    pub n: usize,
    pub c: usize,
    pub tq: usize,
    pub p_offset: usize,
}

impl AttnPlan {
    pub fn new(n: usize, c: usize, scratch: usize) -> AttnPlan {
        let tq = (scratch / (6 * n).max(1)).clamp(1, n.max(1));
        AttnPlan {
            n,
            c,
            tq,
            p_offset: align(4 * tq * n),
        }
    }

    /// Scratch bytes one score tile takes (S f32, then P bf16).
    pub fn scratch_bytes(&self) -> usize {
        self.p_offset + 2 * self.tq * self.n
    }
}

/// Sizes of every buffer of a decode of an `h × w` latent.
#[derive(Clone, Debug, PartialEq)]
pub struct VaePlan {
    pub h: usize,
    pub w: usize,
    /// Output image size.
    pub out_h: usize,
    pub out_w: usize,
    /// Values in each of the three f32 activation buffers.
    pub act_f32: usize,
    /// Values in the bf16 activation buffer.
    pub act_bf16: usize,
    pub scratch_bytes: usize,
    /// f32 values of the GroupNorm partial buffer ((mean, M2) per block and group).
    pub gn_partial: usize,
    pub groups: usize,
    /// f32 values of the latent and of the image.
    pub latent: usize,
    pub image: usize,
    pub attn: Option<AttnPlan>,
}

impl VaePlan {
    pub fn new(g: &VaeGeometry, h: usize, w: usize, opts: &VaeOptions) -> Result<VaePlan, String> {
        check_geometry(g)?;
        if h == 0 || w == 0 {
            return Err(format!("latent {h}×{w}"));
        }
        let s = g.scale_factor();
        let (out_h, out_w) = (h * s, w * s);
        // Pixel indices are 32-bit in the kernels.
        if out_h
            .checked_mul(out_w)
            .is_none_or(|p| p > i32::MAX as usize)
        {
            return Err(format!("image {out_h}×{out_w} is too large"));
        }
        let budget = scratch_budget(opts);
        let top = g.top_channels();
        let p0 = h * w;
        let mut act = p0 * top;
        let mut scratch = 0usize;
        let mut conv = |p: usize, cin: usize| {
            let k = 9 * cin;
            scratch = scratch.max(2 * k * conv_tile(p, k, budget));
        };
        conv(p0, g.latent_channels);
        conv(p0, top);
        let mut p = p0;
        for (cin, cout, up) in g.up_blocks() {
            act = act.max(p * cin.max(cout));
            conv(p, cin);
            conv(p, cout);
            if up {
                p *= 4;
                act = act.max(p * cout);
                conv(p, cout);
            }
        }
        let attn = g.mid_attention.then(|| AttnPlan::new(p0, top, budget));
        if let Some(a) = &attn {
            scratch = scratch.max(a.scratch_bytes());
        }
        Ok(VaePlan {
            h,
            w,
            out_h,
            out_w,
            act_f32: act,
            act_bf16: act.max(p0 * g.latent_channels),
            scratch_bytes: scratch,
            gn_partial: 2 * GN_CHUNKS * g.norm_groups,
            groups: g.norm_groups,
            latent: p0 * g.latent_channels,
            image: g.out_channels * out_h * out_w,
            attn,
        })
    }

    /// Bytes of the attention buffers (projection f32 + Q, K, Vᵀ bf16).
    pub fn attn_bytes(&self) -> usize {
        self.attn.map_or(0, |a| 4 * a.n * a.c + 3 * 2 * a.n * a.c)
    }

    /// Device bytes the workspace takes (every allocation, each rounded up to `ALIGN`).
    pub fn device_bytes(&self) -> u64 {
        let a = [
            4 * self.act_f32,
            4 * self.act_f32,
            4 * self.act_f32,
            2 * self.act_bf16,
            self.scratch_bytes,
            4 * self.gn_partial,
            8 * self.groups,
            4 * self.latent,
            4 * self.image,
            self.attn_bytes(),
        ];
        a.iter().map(|&b| align(b.max(1)) as u64).sum()
    }

    /// Whether a workspace allocated for `self` can run `other` (every buffer large enough).
    pub fn covers(&self, other: &VaePlan) -> bool {
        self.act_f32 >= other.act_f32
            && self.act_bf16 >= other.act_bf16
            && self.scratch_bytes >= other.scratch_bytes
            && self.gn_partial >= other.gn_partial
            && self.latent >= other.latent
            && self.image >= other.image
            && self.attn_bytes() >= other.attn_bytes()
            && self.attn.is_some() == other.attn.is_some()
    }
}

/// Launch shape of a per-channel row kernel over `[pixels, c]` (`vae_gn_*`, `vae_bias_*`):
/// blocks of `c·kpp` threads, thread `t` on channel `t % c` and pixel lane `t / c`; block `b`
/// covers pixels `[b·ppb, (b+1)·ppb)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowLayout {
    pub threads: u32,
    pub kpp: usize,
    pub ppb: usize,
    pub blocks: u32,
}

fn row_layout(c: usize, pixels: usize, ppb_min: usize) -> RowLayout {
    let kpp = (256 / c).max(1);
    let ppb = ppb_min.max(1).div_ceil(kpp) * kpp;
    RowLayout {
        threads: (c * kpp) as u32,
        kpp,
        ppb,
        blocks: pixels.div_ceil(ppb).max(1) as u32,
    }
}

/// The GroupNorm statistics pass: at most [`GN_CHUNKS`] blocks.
pub fn stats_layout(c: usize, pixels: usize) -> RowLayout {
    row_layout(c, pixels, pixels.div_ceil(GN_CHUNKS))
}

/// Element-wise row kernels: [`PIX_PER_THREAD`] pixels per thread.
pub fn elementwise_layout(c: usize, pixels: usize) -> RowLayout {
    row_layout(c, pixels, (256 / c).max(1) * PIX_PER_THREAD)
}

/// A 1-D grid for a grid-stride kernel over `n` items, `per_block` items per block.
pub use crate::cuda::runtime::device::grid1;

#[cfg(test)]
mod tests {
    use super::*;

    fn flux() -> VaeGeometry {
        VaeGeometry {
            latent_channels: 16,
            out_channels: 3,
            block_out_channels: vec![128, 256, 512, 512],
            layers_per_block: 2,
            norm_groups: 32,
            eps: 1e-6,
            mid_attention: true,
        }
    }

    #[test]
    fn flux_1024_plan() {
        let p = VaePlan::new(&flux(), 128, 128, &VaeOptions::default()).unwrap();
        assert_eq!((p.out_h, p.out_w), (1024, 1024));
        // Largest stage: the 256-channel map at 1024² (upsampler of block 2, resnet 0 of block 3).
        assert_eq!(p.act_f32, 1024 * 1024 * 256);
        assert_eq!(p.image, 3 * 1024 * 1024);
        let a = p.attn.unwrap();
        assert_eq!((a.n, a.c), (16384, 512));
        assert!(a.tq >= 1 && a.scratch_bytes() <= DEFAULT_SCRATCH_BYTES);
        assert!(p.scratch_bytes <= DEFAULT_SCRATCH_BYTES);
        // ~4.1 GB: three 1 GiB f32 maps, a 512 MiB bf16 map, 256 MiB scratch, the rest small.
        let gb = p.device_bytes() as f64 / 1e9;
        assert!((3.9..4.6).contains(&gb), "{gb}");
    }

    #[test]
    fn conv_tiles_cover_every_pixel_within_budget() {
        for &(pixels, c, budget) in &[
            (1usize << 20, 256usize, DEFAULT_SCRATCH_BYTES),
            (1000, 64, 4096),
            (7, 8, 1),
            (5, 16, 1 << 30),
        ] {
            let k = 9 * c;
            let t = conv_tile(pixels, k, budget);
            assert!(t >= 1 && t <= pixels);
            assert!(t == 1 || 2 * k * t <= budget, "{pixels} {c} {budget}");
            let tiles: Vec<(usize, usize)> = (0..pixels)
                .step_by(t)
                .map(|p0| (p0, t.min(pixels - p0)))
                .collect();
            assert_eq!(tiles.iter().map(|x| x.1).sum::<usize>(), pixels);
            // The kernels index a tile's 8-channel vectors with 32-bit ints.
            assert!(t * c / 8 < i32::MAX as usize);
        }
    }

    #[test]
    fn row_layouts_cover_pixels() {
        for &c in &[8usize, 32, 48, 128, 256, 512, 1000, 1024] {
            for &p in &[1usize, 7, 80, 4096, 1 << 20] {
                for l in [stats_layout(c, p), elementwise_layout(c, p)] {
                    assert!(l.threads as usize <= 1024 && l.threads as usize % c == 0);
                    assert_eq!(l.threads as usize / c, l.kpp);
                    assert_eq!(l.ppb % l.kpp, 0);
                    assert!(l.blocks as usize * l.ppb >= p);
                    assert!((l.blocks as usize - 1) * l.ppb < p);
                }
                assert!(stats_layout(c, p).blocks as usize <= GN_CHUNKS);
            }
        }
    }

    #[test]
    fn attention_tiles_fit_scratch() {
        for &(n, budget) in &[(16384usize, DEFAULT_SCRATCH_BYTES), (80, 1000), (80, 1)] {
            let a = AttnPlan::new(n, 64, budget);
            assert!(a.tq >= 1 && a.tq <= n);
            assert!(a.tq == 1 || a.scratch_bytes() <= budget + ALIGN);
            assert!(a.p_offset >= 4 * a.tq * n && a.p_offset % ALIGN == 0);
        }
    }

    #[test]
    fn refuses_what_the_kernels_do_not_do() {
        let mut g = flux();
        g.latent_channels = 4;
        assert!(check_geometry(&g).unwrap_err().contains("4 channels"));
        let mut g = flux();
        g.out_channels = 5;
        assert!(check_geometry(&g).is_err());
        let mut g = flux();
        g.norm_groups = 48;
        assert!(check_geometry(&g).is_err());
        assert!(VaePlan::new(&flux(), 0, 4, &VaeOptions::default()).is_err());
        assert!(VaePlan::new(&flux(), 8000, 8000, &VaeOptions::default()).is_err());
    }

    #[test]
    fn bigger_plans_cover_smaller_ones() {
        let o = VaeOptions::default();
        let big = VaePlan::new(&flux(), 128, 128, &o).unwrap();
        let small = VaePlan::new(&flux(), 64, 96, &o).unwrap();
        assert!(big.covers(&small) && !small.covers(&big));
    }

    #[test]
    fn conv3_shapes_walk_the_decoder() {
        let g = flux();
        let v = conv3_shapes(&g, 128, 96);
        // conv_in, 4 mid convs, per up block 1 + 2·layers + 1 resnet convs, 3 upsamplers.
        assert_eq!(v.len(), 1 + 4 + 4 * (2 * g.layers_per_block + 2) + 3);
        assert_eq!(v[0], (128, 96, 16, 512, false));
        assert_eq!(v.iter().filter(|s| s.4).count(), 3);
        assert_eq!(*v.last().unwrap(), (1024, 768, 128, 128, false));
        // Every conv's input and output fit the activation buffers the plan sizes.
        let plan = VaePlan::new(&g, 128, 96, &VaeOptions::default()).unwrap();
        for &(h, w, cin, cout, up) in &v {
            assert!(h * w * cout <= plan.act_f32);
            let src = if up { h * w / 4 } else { h * w };
            assert!(src * cin <= plan.act_bf16);
        }
    }
}
