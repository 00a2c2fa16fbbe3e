//! The CUDA runtime every model uses; it knows no model (nothing here imports `cuda::llm`,
//! `cuda::dit`, `cuda::vae` or the model descriptions).
//!
//! - `device`: context, stream, buffers, launches, graph capture; `staging`: pinned host
//!   buffers behind uploads and readbacks; `error`: the error every call returns.
//! - `kernels`: compiling and loading kernel modules, and the kernel sources more than one model
//!   compiles (`kernels/`); `func`: a kernel entry point; `source`: what NVRTC compiles and the
//!   key of a compile; `nvrtc`: the compiler and its disk cache; `prebuilt`: the images embedded
//!   at build time.
//! - `blas` (cuBLAS GEMM), `lt` (cuBLASLt GEMM, bf16 and e4m3), `fp8` (e4m3 rows and the FP8
//!   GEMM), `int8` (s8 rows and the int8 GEMM), `cudnn` (convolutions), `tma` (tensor-map
//!   descriptors).
//! - `weights`: codec planes on the device; `matvec`: the decode matvec over them.

pub mod blas;
pub(crate) mod cudnn;
pub mod device;
mod error;
pub mod fp8;
mod func;
pub mod int8;
pub(crate) mod kernels;
pub mod lt;
pub mod matvec;
pub mod nvrtc;
pub mod prebuilt;
mod source;
pub(crate) mod staging;
pub(crate) mod tma;
pub mod weights;
