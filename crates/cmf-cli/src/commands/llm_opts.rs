//! Flags shared by `cmf run`, `cmf bench` and `cmf ppl`: threads, KV-cache element type, and the
//! GPU (`--gpu`, `--gpu-layers`; see docs/gpu.md). `resolve_gpu_mode` serves `cmf imagine` too.

use crate::exit::UsageError;
use cmf_kernels::KvDtype;

#[derive(clap::Args, Debug, Clone)]
pub struct EngineOpts {
    /// Worker threads for the kernels (default: all available cores).
    #[arg(short = 't', long, value_name = "N")]
    pub threads: Option<usize>,
    /// KV-cache element type: f16 (half the memory and bandwidth) or f32 (exact); the GPU keeps the
    /// same (bf16 as f32).
    #[arg(long = "kv-type", value_name = "TYPE", default_value = "f16")]
    pub kv_type: String,
    /// GPU backend: auto (CUDA when a device answers, else the CPU), off, cuda (required).
    /// Default: $CMF_GPU (0, 1, cuda), else auto.
    #[arg(long = "gpu", value_name = "MODE")]
    pub gpu: Option<String>,
    /// Layers on the GPU, e.g. 0-19,30-39 (default: $CMF_GPU_LAYERS, else all that fit).
    #[arg(long = "gpu-layers", value_name = "RANGES")]
    pub gpu_layers: Option<String>,
}

impl EngineOpts {
    /// The model on the GPU when the facade opens a device and the whole model fits (`ctx`
    /// positions of KV cache), else None (the CPU runs it, and a note says so). LLM commands
    /// place the whole model or none of it: `--gpu-layers` naming only some layers is a usage
    /// error. `--gpu cuda` without a device, or with a model it cannot hold, is an error.
    pub fn gpu_model(
        &self,
        model: &cmf_llm::Model,
        ctx: usize,
    ) -> anyhow::Result<Option<cmf_llm::gpu::GpuModel>> {
        use cmf_gpu::facade::{Gpu, GpuMode};
        let (mode, layers) = self.gpu_settings()?;
        let n = model.config.num_layers;
        if let Some(set) = &layers {
            let on = (0..n).filter(|&l| set.contains(l)).count();
            if on == 0 {
                return Ok(None);
            }
            if on < n {
                return Err(UsageError(format!(
                    "--gpu-layers: {on} of the model's {n} layers named; LLM commands run the whole \
                     model on the device or none of it (all, none)"
                ))
                .into());
            }
        }
        let gpu = Gpu::open(mode)?;
        if !gpu.is_active() {
            return Ok(None);
        }
        match cmf_llm::gpu::GpuModel::try_load_with(&gpu, model, ctx, None, self.device_kv()) {
            Ok(g) => Ok(Some(g)),
            Err(why) if mode == GpuMode::Cuda => Err(UsageError(format!(
                "--gpu cuda: the model cannot run on the device with a {ctx}-token context: {why}"
            ))
            .into()),
            Err(why) => {
                eprintln!(
                    "note: the GPU cannot hold this model with a {ctx}-token context ({why}); it runs on the CPU"
                );
                Ok(None)
            }
        }
    }

    /// The batched engine's device (`--parallel`): the whole model and a KV pool of `pool` on
    /// the GPU when `--gpu` opens one, else None (the CPU runs the batch; a note says why when a
    /// device answered). `--gpu cuda` with a model the device cannot hold is an error.
    pub fn batch_device(
        &self,
        model: &cmf_llm::Model,
        ctx: usize,
        rows: usize,
        pool: cmf_llm::batch::PoolSize,
    ) -> anyhow::Result<Option<cmf_llm::batch::DeviceBatch>> {
        use cmf_gpu::facade::{Gpu, GpuMode};
        let (mode, layers) = self.gpu_settings()?;
        if mode == GpuMode::Off {
            return Ok(None);
        }
        if layers.is_some() {
            return Err(UsageError(
                "--parallel: the batched engine places the whole model (--gpu-layers is not taken)"
                    .into(),
            )
            .into());
        }
        // As `gpu_model`: the note only where a device would have been used.
        let cpu_only = cmf_llm::gpu::cpu_only(model);
        if let (Some(why), GpuMode::Cuda) = (cpu_only, mode) {
            eprintln!("note: {why}: the batched engine runs on the CPU");
            return Ok(None);
        }
        let gpu = Gpu::open(mode)?;
        if !gpu.is_active() {
            return Ok(None);
        }
        if let Some(why) = cpu_only {
            eprintln!("note: {why}: the batched engine runs on the CPU");
            return Ok(None);
        }
        let block = cmf_llm::batch::BatchConfig::BLOCK_SIZE;
        let kv = self.device_kv();
        match cmf_llm::batch::DeviceBatch::load(&gpu, model, ctx, rows, block, pool, kv) {
            Ok(d) => Ok(Some(d)),
            Err(why) if mode == GpuMode::Cuda => Err(UsageError(format!(
                "--gpu cuda: the batched engine cannot run on the device: {why}"
            ))
            .into()),
            Err(why) => {
                eprintln!("note: the batched engine runs on the CPU: {why}");
                Ok(None)
            }
        }
    }

