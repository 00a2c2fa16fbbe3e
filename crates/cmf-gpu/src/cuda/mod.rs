//! The CUDA backend: cudarc with dynamic loading (nothing CUDA is needed to build; a machine
//! without the driver gets a clear "no device" instead of a panic), NVRTC kernels compiled to
//! CUBIN for the device's arch and cached on disk, cuBLAS for prefill GEMMs.
//!
//! Layout (docs/ARCHITECTURE.md has the rules):
//! - [`runtime`]: what every model uses and that knows no model: the device (context, stream,
//!   buffers, launches, graph capture, staging), kernel loading (NVRTC, the disk cache, the
//!   embedded images), cuBLAS / cuBLASLt / cuDNN, codec planes on the device, and the kernels
//!   more than one model runs (row kernels, attention, matvec, the FP8 and int8 GEMMs).
//! - one folder per model family, each with its own kernels: [`llm`] (the resident language
//!   model: decode graph, prefill, sampling), [`dit`] (the Z-Image DiT), [`vae`] (the FLUX VAE
//!   decoder). A model folder uses the runtime and never another model's folder.
//! - this module: [`CudaBackend`], the facade's [`Backend`] over the runtime and the models, and
//!   [`catalog`], every kernel module by name.

pub mod catalog;
pub mod dit;
pub mod llm;
pub mod runtime;
pub mod vae;

use crate::facade::backend::{Backend, DitDevice, Footprint, LlmDevice, VaeDevice};
use crate::facade::devices::{DeviceInfo, MemStats};
use crate::facade::placement::Placement;
use crate::facade::refusal::Refusal;
use crate::llm::{LlmModel, LlmOptions};
use llm::kernels::CommonKernels;
use runtime::device::{self, Dev};
use runtime::{kernels, nvrtc, staging};
use std::sync::{Arc, Mutex};

pub struct CudaBackend {
    dev: Arc<Dev>,
    /// The shared LLM kernels (matvec, sampling), loaded on first use: a process that runs no
    /// LLM never waits for them, and one that does compiles them beside its model's kernels.
    ck: Mutex<Option<Arc<CommonKernels>>>,
}

impl CudaBackend {
    /// Opens device `ordinal` and starts compiling the shared kernels in the background (a
    /// first run on a machine; later runs find them in the disk cache). Every failure is an
    /// `Err` with the reason, never a panic: no driver library, no device, no NVRTC.
    pub fn open(ordinal: usize) -> Result<CudaBackend, String> {
        let dev = Dev::open(ordinal)?;
        if !nvrtc::available() {
            return Err("libnvrtc (the CUDA runtime compiler) is not installed".into());
        }
        kernels::prefetch(CommonKernels::jobs(&dev));
        Ok(CudaBackend {
            dev: Arc::new(dev),
            ck: Mutex::new(None),
        })
    }

    pub fn device(&self) -> &Arc<Dev> {
        &self.dev
    }

    /// The shared kernels, compiled (or taken from the cache) and loaded on the first call.
    pub fn kernels(&self) -> Result<Arc<CommonKernels>, device::DevError> {
        let mut ck = self.ck.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(k) = ck.as_ref() {
            return Ok(k.clone());
        }
        let k = Arc::new(CommonKernels::load(&self.dev)?);
        *ck = Some(k.clone());
        Ok(k)
    }

    /// Loads a model as a concrete [`llm::CudaLlm`] (benchmarks and tests that want its extras).
    pub fn load_cuda_llm(
        &self,
        model: &LlmModel,
        opts: &LlmOptions,
        placement: &Placement,
    ) -> Result<llm::CudaLlm, Refusal> {
        self.load_cuda_llm_tuned(model, opts, placement, llm::DecodeTuning::default())
    }

    /// [`Self::load_cuda_llm`] with decode-attention tuning values other than the defaults
    /// (tests).
    pub fn load_cuda_llm_tuned(
        &self,
        model: &LlmModel,
        opts: &LlmOptions,
        placement: &Placement,
        tuning: llm::DecodeTuning,
    ) -> Result<llm::CudaLlm, Refusal> {
        model.validate()?;
        llm::CudaLlm::load(
            self.dev.clone(),
            || self.kernels(),
            model,
            opts,
            placement,
            tuning,
        )
    }
}

impl Backend for CudaBackend {
    fn info(&self) -> DeviceInfo {
        DeviceInfo {
            name: self.dev.name.clone(),
            ordinal: self.dev.ordinal,
            count: self.dev.count,
            arch: self.dev.arch(),
            total_bytes: self.dev.total_bytes,
            free_bytes: self.dev.free_bytes(),
        }
    }

    fn stats(&self) -> &MemStats {
        &self.dev.stats
    }

    fn llm_footprint(&self, model: &LlmModel, opts: &LlmOptions) -> Result<Footprint, Refusal> {
        llm::footprint(&self.dev, model, opts)
    }

    fn load_llm(
        &self,
        model: &LlmModel,
        opts: &LlmOptions,
        placement: &Placement,
    ) -> Result<Box<dyn LlmDevice>, Refusal> {
        let llm = self.load_cuda_llm(model, opts, placement)?;
        crate::facade::log::debug(&format!("llm loaded; {}", staging::report()));
        Ok(Box::new(llm))
    }

    fn load_dit(&self, model: &crate::dit::DitModel) -> Result<Box<dyn DitDevice>, Refusal> {
        let dit = dit::CudaDit::load(&self.dev, model)?;
        crate::facade::log::debug(&format!("dit loaded; {}", staging::report()));
        Ok(Box::new(dit))
    }

    fn load_vae(&self, model: &crate::vae::VaeModel) -> Result<Box<dyn VaeDevice>, Refusal> {
        Ok(Box::new(vae::CudaVae::load(&self.dev, model)?))
    }
}
