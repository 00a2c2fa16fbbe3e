//! The FLUX VAE decoder resident on the device: weights uploaded once, then each decode is one
//! latent upload, the whole decoder on the stream, one readback of the image.
//!
//! Weights live as bf16 planes, dequantised on the device at load from whatever codec the file
//! holds (`dequant_rows` in rowops.cu), 3×3 kernels permuted to tap-major columns. Why bf16 and
//! not the stored codec: every VAE product is a large GEMM (at a 1024² image, up to 1M pixel
//! rows against K = 1152…4608), compute-bound, so tensor cores want bf16 operands, and
//! dequantising per call would only add passes; the whole decoder is ~50M parameters (~100 MB
//! in bf16), small next to the workspace.
//!
//! Numerics: f32 activations (NHWC), bf16 GEMM operands (conv inputs, attention Q/K/V/P), f32
//! accumulation, GroupNorm statistics in f32 partials finished in f64. Kernels and the data
//! flow are described in `kernels/vae.cu`; buffer sizes and tilings in [`plan`].
//!
//! Contract (as the rest of the backend): `decode` does the whole job or refuses before writing
//! `out` (bad shapes, geometry the kernels do not take, a workspace that does not fit the free
//! device memory, a device error); the image is read back into a host staging buffer and only
//! copied into `out` once everything succeeded.
//!
//! Files: `weights` (checks, resident layers, upload), `workspace` (activation buffers), [`plan`]
//! (shapes and tilings), `kernels` (the loaded functions). They share this module's imports
//! (`use super::*`).

pub(crate) mod kernels;
pub mod plan;
mod weights;
mod workspace;

use crate::cuda::runtime::blas::Blas;
use crate::cuda::runtime::cudnn::Cudnn;
use crate::cuda::runtime::device::{
    bytes_of, f32s_from_le_bytes, Arg, DBuf, DResult, Dev, DevError,
};
use crate::cuda::runtime::weights::{DequantTo, DevCodec, DevWeight};
use crate::facade::backend::VaeDevice;
use crate::facade::refusal::{Refusal, RefusalReason};
use crate::vae::{ConvW, GroupNormW, ResnetW, VaeGeometry, VaeModel};
use cmf_format::Dtype;
use kernels::Kernels;
use plan::{conv3_shapes, elementwise_layout, grid1, stats_layout, AttnPlan, RowLayout};
pub use plan::{VaeOptions, VaePlan};
use std::sync::Arc;
use weights::{check_codec, resident_bytes, DAttn, DConv, DNorm, DResnet, DUp, Uploader};
use workspace::{dnn_sizes, DnnBufs, Workspace};

const OP_LOAD: &str = "vae.load";
const OP_DECODE: &str = "vae.decode";
const OP_PREPARE: &str = "vae.prepare";
/// Device memory left free beyond our estimate (cuBLAS workspaces, fragmentation).
const MARGIN_BYTES: u64 = 512 << 20;

/// An activation buffer `[pixels, C]` as a kernel reads it: the decoder's f32 buffers, or the
/// bf16 output of a cuDNN conv (read by the row kernels' bf16 variants).
#[derive(Clone, Copy)]
enum Act {
    F32(u64),
    Bf16(u64),
}

impl Act {
    /// The pointer and the index of the kernel variant that reads it (`[f32, bf16]` pairs).
    fn parts(self) -> (u64, usize) {
        match self {
            Act::F32(p) => (p, 0),
            Act::Bf16(p) => (p, 1),
        }
    }
}

/// The resident decoder.
pub struct CudaVae {
    dev: Arc<Dev>,
    blas: Blas,
    /// cuDNN's convs (VaeOptions::cudnn, where libcudnn loads); None: im2col + cuBLAS.
    dnn: Option<Cudnn>,
    k: Kernels,
    geo: VaeGeometry,
    opts: VaeOptions,
    conv_in: DConv,
    mid: [DResnet; 2],
    attn: Option<DAttn>,
    ups: Vec<DUp>,
    norm_out: DNorm,
    conv_out: DConv,
    weight_bytes: u64,
    ws: Option<Workspace>,
    /// Readback staging (bytes): `out` is written only after the whole decode succeeded.
    host: Vec<u8>,
}

