//! cmf-gpu: the one door through which every GPU use of the engine passes.
//!
//! Two layers:
//! - [`facade`]: CPU-testable policy. Which backend runs (`--gpu auto|off|cuda`, `CMF_GPU`),
//!   honest refusal (a device entry point does the whole job or refuses before touching any
//!   output, and the caller runs the CPU path), layer placement and the VRAM budget, the
//!   `cpu_scope` / `pause_gpu` guards, device and memory counters.
//! - [`cuda`]: the CUDA backend (cudarc with dynamic loading, NVRTC kernels compiled to CUBIN
//!   for the device's arch and cached on disk, cuBLAS for prefill GEMMs).
//!
//! Models describe themselves to the backend through the neutral [`llm`] types (geometry plus
//! per-layer [`cmf_kernels::Weight`]s), so this crate does not depend on any model crate.
//!
//! The contract is written up for users in `docs/gpu.md`.

// `x % n == 0` rather than `is_multiple_of` (1.87): the workspace's rust-version is 1.85.
#![allow(clippy::manual_is_multiple_of)]

pub mod cuda;
pub mod dit;
pub mod facade;
pub mod llm;
pub mod vae;

pub use facade::{
    cpu_scope, pause_gpu, Backend, DeviceInfo, DitDevice, Gpu, GpuDit, GpuError, GpuMode, GpuVae,
    LayerSet, LlmDevice, MemStats, Placement, Refusal, RefusalReason,
};
pub use llm::{
    DecodeOutput, LayerWeights, LlmModel, LlmOptions, LlmSpec, Logits, RopeSpec, Sampler,
};
