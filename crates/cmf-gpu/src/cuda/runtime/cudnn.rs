//! cuDNN for the VAE's 3×3 convolutions: implicit-GEMM kernels read the NHWC input in place, where
//! the im2col path (cuda/vae/kernels/vae.cu) writes and re-reads nine copies of it (11 of a 1024² decode's
//! 46 ms under ncu, BENCH.md). Optional: loaded at run time like the other CUDA libraries, and the
//! decoder keeps the im2col path where the library is missing or refuses a shape.
//!
//! One convolution: x `[H, W, C_in]` bf16 (NHWC, batch 1) ⊛ w `[C_out, 3, 3, C_in]` bf16 (KRSC: the
//! decoder's tap-major weight rows as they are) → y `[H, W, C_out]` bf16, f32 accumulation, zero
//! padding 1, no bias. cuDNN's legacy API takes bf16 x, w and y only (y in f32 is not a supported
//! configuration), so the caller widens y.

use super::device::{DResult, Dev, DevError};
use cudarc::cudnn::sys as dnn;
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;

/// Whether libcudnn can be loaded (never panics).
pub fn available() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { dnn::is_culib_present() }
}

fn check(s: dnn::cudnnStatus_t, what: &str) -> DResult<()> {
    if s == dnn::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(DevError(format!("cuDNN {what}: {s:?}")))
    }
}

/// (height, width, C_in, C_out)
pub type ConvShape = (usize, usize, usize, usize);

/// One shape's descriptors and the algorithm cuDNN's heuristics ranked first.
struct Plan {
    x: dnn::cudnnTensorDescriptor_t,
    y: dnn::cudnnTensorDescriptor_t,
    w: dnn::cudnnFilterDescriptor_t,
    conv: dnn::cudnnConvolutionDescriptor_t,
    algo: dnn::cudnnConvolutionFwdAlgo_t,
    workspace: usize,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: created once in Cudnn::plan (null where creation stopped early), destroyed once.
        unsafe {
            if !self.x.is_null() {
                dnn::cudnnDestroyTensorDescriptor(self.x);
            }
            if !self.y.is_null() {
                dnn::cudnnDestroyTensorDescriptor(self.y);
            }
            if !self.w.is_null() {
                dnn::cudnnDestroyFilterDescriptor(self.w);
            }
            if !self.conv.is_null() {
                dnn::cudnnDestroyConvolutionDescriptor(self.conv);
            }
        }
    }
}

pub struct Cudnn {
    handle: dnn::cudnnHandle_t,
    plans: RefCell<HashMap<ConvShape, Plan>>,
}

// SAFETY: used from one thread at a time (its owner is not Sync); cuDNN handles may move between
// threads.
unsafe impl Send for Cudnn {}

impl Drop for Cudnn {
    fn drop(&mut self) {
        self.plans.borrow_mut().clear();
        // SAFETY: created in new(), destroyed once, after its plans.
        unsafe {
            dnn::cudnnDestroy(self.handle);
        }
    }
}

impl Cudnn {
    /// A handle on the device's stream, or an error when libcudnn is missing or fails.
    pub fn new(dev: &Dev) -> DResult<Cudnn> {
        if !available() {
            return Err(DevError("libcudnn is not installed".into()));
        }
        dev.bind_to_thread()?;
        let mut handle: dnn::cudnnHandle_t = std::ptr::null_mut();
        // SAFETY: writes one handle.
        check(unsafe { dnn::cudnnCreate(&mut handle) }, "create")?;
        let c = Cudnn {
            handle,
            plans: RefCell::new(HashMap::new()),
        };
        // SAFETY: live handle and stream.
        check(
            unsafe { dnn::cudnnSetStream(handle, dev.stream.cu_stream() as dnn::cudaStream_t) },
            "set stream",
        )?;
        Ok(c)
    }

    /// Workspace bytes the shape's algorithm needs (plans it on first use).
    pub fn workspace_bytes(&self, shape: ConvShape) -> DResult<usize> {
        self.with_plan(shape, |p| Ok(p.workspace))
    }

    /// y = conv3×3(x, w) for `shape`, with `ws` of at least [`Cudnn::workspace_bytes`] bytes.
    pub fn conv3(&self, shape: ConvShape, x: u64, w: u64, y: u64, ws: u64) -> DResult<()> {
        let (one, zero) = (1f32, 0f32);
        self.with_plan(shape, |p| {
            // SAFETY: device pointers sized by the caller for `shape`; descriptors live in `p`.
            check(
                unsafe {
                    dnn::cudnnConvolutionForward(
                        self.handle,
                        &one as *const f32 as *const c_void,
                        p.x,
                        x as *const c_void,
                        p.w,
                        w as *const c_void,
                        p.conv,
                        p.algo,
                        ws as *mut c_void,
                        p.workspace,
                        &zero as *const f32 as *const c_void,
                        p.y,
                        y as *mut c_void,
                    )
                },
                "convolution forward",
            )
        })
    }