/// What a decode writes: the f32 image (NCHW, values around [-1, 1]), or the 8-bit RGB image
/// (`[H, W, out_channels]`, diffusers' postprocess) made on the device.
enum Output<'o> {
    F32(&'o mut [f32]),
    Rgb8(&'o mut [u8]),
}

impl Output<'_> {
    fn len(&self) -> usize {
        match self {
            Output::F32(o) => o.len(),
            Output::Rgb8(o) => o.len(),
        }
    }
}

/// Where `vae_conv3_small` puts its non-finite flag after `image` RGB bytes: 4-byte aligned for
/// its atomicOr.
fn rgb8_flag_offset(image: usize) -> usize {
    image.next_multiple_of(4)
}

fn shape_refusal(op: &'static str, why: String) -> Refusal {
    Refusal::new(op, RefusalReason::UnsupportedShape(why))
}

impl CudaVae {
    /// Uploads `model` to `dev` with the default options.
    pub fn load(dev: &Arc<Dev>, model: &VaeModel) -> Result<CudaVae, Refusal> {
        CudaVae::load_with(dev, model, VaeOptions::default())
    }

    /// Uploads `model` once (weights to bf16 planes on the device). Refuses before allocating
    /// anything when a shape, geometry or codec is not supported or the weights do not fit.
    pub fn load_with(
        dev: &Arc<Dev>,
        model: &VaeModel,
        opts: VaeOptions,
    ) -> Result<CudaVae, Refusal> {
        model
            .check_shapes()
            .map_err(|s| shape_refusal(OP_LOAD, s))?;
        plan::check_geometry(&model.geometry).map_err(|s| shape_refusal(OP_LOAD, s))?;
        let weights = model.weights();
        for (name, c) in &weights {
            check_codec(name, c)?;
        }
        let dev = dev.clone();
        // Resident planes plus the largest transient (stored codec + its bf16 plane).
        let transient = weights
            .iter()
            .map(|(_, c)| (c.weight.data.len() + 2 * c.weight.rows * c.weight.cols) as u64)
            .max()
            .unwrap_or(0);
        let need = resident_bytes(model) + transient;
        let free = dev.free_bytes();
        if need + MARGIN_BYTES > free {
            return Err(Refusal::new(
                OP_LOAD,
                RefusalReason::OutOfMemory {
                    need,
                    budget: free.saturating_sub(MARGIN_BYTES),
                },
            ));
        }
        dev.bind_to_thread().map_err(|e| e.refusal(OP_LOAD))?;
        let k = Kernels::load(&dev).map_err(|e| e.refusal(OP_LOAD))?;
        let blas = Blas::new(&dev).map_err(|e| e.refusal(OP_LOAD))?;
        let up = Uploader { dev: &dev, k: &k };
        let built = (|| -> DResult<_> {
            let mid = [
                up.resnet(&model.mid_resnets[0])?,
                up.resnet(&model.mid_resnets[1])?,
            ];
            let attn = match &model.mid_attention {
                Some(a) => Some(DAttn {
                    norm: up.norm(&a.norm)?,
                    q: up.conv(&a.q, false)?,
                    k: up.conv(&a.k, false)?,
                    v: up.conv(&a.v, false)?,
                    out: up.conv(&a.out, false)?,
                }),
                None => None,
            };
            let mut ups = Vec::new();
            for b in &model.up_blocks {
                ups.push(DUp {
                    resnets: b
                        .resnets
                        .iter()
                        .map(|r| up.resnet(r))
                        .collect::<DResult<_>>()?,
                    upsampler: b.upsampler.as_ref().map(|c| up.conv(c, true)).transpose()?,
                });
            }
            let conv_in = up.conv(&model.conv_in, true)?;
            let norm_out = up.norm(&model.norm_out)?;
            let conv_out = up.conv(&model.conv_out, true)?;
            dev.sync()?;
            Ok((conv_in, mid, attn, ups, norm_out, conv_out))
        })();
        let (conv_in, mid, attn, ups, norm_out, conv_out) =
            built.map_err(|e| e.refusal(OP_LOAD))?;
        let dnn = if opts.cudnn {
            Cudnn::new(&dev)
                .map_err(|e| {
                    crate::facade::log::debug(&format!("VAE convs: im2col ({})", e.0));
                })
                .ok()
        } else {
            None
        };
        Ok(CudaVae {
            dev: dev.clone(),
            blas,
            dnn,
            k,
            geo: model.geometry.clone(),
            opts,
            conv_in,
            mid,
            attn,
            ups,
            norm_out,
            conv_out,
            weight_bytes: resident_bytes(model),
            ws: None,
            host: Vec::new(),
        })
    }

