//! The GPU facade: policy that holds whatever the backend, CPU-testable.
//!
//! A caller opens one [`Gpu`] per process (from `--gpu` / `CMF_GPU`), loads a model through it
//! ([`Gpu::load_llm`], which plans placement against the VRAM budget) and calls the returned
//! [`GpuLlm`]'s entry points. Each entry point first passes the [`Gate`] (backend present, no
//! `pause_gpu`, not in a `cpu_scope`, no injected refusal), then runs on the device or returns
//! a [`Refusal`]; on a refusal the caller runs its CPU path and nothing it passed in has changed.

pub(crate) mod backend;
mod contention;
pub(crate) mod devices;
mod error;
pub mod fake;
pub(crate) mod files;
mod guards;
pub mod log;
mod mode;
pub(crate) mod placement;
pub(crate) mod refusal;

pub use backend::{Backend, DitDevice, Footprint, LlmDevice, VaeDevice};
pub use contention::{
    FACTOR as CONTENTION_FACTOR, FLOOR as CONTENTION_FLOOR, STRIKES as CONTENTION_STRIKES,
};
pub use devices::{
    parse_bytes, pin_thread, pinned_device, unpin_thread, vram_budget, DeviceInfo, MemStats,
};
pub use error::GpuError;
pub use files::{cache_dir, write_atomic};
pub use guards::{cpu_scope, in_cpu_scope, pause_count, pause_gpu, CpuScope, GpuPause};
pub use mode::{GpuMode, ENV_GPU};
pub use placement::{LayerSet, Placement, ENV_GPU_LAYERS};
pub use refusal::{Refusal, RefusalReason};

use crate::dit::{CondId, DitItemSetup, DitModel, DitStepItem, RopeRows};
use crate::llm::{DecodeOutput, LlmModel, LlmOptions, Logits, Sampler};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Diagnostics: `CMF_GPU_INJECT_REFUSAL=N` makes the device refuse every entry-point call after
/// the first N (to exercise the CPU fallback from the command line).
pub const ENV_INJECT_REFUSAL: &str = "CMF_GPU_INJECT_REFUSAL";

/// The checks every entry point passes before touching the device, and the contention guard
/// that times what runs there.
#[derive(Debug)]
pub struct Gate {
    /// Calls allowed before injected refusals start (u64::MAX: never).
    inject_after: AtomicU64,
    calls: AtomicU64,
    contention: contention::ContentionGuard,
    /// A backend call panicked: the device is not used again in this process.
    retired: std::sync::atomic::AtomicBool,
}

impl Gate {
    fn new() -> Gate {
        let n = std::env::var(ENV_INJECT_REFUSAL)
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(u64::MAX);
        Gate {
            inject_after: AtomicU64::new(n),
            calls: AtomicU64::new(0),
            contention: contention::ContentionGuard::default(),
            retired: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Runs a backend call; a panic inside it (a bug, or a driver state the backend did not
    /// expect) becomes a refusal and retires the device for the rest of the process, so the
    /// caller's CPU path runs instead of the process dying.
    fn contain<T>(
        &self,
        op: &'static str,
        call: impl FnOnce() -> Result<T, Refusal>,
    ) -> Result<T, Refusal> {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(call)) {
            Ok(r) => r,
            Err(p) => {
                let msg = p
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "(no message)".into());
                self.retired.store(true, Ordering::SeqCst);
                log::warn(&format!(
                    "{op}: the device backend panicked ({msg}): running on the CPU from now on"
                ));
                Err(Refusal::new(
                    op,
                    RefusalReason::Device(format!("the backend panicked: {msg}")),
                ))
            }
        }
    }

    /// Passes the gate, runs `device` (an entry point over `units` of work) and tells the
    /// contention guard how long it took.
    fn run<T>(
        &self,
        op: &'static str,
        units: usize,
        device: impl FnOnce() -> Result<T, Refusal>,
    ) -> Result<T, Refusal> {
        self.check(op)?;
        let t0 = Instant::now();
        let v = self.contain(op, device).map_err(Refusal::logged)?;
        self.contention.observe(op, units, t0.elapsed());
        Ok(v)
    }

    /// Ok when `op` may run on the device now; the refusal is logged (once per reason).
    pub fn check(&self, op: &'static str) -> Result<(), Refusal> {
        let reason = if guards::pause_count() > 0 {
            Some(RefusalReason::Paused)
        } else if guards::in_cpu_scope() {
            Some(RefusalReason::CpuScope)
        } else if self.retired.load(Ordering::SeqCst) {
            Some(RefusalReason::Device(
                "retired after a backend panic".into(),
            ))
        } else if self.contention.tripped() {
            Some(RefusalReason::Contended)
        } else if self.calls.fetch_add(1, Ordering::SeqCst)
            >= self.inject_after.load(Ordering::SeqCst)
        {
            Some(RefusalReason::Injected)
        } else {
            None
        };
        match reason {
            Some(r) => Err(Refusal::new(op, r).logged()),
            None => Ok(()),
        }
    }
}

/// The process's view of the GPU: the backend (if any) and the policy around it.
pub struct Gpu {
    mode: GpuMode,
    backend: Option<Arc<dyn Backend>>,
    gate: Arc<Gate>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("mode", &self.mode)
            .field("device", &self.info().map(|i| i.name))
            .finish()
    }
}

