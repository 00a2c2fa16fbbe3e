//! The DiT as the pipeline drives it: on the device when one takes the model, else on the CPU,
//! with the same results either way (within the device's bf16 tolerance).
//!
//! The device contract (cmf-gpu `DitDevice`): `load` (weights resident), `condition` per
//! caption (embedding + context refiner on the device), `prepare` per resolution (RoPE rows,
//! activation buffers), `step` per denoising step. Any refusal — at load, while conditioning,
//! or at any step — hands the rest of the run to the CPU model; the CPU's caption conditioning
//! is computed then, so nothing is computed twice when the device runs the whole way.

use crate::transformer::{pad_to, patchify, unpatchify, Conditioning, DitItem, ZImageDit};
use cmf_gpu::dit::{CondId, DitItemSetup, DitPrecision, DitStepItem, RopeRows};
use cmf_gpu::{Gpu, GpuDit};
use rayon::prelude::*;
use std::borrow::Cow;

pub struct Denoiser<'d, 'a> {
    dit: &'d ZImageDit<'a>,
    /// Caption features `[len, cap_feat_dim]` and their lengths.
    caps: Vec<(Vec<f32>, usize)>,
    /// Latent grid.
    h: usize,
    w: usize,
    device: Option<GpuDit>,
    cpu_conds: Option<Vec<Conditioning>>,
    /// Timestep embeddings made ahead for the device steps, by the bits of `t`
    /// ([`Denoiser::precompute_t_embeds`]).
    t_embeds: Vec<(u32, Vec<f32>)>,
}

impl<'d, 'a> Denoiser<'d, 'a> {
    /// Sets up the denoiser for `caps` (one per batch item: positive, then negative under CFG)
    /// and an `h × w` latent. Tries the device first.
    pub fn new(
        dit: &'d ZImageDit<'a>,
        gpu: &Gpu,
        caps: Vec<(Vec<f32>, usize)>,
        h: usize,
        w: usize,
    ) -> Denoiser<'d, 'a> {
        Self::with_resident(dit, gpu, None, DitPrecision::Bf16, caps, h, w)
    }

    /// As [`Denoiser::new`], reusing `resident` (the same model, loaded by an earlier run and
    /// handed back by [`Denoiser::into_device`]) instead of uploading the weights again, or
    /// else loading the model at `precision`.
    pub fn with_resident(
        dit: &'d ZImageDit<'a>,
        gpu: &Gpu,
        resident: Option<GpuDit>,
        precision: DitPrecision,
        caps: Vec<(Vec<f32>, usize)>,
        h: usize,
        w: usize,
    ) -> Denoiser<'d, 'a> {
        let mut d = Denoiser {
            dit,
            caps,
            h,
            w,
            device: None,
            cpu_conds: None,
            t_embeds: Vec::new(),
        };
        if gpu.is_active() {
            let dev = match resident {
                Some(mut r) => {
                    r.release();
                    Some(r)
                }
                None => gpu.load_dit(&dit.device_model(precision)).ok(),
            };
            d.device = dev.and_then(|dev| d.setup_device(dev));
        }
        d
    }

    /// Runs one zero caption row through the device's context refiner and drops it, so that
    /// the GEMM library's first-use set-up (~0.1 s in a fresh process) happens while the text
    /// encoder runs (the pipeline's preload), not in the first conditioning. A refusal changes
    /// nothing: the conditioning pays the set-up then.
    pub fn warm_up(dev: &mut GpuDit, dit: &ZImageDit) {
        let lp = pad_to(1);
        let (cos, sin) = dit.caption_rope(lp);
        let cap = vec![0f32; dit.cfg.cap_feat_dim];
        let _ = dev.condition(
            &cap,
            1,
            RopeRows {
                cos: &cos,
                sin: &sin,
            },
        );
        dev.release();
    }

    /// Makes the timestep embeddings of the model times `ts` in parallel, ahead of the device
    /// steps that take them (the host MLP took 0.35–0.57 ms a step while the device idled).
    /// The CPU path computes its own; a time not listed is computed when its step comes.
    pub fn precompute_t_embeds(&mut self, ts: &[f32]) {
        if self.device.is_none() {
            return;
        }
        let dit = self.dit;
        self.t_embeds = ts
            .par_iter()
            .map(|&t| (t.to_bits(), dit.timestep_embedding(t)))
            .collect();
    }

