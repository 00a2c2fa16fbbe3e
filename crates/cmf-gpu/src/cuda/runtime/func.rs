//! A kernel entry point, as launches take it.

use super::error::{Ctx, DResult};
use cudarc::driver::{sys, CudaFunction};

/// A kernel entry point.
#[derive(Clone)]
pub struct Func {
    pub raw: sys::CUfunction,
    _keep: CudaFunction,
}

// SAFETY: a CUfunction is a handle valid in its context from any thread; the module it belongs
// to is kept alive by `_keep`.
unsafe impl Send for Func {}
unsafe impl Sync for Func {}

impl Func {
    /// The entry point of a loaded function (which keeps its module alive).
    pub(crate) fn new(f: CudaFunction) -> Func {
        Func {
            raw: f.cu_function(),
            _keep: f,
        }
    }

    /// Allows `bytes` of dynamic shared memory per block (beyond the 48 KiB default).
    pub fn allow_smem(&self, bytes: usize) -> DResult<()> {
        self._keep
            .set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
            .ctx(|| format!("allowing {bytes} B of shared memory"))
    }

    /// Statically declared shared memory of the kernel.
    pub fn static_smem(&self) -> usize {
        self._keep.shared_size_bytes().unwrap_or(0).max(0) as usize
    }

    pub fn regs(&self) -> i32 {
        self._keep.num_regs().unwrap_or(-1)
    }

    pub fn local_bytes(&self) -> i32 {
        self._keep.local_size_bytes().unwrap_or(-1)
    }
}