impl Gpu {
    /// Opens the backend `mode` asks for. `auto` never fails: without a device it returns a
    /// CPU-only facade (and says why at debug verbosity).
    pub fn open(mode: GpuMode) -> Result<Gpu, GpuError> {
        match mode {
            GpuMode::Off => Ok(Gpu::cpu_only()),
            GpuMode::Auto | GpuMode::Cuda => {
                match crate::cuda::CudaBackend::open(pinned_device()) {
                    Ok(b) => {
                        let info = b.info();
                        log::debug(&format!(
                            "using {} ({}, {} MiB)",
                            info.name,
                            info.arch,
                            info.total_bytes >> 20
                        ));
                        Ok(Gpu::with_backend(mode, Arc::new(b)))
                    }
                    Err(why) if mode == GpuMode::Auto => {
                        log::debug(&format!("no CUDA device, running on the CPU: {why}"));
                        Ok(Gpu::cpu_only())
                    }
                    Err(why) => Err(GpuError::NoDevice(why)),
                }
            }
        }
    }

    /// A facade with no device: every entry point refuses with [`RefusalReason::NoBackend`].
    pub fn cpu_only() -> Gpu {
        Gpu {
            mode: GpuMode::Off,
            backend: None,
            gate: Arc::new(Gate::new()),
        }
    }

    /// A facade over a given backend (the fake backend in tests, or a caller-built one).
    pub fn with_backend(mode: GpuMode, backend: Arc<dyn Backend>) -> Gpu {
        Gpu {
            mode,
            backend: Some(backend),
            gate: Arc::new(Gate::new()),
        }
    }

    pub fn mode(&self) -> GpuMode {
        self.mode
    }

    /// Whether a device backend is open.
    pub fn is_active(&self) -> bool {
        self.backend.is_some()
    }

    pub fn info(&self) -> Option<DeviceInfo> {
        self.backend.as_ref().map(|b| b.info())
    }

    /// Devices of the open backend's kind (0 without one).
    pub fn device_count(&self) -> usize {
        self.info().map(|i| i.count).unwrap_or(0)
    }

    /// Device bytes the engine may use (0 without a device). See [`vram_budget`].
    pub fn vram_budget(&self) -> u64 {
        self.info().map(|i| vram_budget(i.free_bytes)).unwrap_or(0)
    }

    pub fn bytes_resident(&self) -> u64 {
        self.backend
            .as_ref()
            .map(|b| b.stats().resident())
            .unwrap_or(0)
    }

    /// Host → device bytes so far. A steady-state decode window must not grow it.
    pub fn bytes_uploaded(&self) -> u64 {
        self.backend
            .as_ref()
            .map(|b| b.stats().uploaded())
            .unwrap_or(0)
    }

