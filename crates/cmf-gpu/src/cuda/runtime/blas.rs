//! cuBLAS for the prefill GEMMs: Y[T, rows] (+)= X[T, K] · Wᵀ, row-major.
//!
//! In cuBLAS's column-major terms that is Yᵀ (rows × T, ldc) = W (rows × K, stored as the
//! column-major K × rows matrix Wᵀ, so op = T, lda = K) · Xᵀ (K × T, ldb = K). bf16 operands
//! with f32 accumulation and f32 output (tensor cores); f32 SGEMM (no TF32) for f32/f16 models.

use super::device::{DResult, Dev, DevError};
use cudarc::cublas::sys as cb;
use std::ffi::c_void;

/// Whether libcublas can be loaded (never panics).
pub fn available() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cb::is_culib_present() }
}

pub struct Blas {
    handle: cb::cublasHandle_t,
}

// SAFETY: the handle is used from one thread at a time (the owning model is not Sync) and
// cuBLAS handles may move between threads.
unsafe impl Send for Blas {}

fn check(s: cb::cublasStatus_t, what: &str) -> DResult<()> {
    if s == cb::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(DevError(format!("{what}: {s:?}")))
    }
}

impl Blas {
    pub fn new(dev: &Dev) -> DResult<Blas> {
        if !available() {
            return Err(DevError("libcublas is not installed".into()));
        }
        dev.bind_to_thread()?;
        let mut handle: cb::cublasHandle_t = std::ptr::null_mut();
        // SAFETY: writes one handle.
        check(unsafe { cb::cublasCreate_v2(&mut handle) }, "cublasCreate")?;
        let blas = Blas { handle };
        // SAFETY: live handle and stream.
        check(
            unsafe { cb::cublasSetStream_v2(handle, dev.stream.cu_stream() as cb::cudaStream_t) },
            "cublasSetStream",
        )?;
        // Plain FP32 for SGEMM: no TF32 (parity with the CPU path on f32 models).
        check(
            unsafe { cb::cublasSetMathMode(handle, cb::cublasMath_t::CUBLAS_DEFAULT_MATH) },
            "cublasSetMathMode",
        )?;
        Ok(blas)
    }

    /// y[t, col0 + r] (+)= Σ_k x[t, k] · w[r, k] for r < rows, t < t_n. `w` is `rows × k`
    /// row-major; `bf16` selects bf16 operands (else f32).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &self,
        bf16: bool,
        w: u64,
        x: u64,
        y: u64,
        rows: usize,
        t_n: usize,
        k: usize,
        ldc: usize,
        accumulate: bool,
    ) -> DResult<()> {
        let alpha = 1f32;
        let beta = if accumulate { 1f32 } else { 0f32 };
        let (m, n, kk) = (rows as i32, t_n as i32, k as i32);
        if bf16 {
            return self.gemm_ex(
                w,
                x,
                y,
                (rows, t_n, k, ldc),
                beta,
                cb::cudaDataType::CUDA_R_32F,
            );
        }
        // SAFETY: pointers are device buffers sized by the caller for these shapes.
        let s = unsafe {
            cb::cublasSgemm_v2(
                self.handle,
                cb::cublasOperation_t::CUBLAS_OP_T,
                cb::cublasOperation_t::CUBLAS_OP_N,
                m,
                n,
                kk,
                &alpha,
                w as *const f32,
                kk,
                x as *const f32,
                kk,
                &beta,
                y as *mut f32,
                ldc as i32,
            )
        };
        check(s, "cuBLAS SGEMM")
    }
}

impl Blas {
    /// As [`Blas::gemm`] with bf16 operands, writing y as bf16 (f32 accumulation), no accumulate.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_bf16_out(
        &self,
        w: u64,
        x: u64,
        y: u64,
        rows: usize,
        t_n: usize,
        k: usize,
        ldc: usize,
    ) -> DResult<()> {
        self.gemm_ex(
            w,
            x,
            y,
            (rows, t_n, k, ldc),
            0.0,
            cb::cudaDataType::CUDA_R_16BF,
        )
    }

    /// `y = wᵀ·x (+ beta·y)` with bf16 operands and f32 accumulation, y of type `out`;
    /// `shape` = (rows of w, columns of x, k, ldc), all column-major as cuBLAS sees them.
    fn gemm_ex(
        &self,
        w: u64,
        x: u64,
        y: u64,
        shape: (usize, usize, usize, usize),
        beta: f32,
        out: cb::cudaDataType,
    ) -> DResult<()> {
        let (rows, t_n, k, ldc) = shape;
        let alpha = 1f32;
        // SAFETY: pointers are device buffers sized by the caller for these shapes.
        let s = unsafe {
            cb::cublasGemmEx(
                self.handle,
                cb::cublasOperation_t::CUBLAS_OP_T,
                cb::cublasOperation_t::CUBLAS_OP_N,
                rows as i32,
                t_n as i32,
                k as i32,
                &alpha as *const f32 as *const c_void,
                w as *const c_void,
                cb::cudaDataType::CUDA_R_16BF,
                k as i32,
                x as *const c_void,
                cb::cudaDataType::CUDA_R_16BF,
                k as i32,
                &beta as *const f32 as *const c_void,
                y as *mut c_void,
                out,
                ldc as i32,
                cb::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cb::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        check(s, "cuBLAS GEMM")
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: created in new(), destroyed once.
        unsafe {
            cb::cublasDestroy_v2(self.handle);
        }
    }
}