    pub fn geometry(&self) -> &VaeGeometry {
        &self.geo
    }

    /// Whether the 3×3 convs run through cuDNN (else im2col + cuBLAS).
    pub fn uses_cudnn(&self) -> bool {
        self.dnn.is_some()
    }

    /// Device bytes of the resident weights.
    pub fn weight_bytes(&self) -> u64 {
        self.weight_bytes
    }

    /// Device bytes a decode of an `h × w` latent allocates (its workspace).
    pub fn workspace_bytes(&self, h: usize, w: usize) -> Result<u64, Refusal> {
        VaePlan::new(&self.geo, h, w, &self.opts)
            .map(|p| p.device_bytes())
            .map_err(|s| shape_refusal(OP_DECODE, s))
    }

    /// See `VaeDevice::prepare`: the workspace and cuDNN plans for latents of `h × w`, then one
    /// decode of zeros whose image is dropped, so that the libraries' kernels are loaded and
    /// their first-use costs paid here (a first decode at 1024² took 243 ms against 35 for
    /// the next).
    pub fn prepare(&mut self, h: usize, w: usize) -> Result<(), Refusal> {
        let plan =
            VaePlan::new(&self.geo, h, w, &self.opts).map_err(|s| shape_refusal(OP_PREPARE, s))?;
        let refusal = |e: DevError| e.refusal(OP_PREPARE);
        self.dev.bind_to_thread().map_err(refusal)?;
        let t0 = std::time::Instant::now();
        self.ensure_workspace(&plan)?;
        let workspace_s = t0.elapsed().as_secs_f64();
        let zeros = vec![0f32; self.geo.latent_channels * h * w];
        self.run(&plan, &zeros, true)
            .and_then(|()| self.dev.sync())
            .map_err(refusal)?;
        crate::facade::log::debug(&format!(
            "vae prepare {h}x{w}: workspace and cuDNN plans {:.1} ms, warm-up decode {:.1} ms",
            1e3 * workspace_s,
            1e3 * (t0.elapsed().as_secs_f64() - workspace_s)
        ));
        Ok(())
    }

    /// Frees the workspace (the next decode allocates it again).
    pub fn release_workspace(&mut self) {
        self.ws = None;
    }

    /// `Decoder.forward` of `z` `[latent_channels, h, w]` f32 (already `z / scaling_factor +
    /// shift_factor`, as `VaeDecoder::decode` takes it) into `out` `[out_channels, 8h, 8w]` f32,
    /// before the [-1, 1] → [0, 1] mapping. On `Err`, `out` is untouched.
    pub fn decode(
        &mut self,
        z: &[f32],
        h: usize,
        w: usize,
        out: &mut [f32],
    ) -> Result<(), Refusal> {
        self.decode_into(z, h, w, Output::F32(out)).map(|_| ())
    }

    /// As [`CudaVae::decode`], writing the 8-bit RGB image `[H, W, out_channels]` (round half to
    /// even of `clamp(v / 2 + 0.5, 0, 1) · 255`, as `cmf_zimage::vae::to_rgb8`). Returns whether
    /// every value was finite (`out` is written either way).
    pub fn decode_rgb8(
        &mut self,
        z: &[f32],
        h: usize,
        w: usize,
        out: &mut [u8],
    ) -> Result<bool, Refusal> {
        self.decode_into(z, h, w, Output::Rgb8(out))
    }