    pub fn bytes_downloaded(&self) -> u64 {
        self.backend
            .as_ref()
            .map(|b| b.stats().downloaded())
            .unwrap_or(0)
    }

    /// Makes every entry-point call after the next `calls` refuse (tests of the fallback).
    pub fn inject_refusal_after(&self, calls: u64) {
        self.gate.calls.store(0, Ordering::SeqCst);
        self.gate.inject_after.store(calls, Ordering::SeqCst);
    }

    /// Whether the contention guard has given the device up for the rest of the process.
    pub fn is_contended(&self) -> bool {
        self.gate.contention.tripped()
    }

    /// Ok when `op` may use the device now.
    pub fn check(&self, op: &'static str) -> Result<(), Refusal> {
        if self.backend.is_none() {
            return Err(Refusal::new(op, RefusalReason::NoBackend).logged());
        }
        self.gate.check(op)
    }

    /// Plans placement (explicit `layers`, else the VRAM budget) and uploads `model`.
    /// Refuses when the backend cannot run it or when no layer fits.
    pub fn load_llm(
        &self,
        model: &LlmModel,
        opts: &LlmOptions,
        layers: Option<&LayerSet>,
    ) -> Result<GpuLlm, Refusal> {
        self.check("llm.load")?;
        let backend = self.backend.as_ref().expect("checked");
        model.validate().map_err(Refusal::logged)?;
        let fp = backend
            .llm_footprint(model, opts)
            .map_err(Refusal::logged)?;
        let mut budget = self.vram_budget();
        loop {
            let placement = Placement::plan(
                &fp.layer_bytes,
                fp.head_bytes,
                fp.fixed_bytes,
                budget,
                layers,
            )
            .map_err(|e| {
                Refusal::new("llm.load", RefusalReason::UnsupportedShape(e.to_string())).logged()
            })?;
            if placement.device_layer_count() == 0 {
                let need = fp.layer_bytes.first().copied().unwrap_or(0) + fp.fixed_bytes;
                return Err(
                    Refusal::new("llm.load", RefusalReason::OutOfMemory { need, budget }).logged(),
                );
            }
            log::debug(&format!(
                "llm: {} of {} layers on the device{}",
                placement.device_layer_count(),
                placement.on_device.len(),
                if placement.is_whole_model() {
                    " (whole-token graph)"
                } else {
                    ""
                }
            ));
            let t0 = std::time::Instant::now();
            match self
                .gate
                .contain("llm.load", || backend.load_llm(model, opts, &placement))
            {
                Ok(dev) => {
                    log::debug(&format!(
                        "llm: uploaded in {:.2} s",
                        t0.elapsed().as_secs_f64()
                    ));
                    return Ok(GpuLlm {
                        dev,
                        gate: self.gate.clone(),
                    });
                }
                // The device had less memory than the budget said (another process took some
                // since it was read): fewer layers, unless the user placed them.
                Err(r) if r.reason.is_out_of_memory() && layers.is_none() => {
                    budget = placement_bytes(&placement, &fp) / 4 * 3;
                    log::debug(&format!(
                        "llm: {r}; trying a placement under {} MiB",
                        budget >> 20
                    ));
                }
                Err(r) => return Err(r.logged()),
            }
        }
    }
}