    fn with_plan<T>(&self, shape: ConvShape, f: impl FnOnce(&Plan) -> DResult<T>) -> DResult<T> {
        if !self.plans.borrow().contains_key(&shape) {
            let p = self.plan(shape)?;
            self.plans.borrow_mut().insert(shape, p);
        }
        f(&self.plans.borrow()[&shape])
    }

    fn plan(&self, (h, w, cin, cout): ConvShape) -> DResult<Plan> {
        let dim = |v: usize| {
            i32::try_from(v).map_err(|_| DevError(format!("cuDNN: dimension {v} too large")))
        };
        let (hh, ww, ci, co) = (dim(h)?, dim(w)?, dim(cin)?, dim(cout)?);
        let mut p = Plan {
            x: std::ptr::null_mut(),
            y: std::ptr::null_mut(),
            w: std::ptr::null_mut(),
            conv: std::ptr::null_mut(),
            algo: dnn::cudnnConvolutionFwdAlgo_t::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM,
            workspace: 0,
        };
        let bf16 = dnn::cudnnDataType_t::CUDNN_DATA_BFLOAT16;
        let nhwc = dnn::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC;
        // SAFETY: each call initialises or configures a descriptor owned by `p` (destroyed by
        // its Drop, also on an early return).
        unsafe {
            check(dnn::cudnnCreateTensorDescriptor(&mut p.x), "x descriptor")?;
            check(
                dnn::cudnnSetTensor4dDescriptor(p.x, nhwc, bf16, 1, ci, hh, ww),
                "x shape",
            )?;
            check(dnn::cudnnCreateTensorDescriptor(&mut p.y), "y descriptor")?;
            check(
                dnn::cudnnSetTensor4dDescriptor(p.y, nhwc, bf16, 1, co, hh, ww),
                "y shape",
            )?;
            check(dnn::cudnnCreateFilterDescriptor(&mut p.w), "w descriptor")?;
            check(
                dnn::cudnnSetFilter4dDescriptor(p.w, bf16, nhwc, co, ci, 3, 3),
                "w shape",
            )?;
            check(
                dnn::cudnnCreateConvolutionDescriptor(&mut p.conv),
                "conv descriptor",
            )?;
            check(
                dnn::cudnnSetConvolution2dDescriptor(
                    p.conv,
                    1,
                    1,
                    1,
                    1,
                    1,
                    1,
                    dnn::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                    dnn::cudnnDataType_t::CUDNN_DATA_FLOAT,
                ),
                "conv setup",
            )?;
            // Tensor cores: the descriptor's default math type ranks only the FP32-pipe kernels
            // for bf16 (measured on the H200: 10 ms for a 512 → 512 conv at 256², 6× the
            // im2col + cuBLAS decoder).
            check(
                dnn::cudnnSetConvolutionMathType(
                    p.conv,
                    dnn::cudnnMathType_t::CUDNN_TENSOR_OP_MATH,
                ),
                "tensor-op math",
            )?;
            // The heuristics' ranking: cuDNN's timed trial of every algorithm
            // (cudnnFindConvolutionForwardAlgorithm) would cost the first decode seconds.
            const WANT: usize = 8;
            let mut perf: [dnn::cudnnConvolutionFwdAlgoPerf_t; WANT] = std::mem::zeroed();
            let mut got = 0i32;
            check(
                dnn::cudnnGetConvolutionForwardAlgorithm_v7(
                    self.handle,
                    p.x,
                    p.w,
                    p.conv,
                    p.y,
                    WANT as i32,
                    &mut got,
                    perf.as_mut_ptr(),
                ),
                "algorithm ranking",
            )?;
            if crate::facade::log::debug_enabled() {
                let list: Vec<String> = perf[..(got.max(0) as usize).min(WANT)]
                    .iter()
                    .map(|r| {
                        format!(
                            "{:?}/{:?}/{:?} {:.3} ms {} B",
                            r.algo, r.mathType, r.status, r.time, r.memory
                        )
                    })
                    .collect();
                crate::facade::log::debug(&format!(
                    "cuDNN conv {cin}→{cout} at {h}×{w} (heuristics): {}",
                    list.join(", ")
                ));
            }
            let best = perf[..(got.max(0) as usize).min(WANT)]
                .iter()
                .find(|r| r.status == dnn::cudnnStatus_t::CUDNN_STATUS_SUCCESS)
                .ok_or_else(|| {
                    DevError(format!(
                        "cuDNN: no algorithm for a 3×3 conv of {cin} → {cout} channels at {h}×{w}"
                    ))
                })?;
            check(
                dnn::cudnnSetConvolutionMathType(p.conv, best.mathType),
                "math type",
            )?;
            p.algo = best.algo;
            let mut bytes = 0usize;
            check(
                dnn::cudnnGetConvolutionForwardWorkspaceSize(
                    self.handle,
                    p.x,
                    p.w,
                    p.conv,
                    p.y,
                    p.algo,
                    &mut bytes,
                ),
                "workspace size",
            )?;
            p.workspace = bytes;
        }
        Ok(p)
    }
}