    /// The timestep embedding a device step at model time `t` takes: made ahead, or now.
    pub fn t_embedding(&self, t: f32) -> Cow<'_, [f32]> {
        Self::t_embedding_in(&self.t_embeds, self.dit, t)
    }

    fn t_embedding_in<'e>(made: &'e [(u32, Vec<f32>)], dit: &ZImageDit, t: f32) -> Cow<'e, [f32]> {
        match made.iter().find(|(bits, _)| *bits == t.to_bits()) {
            Some((_, e)) => Cow::Borrowed(e),
            None => Cow::Owned(dit.timestep_embedding(t)),
        }
    }

    /// The resident model, for the next run (None when the run ended on the CPU).
    pub fn into_device(self) -> Option<GpuDit> {
        let mut dev = self.device?;
        dev.release();
        Some(dev)
    }

    /// Whether steps run on the device (so far).
    pub fn on_device(&self) -> bool {
        self.device.is_some()
    }

    /// Block GEMM planes the device runs on 8-bit operands (`--dit-precision fp8`, `fp8-fast`,
    /// `int8`; 0 on the CPU or in bf16).
    pub fn gemm8_planes(&self) -> usize {
        self.device.as_ref().map_or(0, |d| d.gemm8_planes())
    }

    fn setup_device(&self, mut dev: GpuDit) -> Option<GpuDit> {
        let t0 = std::time::Instant::now();
        let mut rope_s = 0.0;
        let mut conds: Vec<CondId> = Vec::new();
        let mut ropes = Vec::new();
        for (cap, len) in &self.caps {
            let lp = pad_to((*len).max(1));
            let tr = std::time::Instant::now();
            let (cos, sin) = self.dit.caption_rope(lp);
            rope_s += tr.elapsed().as_secs_f64();
            conds.push(
                dev.condition(
                    cap,
                    *len,
                    RopeRows {
                        cos: &cos,
                        sin: &sin,
                    },
                )
                .ok()?,
            );
            let tr = std::time::Instant::now();
            ropes.push(self.dit.joint_rope(self.h, self.w, lp));
            rope_s += tr.elapsed().as_secs_f64();
        }
        let t_prep = std::time::Instant::now();
        let items: Vec<DitItemSetup> = conds
            .iter()
            .zip(&ropes)
            .map(|(&cond, (cos, sin))| DitItemSetup {
                cond,
                rope: RopeRows { cos, sin },
            })
            .collect();
        dev.prepare(&items, (self.h / 2) * (self.w / 2)).ok()?;
        if cmf_gpu::facade::log::debug_enabled() {
            let prep = t_prep.elapsed().as_secs_f64();
            let total = t0.elapsed().as_secs_f64();
            cmf_gpu::facade::log::debug(&format!(
                "dit conditioning: RoPE tables {:.1} ms, captions (context refiner) {:.1} ms, \
                 prepare {:.1} ms",
                1e3 * rope_s,
                1e3 * (total - prep - rope_s),
                1e3 * prep
            ));
        }
        Some(dev)
    }

    /// The model output for the listed caption items (indices into `caps`) at model time `t`,
    /// each `[C, h, w]`, for latents `[C, h, w]`.
    pub fn velocity(&mut self, latents: &[f32], t: f32, items: &[usize]) -> Vec<Vec<f32>> {
        let c = self.dit.cfg.in_channels;
        let tokens = patchify(latents, c, self.h, self.w);
        self.velocity_tokens(&tokens, t, items)
            .iter()
            .map(|o| unpatchify(o, c, self.h, self.w))
            .collect()
    }

    /// As [`Denoiser::velocity`] with latents and outputs in token order (`patchify`'s): what
    /// the device takes and gives, so a denoising loop kept in token order moves no data between
    /// layouts per step (the Euler update and CFG are elementwise).
    pub fn velocity_tokens(&mut self, tokens: &[f32], t: f32, items: &[usize]) -> Vec<Vec<f32>> {
        if let Some(out) = self.device_velocity(tokens, t, items) {
            return out;
        }
        self.device = None;
        let c = self.dit.cfg.in_channels;
        let latents = unpatchify(tokens, c, self.h, self.w);
        let conds = self.cpu_conds.get_or_insert_with(|| {
            self.caps
                .iter()
                .map(|(c, n)| self.dit.condition(c, *n))
                .collect()
        });
        let batch: Vec<DitItem> = items
            .iter()
            .map(|&i| DitItem {
                latents: &latents,
                cond: &conds[i],
                t,
            })
            .collect();
        self.dit
            .velocity(&batch, self.h, self.w)
            .iter()
            .map(|o| patchify(o, c, self.h, self.w))
            .collect()
    }

    fn device_velocity(
        &mut self,
        tokens: &[f32],
        t: f32,
        items: &[usize],
    ) -> Option<Vec<Vec<f32>>> {
        let dev = self.device.as_mut()?;
        let cfg = &self.dit.cfg;
        let ni = (self.h / 2) * (self.w / 2);
        let pd = cfg.patch_dim();
        let t0 = std::time::Instant::now();
        let t_emb = Self::t_embedding_in(&self.t_embeds, self.dit, t);
        let t_embed_s = t0.elapsed().as_secs_f64();
        let step: Vec<DitStepItem> = items
            .iter()
            .map(|&slot| DitStepItem {
                slot,
                patches: tokens,
                t_emb: &t_emb,
            })
            .collect();
        let mut out = vec![0f32; items.len() * ni * pd];
        let t1 = std::time::Instant::now();
        dev.step(&step, &mut out).ok()?;
        let step_s = t1.elapsed().as_secs_f64();
        let outs = out.chunks_exact(ni * pd).map(<[f32]>::to_vec).collect();
        if cmf_gpu::facade::log::debug_enabled() {
            // Where a step's wall time goes besides the device's own work (the device step
            // includes its host conversions, uploads and readback).
            cmf_gpu::facade::log::debug(&format!(
                "dit step: timestep MLP {:.2} ms, device step {:.2} ms, other {:.2} ms",
                1e3 * t_embed_s,
                1e3 * step_s,
                1e3 * (t0.elapsed().as_secs_f64() - t_embed_s - step_s)
            ));
        }
        Some(outs)
    }
}