/// Device bytes `placement` takes by `fp`.
fn placement_bytes(placement: &Placement, fp: &Footprint) -> u64 {
    let layers: u64 = fp
        .layer_bytes
        .iter()
        .zip(&placement.on_device)
        .filter(|(_, &on)| on)
        .map(|(b, _)| b)
        .sum();
    layers
        + fp.fixed_bytes
        + if placement.head_on_device {
            fp.head_bytes
        } else {
            0
        }
}
impl Gpu {
    /// Uploads a DiT (the whole model: a denoising step needs every layer). Refuses when no
    /// backend runs, the backend has no DiT path, or the weights do not fit.
    pub fn load_dit(&self, model: &DitModel) -> Result<GpuDit, Refusal> {
        self.check("dit.load")?;
        let backend = self.backend.as_ref().expect("checked");
        let t0 = std::time::Instant::now();
        let dev = self
            .gate
            .contain("dit.load", || backend.load_dit(model))
            .map_err(Refusal::logged)?;
        log::debug(&format!(
            "dit: resident on the device (uploaded in {:.2} s, weights {:.2} GB)",
            t0.elapsed().as_secs_f64(),
            dev.weight_bytes() as f64 / 1e9
        ));
        Ok(GpuDit {
            dev,
            gate: self.gate.clone(),
            precision: model.precision,
        })
    }
}

impl Gpu {
    /// Uploads a VAE decoder (whole). Refuses when no backend runs or it has no VAE path.
    pub fn load_vae(&self, model: &crate::vae::VaeModel) -> Result<GpuVae, Refusal> {
        self.check("vae.load")?;
        let backend = self.backend.as_ref().expect("checked");
        let dev = self
            .gate
            .contain("vae.load", || backend.load_vae(model))
            .map_err(Refusal::logged)?;
        Ok(GpuVae {
            dev,
            gate: self.gate.clone(),
        })
    }
}

/// A VAE decoder loaded through the facade; every entry point passes the gate first.
pub struct GpuVae {
    dev: Box<dyn VaeDevice>,
    gate: Arc<Gate>,
}

impl std::fmt::Debug for GpuVae {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GpuVae")
    }
}

impl GpuVae {
    /// See [`VaeDevice::decode`].
    pub fn decode(
        &mut self,
        z: &[f32],
        h: usize,
        w: usize,
        out: &mut [f32],
    ) -> Result<(), Refusal> {
        self.gate
            .run("vae.decode", h * w, || self.dev.decode(z, h, w, out))
    }

    /// See [`VaeDevice::decode_rgb8`].
    pub fn decode_rgb8(
        &mut self,
        z: &[f32],
        h: usize,
        w: usize,
        out: &mut [u8],
    ) -> Result<bool, Refusal> {
        self.gate
            .run("vae.decode", h * w, || self.dev.decode_rgb8(z, h, w, out))
    }

    /// See [`VaeDevice::prepare`].
    pub fn prepare(&mut self, h: usize, w: usize) -> Result<(), Refusal> {
        self.gate.check("vae.prepare")?;
        self.dev.prepare(h, w).map_err(Refusal::logged)
    }
}

/// A DiT loaded through the facade; every entry point passes the gate first. Whole steps run
/// on the device: the activations never leave the card.
pub struct GpuDit {
    dev: Box<dyn DitDevice>,
    gate: Arc<Gate>,
    precision: crate::dit::DitPrecision,
}

impl std::fmt::Debug for GpuDit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GpuDit")
    }
}

impl GpuDit {
    /// See [`DitDevice::condition`].
    pub fn condition(
        &mut self,
        cap: &[f32],
        len: usize,
        rope: RopeRows,
    ) -> Result<CondId, Refusal> {
        self.gate
            .run("dit.condition", len, || self.dev.condition(cap, len, rope))
    }
    /// See [`DitDevice::prepare`].
    pub fn prepare(&mut self, items: &[DitItemSetup], ni: usize) -> Result<(), Refusal> {
        self.gate.check("dit.prepare")?;
        self.dev.prepare(items, ni).map_err(Refusal::logged)
    }
    /// See [`DitDevice::step`].
    pub fn step(&mut self, items: &[DitStepItem], out: &mut [f32]) -> Result<(), Refusal> {
        // Sized by the output: items × patches × patch values.
        self.gate
            .run("dit.step", out.len(), || self.dev.step(items, out))
    }
    pub fn release(&mut self) {
        self.dev.release()
    }
    /// See [`DitDevice::gemm8_planes`].
    pub fn gemm8_planes(&self) -> usize {
        self.dev.gemm8_planes()
    }
    /// See [`DitDevice::weight_bytes`].
    pub fn weight_bytes(&self) -> u64 {
        self.dev.weight_bytes()
    }
    /// The precision asked for at load (what runs may differ: see [`GpuDit::gemm8_planes`]).
    pub fn precision(&self) -> crate::dit::DitPrecision {
        self.precision
    }
}

