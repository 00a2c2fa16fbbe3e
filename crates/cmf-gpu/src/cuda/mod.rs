//! The CUDA backend: cudarc with dynamic loading (nothing CUDA is needed to build; a machine
//! without the driver gets a clear "no device" instead of a panic), NVRTC kernels compiled to
//! CUBIN for the device's arch and cached on disk, cuBLAS for prefill GEMMs.
//!
//! Layout: `device` (context, stream, buffers, launches, graph capture), `nvrtc` (compile +
//! cache), `prebuilt` (kernel images embedded at build time), `kernels` (sources and handles; the
//! `.cu` files live in `kernels/`), `weights` (codec planes on the device), `matvec` (host side of
//! the decode matvec), `blas` (cuBLAS GEMM), `lt` (cuBLASLt GEMM, bf16 and e4m3), `fp8` (e4m3
//! rows and the FP8 GEMM), `int8` (s8 rows and the int8 GEMM), `llm` (the resident model: decode graph, prefill, hybrid layers),
//! `dit` / `dit_rows` (the Z-Image DiT), `vae` / `cudnn` (the Flux VAE decoder).

pub mod blas;
pub mod cudnn;
pub mod device;
pub mod dit;
pub mod dit_rows;
pub mod fp8;
pub mod int8;
pub mod kernels;
pub mod llm;
pub mod lt;
pub mod matvec;
pub mod nvrtc;
pub mod prebuilt;
mod staging;
pub mod tma;
pub mod vae;
pub mod weights;

use crate::facade::{Backend, DeviceInfo, Footprint, LlmDevice, MemStats, Placement, Refusal};
use crate::llm::{LlmModel, LlmOptions};
use device::Dev;
use kernels::CommonKernels;
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

    fn load_dit(&self, model: &crate::dit::DitModel) -> Result<Box<dyn crate::DitDevice>, Refusal> {
        let dit = dit::CudaDit::load(self, model)?;
        crate::facade::log::debug(&format!("dit loaded; {}", staging::report()));
        Ok(Box::new(dit))
    }

    fn load_vae(
        &self,
        model: &crate::vae::VaeModel,
    ) -> Result<Box<dyn crate::facade::VaeDevice>, Refusal> {
        Ok(Box::new(vae::CudaVae::load(self, model)?))
    }
}

impl crate::facade::VaeDevice for vae::CudaVae {
    fn decode(&mut self, z: &[f32], h: usize, w: usize, out: &mut [f32]) -> Result<(), Refusal> {
        vae::CudaVae::decode(self, z, h, w, out)
    }

    fn decode_rgb8(
        &mut self,
        z: &[f32],
        h: usize,
        w: usize,
        out: &mut [u8],
    ) -> Result<bool, Refusal> {
        vae::CudaVae::decode_rgb8(self, z, h, w, out)
    }

    fn prepare(&mut self, h: usize, w: usize) -> Result<(), Refusal> {
        vae::CudaVae::prepare(self, h, w)
    }
}

#[cfg(test)]
#[path = "../../../../test-support/gpu.rs"]
mod gpu_skip;

#[cfg(test)]
mod tests {
    use super::gpu_skip;

    /// Compiles every kernel source for sm_90 with NVRTC. Needs libnvrtc, not a GPU.
    #[test]
    fn nvrtc_compiles_every_kernel() {
        if !super::nvrtc::available() {
            gpu_skip::skip_no_device("libnvrtc not found");
            return;
        }
        let portable = super::kernels::all_sources()
            .into_iter()
            .map(|s| (s, "sm_90"));
        let hopper = super::kernels::hopper_sources()
            .into_iter()
            .map(|s| (s, "sm_90a"));
        for ((name, src, defs), arch) in portable.chain(hopper) {
            let full = super::kernels::full_source(src);
            let c =
                super::nvrtc::compile(name, &full, arch, &defs).unwrap_or_else(|e| panic!("{e}"));
            assert!(!c.cubin.is_empty());
            if !c.log.is_empty() {
                eprintln!("{name} {defs:?} ({arch}):\n{}", c.log);
            }
        }
    }
}