    fn decode_into(
        &mut self,
        z: &[f32],
        h: usize,
        w: usize,
        mut out: Output,
    ) -> Result<bool, Refusal> {
        let g = &self.geo;
        if h == 0 || w == 0 || z.len() != g.latent_channels * h * w {
            return Err(shape_refusal(
                OP_DECODE,
                format!(
                    "latent of {} values for [{}, {h}, {w}]",
                    z.len(),
                    g.latent_channels
                ),
            ));
        }
        let plan = VaePlan::new(g, h, w, &self.opts).map_err(|s| shape_refusal(OP_DECODE, s))?;
        if out.len() != plan.image {
            return Err(shape_refusal(
                OP_DECODE,
                format!(
                    "output of {} values for [{}, {}, {}]",
                    out.len(),
                    g.out_channels,
                    plan.out_h,
                    plan.out_w
                ),
            ));
        }
        self.dev
            .bind_to_thread()
            .map_err(|e| e.refusal(OP_DECODE))?;
        let t0 = std::time::Instant::now();
        self.ensure_workspace(&plan)?;
        let workspace_s = t0.elapsed().as_secs_f64();
        let rgb = matches!(out, Output::Rgb8(_));
        // Read back into staging; `out` only once everything succeeded. RGB mode: the image
        // bytes, then the kernel's non-finite flag (an i32, at the next multiple of 4).
        let flag = rgb8_flag_offset(plan.image);
        let n = if rgb { flag + 4 } else { 4 * plan.image };
        let mut host = std::mem::take(&mut self.host);
        host.resize(n, 0);
        let mut read = self.run_and_read(&plan, z, rgb, &mut host[..n]);
        if let (Err(e), true) = (&read, self.dnn.is_some()) {
            // A cuDNN failure at run time: this decoder goes back to im2col for good, and this
            // decode runs again (nothing was written to `out`).
            crate::facade::log::debug(&format!(
                "VAE convs: im2col after a cuDNN failure ({})",
                e.0
            ));
            self.dnn = None;
            self.ws = None;
            read = self
                .ensure_workspace(&plan)
                .map_err(|r| DevError(r.to_string()))
                .and_then(|()| self.run_and_read(&plan, z, rgb, &mut host[..n]));
        }
        if let Err(e) = read {
            self.host = host;
            return Err(e.refusal(OP_DECODE));
        }
        if crate::facade::log::debug_enabled() {
            crate::facade::log::debug(&format!(
                "vae decode {h}x{w}: workspace and cuDNN plans {:.1} ms, run and readback {:.1} ms",
                1e3 * workspace_s,
                1e3 * (t0.elapsed().as_secs_f64() - workspace_s)
            ));
        }
        let finite = match &mut out {
            Output::Rgb8(o) => {
                o.copy_from_slice(&host[..plan.image]);
                host[flag..n] == [0; 4]
            }
            Output::F32(o) => {
                f32s_from_le_bytes(o, &host);
                true
            }
        };
        self.host = host;
        Ok(finite)
    }

    /// [`Self::run`], then the image buffer's first `host.len()` bytes read back.
    fn run_and_read(&self, plan: &VaePlan, z: &[f32], rgb: bool, host: &mut [u8]) -> DResult<()> {
        self.run(plan, z, rgb)?;
        let ws = self.ws.as_ref().expect("workspace ensured");
        self.dev.download(host, ws.image.ptr())
    }

    fn ensure_workspace(&mut self, plan: &VaePlan) -> Result<(), Refusal> {
        // cuDNN's buffers for this latent size; a shape it cannot plan sends every conv of this
        // decoder back to im2col.
        let dnn = match &self.dnn {
            Some(d) => match dnn_sizes(d, &self.geo, plan.h, plan.w) {
                Ok(sizes) => Some(sizes),
                Err(e) => {
                    crate::facade::log::debug(&format!("VAE convs: im2col ({})", e.0));
                    self.dnn = None;
                    None
                }
            },
            None => None,
        };
        let dnn_covered = |ws: &Workspace| match (&ws.dnn, dnn) {
            (_, None) => true,
            (Some(b), Some((up, y, w))) => b.up.len() >= up && b.y.len() >= y && b.ws.len() >= w,
            (None, Some(_)) => false,
        };
        if self
            .ws
            .as_ref()
            .is_some_and(|ws| ws.plan.covers(plan) && dnn_covered(ws))
        {
            return Ok(());
        }
        self.ws = None;
        let dnn_bytes = dnn.map_or(0, |(up, y, w)| (up + y + w) as u64);
        let need = plan.device_bytes() + dnn_bytes;
        let free = self.dev.free_bytes();
        if need + MARGIN_BYTES > free {
            return Err(Refusal::new(
                OP_DECODE,
                RefusalReason::OutOfMemory {
                    need,
                    budget: free.saturating_sub(MARGIN_BYTES),
                },
            ));
        }
        self.ws = Some(Workspace::alloc(&self.dev, plan, dnn).map_err(|e| e.refusal(OP_DECODE))?);
        Ok(())
    }