/// A model loaded through the facade. Every entry point passes the gate first.
pub struct GpuLlm {
    dev: Box<dyn LlmDevice>,
    gate: Arc<Gate>,
}

impl std::fmt::Debug for GpuLlm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuLlm")
            .field("placement", self.dev.placement())
            .finish()
    }
}

impl GpuLlm {
    pub fn placement(&self) -> &Placement {
        self.dev.placement()
    }

    pub fn max_context(&self) -> usize {
        self.dev.max_context()
    }

    /// See [`LlmDevice::decode`].
    pub fn decode(
        &mut self,
        token: u32,
        pos: usize,
        sampler: &Sampler,
        want_logits: bool,
        out: &mut DecodeOutput,
    ) -> Result<(), Refusal> {
        self.gate.run("llm.decode", 1, || {
            self.dev.decode(token, pos, sampler, want_logits, out)
        })
    }

    /// See [`LlmDevice::decode_masked`].
    pub fn decode_masked(
        &mut self,
        token: u32,
        pos: usize,
        sampler: &Sampler,
        mask: &mut dyn FnMut(&mut [u32]),
    ) -> Result<u32, Refusal> {
        // Timed apart from `decode`: its time includes the host's mask.
        self.gate.run("llm.decode_masked", 1, || {
            self.dev.decode_masked(token, pos, sampler, mask)
        })
    }

    /// See [`LlmDevice::prefill`].
    pub fn prefill(
        &mut self,
        tokens: &[u32],
        start: usize,
        logits: Logits,
        out: &mut [f32],
    ) -> Result<(), Refusal> {
        self.gate.run("llm.prefill", tokens.len(), || {
            self.dev.prefill(tokens, start, logits, out)
        })
    }

    /// See [`LlmDevice::forward_layers`].
    pub fn forward_layers(
        &mut self,
        layers: Range<usize>,
        x: &mut [f32],
        t: usize,
        start: usize,
    ) -> Result<(), Refusal> {
        let units = t * layers.len();
        self.gate.run("llm.forward_layers", units, || {
            self.dev.forward_layers(layers, x, t, start)
        })
    }

    /// See [`LlmDevice::head`].
    pub fn head(&mut self, x: &[f32], t: usize, logits: &mut [f32]) -> Result<(), Refusal> {
        self.gate.run("llm.head", t, || self.dev.head(x, t, logits))
    }

    /// See [`LlmDevice::kv_block_bytes`].
    pub fn kv_block_bytes(&self, block_size: usize) -> u64 {
        self.dev.kv_block_bytes(block_size)
    }

    /// See [`LlmDevice::kv_pool`].
    pub fn kv_pool(
        &mut self,
        bytes: u64,
        block_size: usize,
    ) -> Result<crate::llm::batch::PoolShape, Refusal> {
        self.gate
            .run("llm.kv_pool", 1, || self.dev.kv_pool(bytes, block_size))
    }

    /// See [`LlmDevice::batch_step`].
    pub fn batch_step(
        &mut self,
        seqs: &[crate::llm::batch::BatchSeq],
        out: crate::llm::batch::BatchOut,
    ) -> Result<(), Refusal> {
        // Sized by rows and by the keys they attend to, so that a step at a long context is
        // not held against the best step of as many rows at a short one.
        let keys: usize = seqs
            .iter()
            .map(|s| s.tokens.len() * (s.start + s.tokens.len()))
            .sum();
        let units = crate::llm::batch::rows(seqs) + keys / 64;
        self.gate
            .run("llm.batch_step", units, || self.dev.batch_step(seqs, out))
    }
}

#[cfg(test)]
mod tests;