    /// `--gpu` and `--gpu-layers` (or their environment defaults) resolved, without opening a
    /// device; a bad value is a usage error.
    pub fn gpu_settings(
        &self,
    ) -> anyhow::Result<(cmf_gpu::facade::GpuMode, Option<cmf_gpu::facade::LayerSet>)> {
        use cmf_gpu::facade::LayerSet;
        let mode = resolve_gpu_mode(self.gpu.as_deref())?;
        let layers =
            LayerSet::resolve(self.gpu_layers.as_deref()).map_err(|e| UsageError(e.to_string()))?;
        Ok((mode, layers))
    }

    /// The generation engine: [`cmf_llm::gpu::GpuEngine`] when the model runs on the GPU,
    /// else the CPU engine.
    pub fn engine<'m, 'a: 'm>(
        &self,
        model: &'m cmf_llm::Model<'a>,
        ctx: usize,
        kv_type: cmf_kernels::KvDtype,
    ) -> anyhow::Result<Box<dyn cmf_llm::engine::Engine + 'm>> {
        Ok(match self.gpu_model(model, ctx)? {
            Some(g) => Box::new(cmf_llm::gpu::GpuEngine::new(model, g, ctx, kv_type)),
            None => Box::new(cmf_llm::engine::CpuEngine::new(model, ctx, kv_type)?),
        })
    }

    /// The device KV cache's precision for `--kv-type` (`cmf_llm::gpu::device_kv`); the flag
    /// is checked by [`Self::apply`] first, so an unknown name cannot reach here (f16 if it does).
    fn device_kv(&self) -> cmf_gpu::llm::KvPrecision {
        cmf_llm::gpu::device_kv(KvDtype::from_name(&self.kv_type).unwrap_or(KvDtype::F16))
    }

    pub fn apply(&self) -> anyhow::Result<KvDtype> {
        if let Some(n) = self.threads {
            cmf_kernels::set_num_threads(thread_count(n)?);
        }
        KvDtype::from_name(&self.kv_type).ok_or_else(|| {
            UsageError(format!(
                "--kv-type {}: expected f16, bf16 or f32",
                self.kv_type
            ))
            .into()
        })
    }
}

/// A `--threads` value checked against the machine: 0 is a usage error; more than the hardware
/// threads is clamped to them with a note (more workers than cores only adds contention, and
/// each costs a stack and a slice of every per-thread buffer).
pub fn thread_count(n: usize) -> anyhow::Result<usize> {
    if n == 0 {
        return Err(UsageError("--threads must be at least 1".into()).into());
    }
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    if n > cores {
        eprintln!(
            "note: --threads {n} is more than the {cores} hardware threads here; using {cores}"
        );
        return Ok(cores);
    }
    Ok(n)
}

/// A `--gpu` value (or, without one, `CMF_GPU`) as a mode; a bad value is a usage error.
pub fn resolve_gpu_mode(flag: Option<&str>) -> anyhow::Result<cmf_gpu::facade::GpuMode> {
    use cmf_gpu::facade::GpuMode;
    let flag = flag
        .map(str::parse::<GpuMode>)
        .transpose()
        .map_err(|e| UsageError(e.to_string()))?;
    Ok(GpuMode::resolve(flag).map_err(|e| UsageError(e.to_string()))?)
}