    /// The whole decoder on the stream; the image (f32 NCHW, or with `rgb` the 8-bit RGB image
    /// and the non-finite flag after it) lands in the workspace's image buffer.
    fn run(&self, plan: &VaePlan, z: &[f32], rgb: bool) -> DResult<()> {
        let ws = self.ws.as_ref().expect("workspace ensured");
        let g = &self.geo;
        let (h, w) = (plan.h, plan.w);
        let top = g.top_channels();
        let f = |i: usize| ws.f[i].ptr();
        self.dev.upload_f32(ws.latent.ptr(), z)?;
        let p0 = h * w;
        self.dev.launch(
            &self.k.nchw_to_nhwc,
            grid1(p0 * g.latent_channels, 256),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(ws.latent.ptr()),
                Arg::I32(g.latent_channels as i32),
                Arg::U64(p0 as u64),
                Arg::Ptr(ws.nb.ptr()),
            ],
        )?;
        // Activation buffers: x (the stage's input), t (conv1 output), y (the output).
        let (mut x, t, mut y) = (0usize, 1usize, 2usize);
        let y0 = self.conv3(
            ws,
            &self.conv_in,
            ws.nb.ptr(),
            g.latent_channels,
            h,
            w,
            false,
            f(x),
        )?;
        self.bias_res(y0, self.conv_in.bias.ptr(), 0, top, p0, f(x))?;
        let (mut hh, mut ww) = (h, w);
        self.resnet(ws, &self.mid[0], hh, ww, f(x), f(t), f(y))?;
        std::mem::swap(&mut x, &mut y);
        if let (Some(a), Some(ap)) = (&self.attn, plan.attn) {
            self.attention(ws, a, ap, f(x), f(y))?;
            std::mem::swap(&mut x, &mut y);
        }
        self.resnet(ws, &self.mid[1], hh, ww, f(x), f(t), f(y))?;
        std::mem::swap(&mut x, &mut y);
        for b in &self.ups {
            for r in &b.resnets {
                self.resnet(ws, r, hh, ww, f(x), f(t), f(y))?;
                std::mem::swap(&mut x, &mut y);
            }
            if let Some(u) = &b.upsampler {
                // Nearest ×2 folded into the im2col: convert the low-res map to bf16 only.
                let c = u.cout;
                self.to_bf16(f(x), hh * ww * c, ws.nb.ptr())?;
                let yu = self.conv3(ws, u, ws.nb.ptr(), c, hh, ww, true, f(y))?;
                hh *= 2;
                ww *= 2;
                self.bias_res(yu, u.bias.ptr(), 0, c, hh * ww, f(y))?;
                std::mem::swap(&mut x, &mut y);
            }
        }
        let c0 = g.block_out_channels[0];
        let p = hh * ww;
        self.group_norm(
            ws,
            &self.norm_out,
            Act::F32(f(x)),
            0,
            c0,
            p,
            true,
            ws.nb.ptr(),
        )?;
        let (out_f32, out_rgb, bad) = if rgb {
            let bad = ws.image.ptr() + rgb8_flag_offset(plan.image) as u64;
            self.dev.memset0(bad, 4)?;
            (0, ws.image.ptr(), bad)
        } else {
            (ws.image.ptr(), 0, 0)
        };
        // Lanes a pixel: a power of two, at most 32 and at most the 8-channel groups.
        let lpp = (c0 / 8).clamp(1, 32);
        let lpp = if lpp.is_power_of_two() {
            lpp
        } else {
            lpp.next_power_of_two() / 2
        };
        let pixels_per_block = 8 * (32 / lpp);
        self.dev.launch(
            &self.k.conv3_small,
            (p.div_ceil(pixels_per_block) as u32, 1, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(ws.nb.ptr()),
                Arg::I32(c0 as i32),
                Arg::I32(hh as i32),
                Arg::I32(ww as i32),
                Arg::Ptr(self.conv_out.w.ptr()),
                Arg::Ptr(self.conv_out.bias.ptr()),
                Arg::I32(g.out_channels as i32),
                Arg::I32(lpp as i32),
                Arg::Ptr(out_f32),
                Arg::Ptr(out_rgb),
                Arg::Ptr(bad),
            ],
        )
    }

    /// `ResnetBlock2D` at `h × w`: x → out; `t` is scratch for conv1's output.
    #[allow(clippy::too_many_arguments)]
    fn resnet(
        &self,
        ws: &Workspace,
        r: &DResnet,
        h: usize,
        w: usize,
        x: u64,
        t: u64,
        out: u64,
    ) -> DResult<()> {
        let p = h * w;
        let nb = ws.nb.ptr();
        self.group_norm(ws, &r.norm1, Act::F32(x), 0, r.cin, p, true, nb)?;
        let y1 = self.conv3(ws, &r.conv1, nb, r.cin, h, w, false, t)?;
        // conv1's bias is folded into norm2 (statistics and apply).
        self.group_norm(ws, &r.norm2, y1, r.conv1.bias.ptr(), r.cout, p, true, nb)?;
        let y2 = self.conv3(ws, &r.conv2, nb, r.cout, h, w, false, out)?;
        let Some(sc) = &r.shortcut else {
            return self.bias_res(y2, r.out_bias.ptr(), x, r.cout, p, out);
        };
        // The shortcut bf16(x) · W_scᵀ lands in `out`, then both biases at once: accumulated onto
        // conv2's f32 output there, or written first and added to cuDNN's bf16 output after.
        self.to_bf16(x, p * r.cin, nb)?;
        let onto_conv2 = matches!(y2, Act::F32(_));
        self.blas.gemm(
            true,
            sc.w.ptr(),
            nb,
            out,
            r.cout,
            p,
            r.cin,
            r.cout,
            onto_conv2,
        )?;
        if onto_conv2 {
            self.bias_res(Act::F32(out), r.out_bias.ptr(), 0, r.cout, p, out)
        } else {
            self.bias_res(y2, r.out_bias.ptr(), out, r.cout, p, out)
        }
    }

    /// The mid attention over `a.n` pixels of `a.c` channels: x → out = x + attn(GN(x)).
    fn attention(&self, ws: &Workspace, at: &DAttn, a: AttnPlan, x: u64, out: u64) -> DResult<()> {
        let bufs = ws.attn.as_ref().expect("attention buffers");
        let (n, c) = (a.n, a.c);
        let nb = ws.nb.ptr();
        self.group_norm(ws, &at.norm, Act::F32(x), 0, c, n, false, nb)?;
        for (lin, dst, transpose) in [
            (&at.q, &bufs.q, false),
            (&at.k, &bufs.k, false),
            (&at.v, &bufs.vt, true),
        ] {
            self.blas
                .gemm(true, lin.w.ptr(), nb, bufs.proj.ptr(), c, n, c, c, false)?;
            let l = elementwise_layout(c, n);
            self.dev.launch(
                &self.k.bias_bf16,
                (l.blocks, 1, 1),
                (l.threads, 1, 1),
                0,
                &[
                    Arg::Ptr(bufs.proj.ptr()),
                    Arg::Ptr(lin.bias.ptr()),
                    Arg::I32(c as i32),
                    Arg::U64(n as u64),
                    Arg::I32(l.ppb as i32),
                    Arg::I32(transpose as i32),
                    Arg::Ptr(dst.ptr()),
                ],
            )?;
        }
        // Query tiles: S = Q Kᵀ [tq, n] f32, P = softmax(S / √c) bf16, O = P V [tq, c] f32.
        let (s_ptr, p_ptr) = (ws.scratch.ptr(), ws.scratch.ptr() + a.p_offset as u64);
        let scale = 1.0 / (c as f32).sqrt();
        let mut q0 = 0;
        while q0 < n {
            let m = a.tq.min(n - q0);
            self.blas.gemm(
                true,
                bufs.k.ptr(),
                bufs.q.ptr() + (2 * q0 * c) as u64,
                s_ptr,
                n,
                m,
                c,
                n,
                false,
            )?;
            self.dev.launch(
                &self.k.softmax_rows,
                (m as u32, 1, 1),
                (256, 1, 1),
                0,
                &[
                    Arg::Ptr(s_ptr),
                    Arg::I32(n as i32),
                    Arg::F32(scale),
                    Arg::Ptr(p_ptr),
                ],
            )?;
            self.blas.gemm(
                true,
                bufs.vt.ptr(),
                p_ptr,
                bufs.proj.ptr() + (4 * q0 * c) as u64,
                c,
                m,
                n,
                c,
                false,
            )?;
            q0 += m;
        }
        // Output projection + bias + residual (Q is dead: its buffer takes bf16(O)).
        self.to_bf16(bufs.proj.ptr(), n * c, bufs.q.ptr())?;
        self.blas
            .gemm(true, at.out.w.ptr(), bufs.q.ptr(), out, c, n, c, c, false)?;
        self.bias_res(Act::F32(out), at.out.bias.ptr(), x, c, n, out)
    }

    /// 3×3 conv of `src` (bf16 NHWC `[h, w, cin]`, nearest-upsampled ×2 first when `up`), no
    /// bias: through cuDNN into the workspace's bf16 conv output where it is in use, else im2col
    /// tile by tile into `out` (f32 `[pixels, cout]`). Returns where the result is.
    #[allow(clippy::too_many_arguments)]
    fn conv3(
        &self,
        ws: &Workspace,
        cv: &DConv,
        src: u64,
        cin: usize,
        h: usize,
        w: usize,
        up: bool,
        out: u64,
    ) -> DResult<Act> {
        let s = up as usize;
        let pixels = (h << s) * (w << s);
        if let (Some(dnn), Some(bufs)) = (&self.dnn, &ws.dnn) {
            return self.conv3_cudnn(dnn, bufs, cv, src, cin, h, w, up);
        }
        let k = 9 * cin;
        debug_assert_eq!(cv.cols, k);
        // The plan's tiling: its scratch (≤ the workspace's) holds one tile.
        let tile = plan::conv_tile(pixels, k, plan::scratch_budget(&self.opts));
        let mut p0 = 0;
        while p0 < pixels {
            let np = tile.min(pixels - p0);
            self.dev.launch(
                &self.k.im2col3,
                grid1(np * cin / 8, 256),
                (256, 1, 1),
                0,
                &[
                    Arg::Ptr(src),
                    Arg::I32(cin as i32),
                    Arg::I32(h as i32),
                    Arg::I32(w as i32),
                    Arg::I32(s as i32),
                    Arg::I32(p0 as i32),
                    Arg::I32(np as i32),
                    Arg::Ptr(ws.scratch.ptr()),
                ],
            )?;
            self.blas.gemm(
                true,
                cv.w.ptr(),
                ws.scratch.ptr(),
                out + (4 * p0 * cv.cout) as u64,
                cv.cout,
                np,
                k,
                cv.cout,
                false,
            )?;
            p0 += np;
        }
        Ok(Act::F32(out))
    }

    /// [`Self::conv3`] through cuDNN: the upsampled input made first where `up`; the output stays
    /// bf16 in the workspace (the next conv overwrites it).
    #[allow(clippy::too_many_arguments)]
    fn conv3_cudnn(
        &self,
        dnn: &Cudnn,
        bufs: &DnnBufs,
        cv: &DConv,
        src: u64,
        cin: usize,
        h: usize,
        w: usize,
        up: bool,
    ) -> DResult<Act> {
        let s = up as usize;
        let (oh, ow) = (h << s, w << s);
        let x = if up {
            self.dev.launch(
                &self.k.upsample2,
                grid1(oh * ow * cin / 8, 256),
                (256, 1, 1),
                0,
                &[
                    Arg::Ptr(src),
                    Arg::I32(cin as i32),
                    Arg::I32(h as i32),
                    Arg::I32(w as i32),
                    Arg::Ptr(bufs.up.ptr()),
                ],
            )?;
            bufs.up.ptr()
        } else {
            src
        };
        dnn.conv3(
            (oh, ow, cin, cv.cout),
            x,
            cv.w.ptr(),
            bufs.y.ptr(),
            bufs.ws.ptr(),
        )?;
        Ok(Act::Bf16(bufs.y.ptr()))
    }

    /// GroupNorm (+ SiLU) of `x + bias` (`bias` 0: none) `[p, c]` → `out` bf16.
    #[allow(clippy::too_many_arguments)]
    fn group_norm(
        &self,
        ws: &Workspace,
        n: &DNorm,
        x: Act,
        bias: u64,
        c: usize,
        p: usize,
        silu: bool,
        out: u64,
    ) -> DResult<()> {
        let groups = self.geo.norm_groups;
        let st = stats_layout(c, p);
        let (x, kind) = x.parts();
        self.dev.launch(
            &self.k.gn_stats[kind],
            (st.blocks, 1, 1),
            (st.threads, 1, 1),
            0,
            &[
                Arg::Ptr(x),
                Arg::Ptr(bias),
                Arg::I32(c as i32),
                Arg::I32(groups as i32),
                Arg::U64(p as u64),
                Arg::I32(st.ppb as i32),
                Arg::Ptr(ws.partial.ptr()),
            ],
        )?;
        self.dev.launch(
            &self.k.gn_finalize,
            (groups as u32, 1, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(ws.partial.ptr()),
                Arg::I32(st.blocks as i32),
                Arg::I32(groups as i32),
                Arg::U64(p as u64),
                Arg::I32(st.ppb as i32),
                Arg::I32((c / groups) as i32),
                Arg::F32(self.geo.eps),
                Arg::Ptr(ws.mean.ptr()),
                Arg::Ptr(ws.inv.ptr()),
            ],
        )?;
        let l = elementwise_layout(c, p);
        self.dev.launch(
            &self.k.gn_apply[kind],
            (l.blocks, 1, 1),
            (l.threads, 1, 1),
            0,
            &[
                Arg::Ptr(x),
                Arg::Ptr(bias),
                Arg::I32(c as i32),
                Arg::I32(groups as i32),
                Arg::U64(p as u64),
                Arg::I32(l.ppb as i32),
                Arg::Ptr(ws.mean.ptr()),
                Arg::Ptr(ws.inv.ptr()),
                Arg::Ptr(n.w.ptr()),
                Arg::Ptr(n.b.ptr()),
                Arg::I32(silu as i32),
                Arg::Ptr(out),
            ],
        )
    }

    /// out = y + bias (+ skip; 0: none), `[p, c]`, out f32.
    fn bias_res(&self, y: Act, bias: u64, skip: u64, c: usize, p: usize, out: u64) -> DResult<()> {
        let l: RowLayout = elementwise_layout(c, p);
        let (y, kind) = y.parts();
        self.dev.launch(
            &self.k.bias_res[kind],
            (l.blocks, 1, 1),
            (l.threads, 1, 1),
            0,
            &[
                Arg::Ptr(y),
                Arg::Ptr(bias),
                Arg::Ptr(skip),
                Arg::I32(c as i32),
                Arg::U64(p as u64),
                Arg::I32(l.ppb as i32),
                Arg::Ptr(out),
            ],
        )
    }

    fn to_bf16(&self, x: u64, n: usize, out: u64) -> DResult<()> {
        self.dev.launch(
            &self.k.to_bf16,
            grid1(n, 256 * 8),
            (256, 1, 1),
            0,
            &[Arg::Ptr(x), Arg::U64(n as u64), Arg::Ptr(out)],
        )
    }
}

impl VaeDevice for CudaVae {
    fn decode(&mut self, z: &[f32], h: usize, w: usize, out: &mut [f32]) -> Result<(), Refusal> {
        CudaVae::decode(self, z, h, w, out)
    }

    fn decode_rgb8(
        &mut self,
        z: &[f32],
        h: usize,
        w: usize,
        out: &mut [u8],
    ) -> Result<bool, Refusal> {
        CudaVae::decode_rgb8(self, z, h, w, out)
    }

    fn prepare(&mut self, h: usize, w: usize) -> Result<(), Refusal> {
        CudaVae::prepare(self, h, w)
    }
}
