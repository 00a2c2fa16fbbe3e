//! FP8 (e4m3) GEMMs on Hopper through cuBLASLt, for the DiT's FP8 path (`--dit-precision fp8`).
//!
//! `out[m, n]` (bf16 or f32, row stride `ldc`) = `xs[m] · ws[n] · Σ_k x[m, k] · w[n, k]`, with `x` and
//! `w` e4m3, row-major, and one f32 scale per row of each (`quant_rows_e4m3`, kernels/fp8.cu:
//! scale = row amax / 448). In cuBLASLt's column-major terms: D (n × m, ld `ldc`) = op(A) · B
//! with A = `w` seen as k × n and op = T (FP8 on Hopper wants the "TN" form), B = `x` seen as
//! k × m; the scales are outer vectors, A's along D's rows (n) and B's along its columns (m)
//! (`CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F`, cuBLASLt 12.9 and later).
//!
//! Status (H200, 2026-11-30; BENCH.md): `cuda-test fp8` passes (rel err 1.7e-3 against the exact
//! product of its quantised inputs); a 1024² DiT step takes 93 ms in bf16, 68 ms with
//! `--dit-precision fp8` and 64 ms with `fp8-fast`, with the row kernels writing e4m3 directly
//! (cuda/dit_rows.rs, kernels/e4m3.cuh); images 38.0–38.8 dB PSNR from the bf16 ones on the
//! random-weight full-size pack.

use super::device::{Arg, DBuf, DResult, Dev, DevError};
use super::kernels::{Func, Module, FP8};
use cudarc::cublaslt::sys as lt;
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

/// cuBLASLt workspace: what its heuristics may use for split-K and the like.
const WORKSPACE_BYTES: usize = 32 << 20;

fn check(s: lt::cublasStatus_t, what: &str) -> DResult<()> {
    if s == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(DevError(format!("{what}: {s:?}")))
    }
}

/// One GEMM shape's descriptors and the algorithm cuBLASLt chose for it.
struct Plan {
    desc: lt::cublasLtMatmulDesc_t,
    a: lt::cublasLtMatrixLayout_t,
    b: lt::cublasLtMatrixLayout_t,
    d: lt::cublasLtMatrixLayout_t,
    algo: lt::cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: created once in Fp8Gemm::plan, destroyed once here.
        unsafe {
            lt::cublasLtMatrixLayoutDestroy(self.a);
            lt::cublasLtMatrixLayoutDestroy(self.b);
            lt::cublasLtMatrixLayoutDestroy(self.d);
            lt::cublasLtMatmulDescDestroy(self.desc);
        }
    }
}

/// (n, m, k, ldc, fast accumulation, f32 output)
type ShapeKey = (usize, usize, usize, usize, bool, bool);

/// Where [`Fp8Gemm::gemm`] writes: bf16 or f32 rows.
#[derive(Clone, Copy)]
pub enum Fp8Out {
    Bf16(u64),
    F32(u64),
}

pub struct Fp8Gemm {
    dev: Arc<Dev>,
    handle: lt::cublasLtHandle_t,
    workspace: DBuf,
    quant: Func,
    _m: Module,
    plans: RefCell<HashMap<ShapeKey, Plan>>,
}

// SAFETY: used from one thread at a time (its owner is not Sync); cuBLASLt handles may move
// between threads.
unsafe impl Send for Fp8Gemm {}

impl Drop for Fp8Gemm {
    fn drop(&mut self) {
        self.plans.borrow_mut().clear();
        // SAFETY: created in new(), destroyed once, after the plans that use it.
        unsafe {
            lt::cublasLtDestroy(self.handle);
        }
    }
}

impl Fp8Gemm {
    /// Refuses (an error) where cuBLASLt is missing or the device has no FP8 tensor cores.
    pub fn new(dev: &Arc<Dev>) -> DResult<Fp8Gemm> {
        if dev.cc < (8, 9) {
            return Err(DevError(format!(
                "FP8 GEMMs need compute capability 8.9 or later (this device: {}.{})",
                dev.cc.0, dev.cc.1
            )));
        }
        // SAFETY: only tries to dlopen the library.
        if !unsafe { lt::is_culib_present() } {
            return Err(DevError("libcublasLt is not installed".into()));
        }
        dev.ctx
            .bind_to_thread()
            .map_err(|e| DevError(format!("binding the context: {e:?}")))?;
        let mut handle: lt::cublasLtHandle_t = std::ptr::null_mut();
        // SAFETY: writes one handle.
        check(unsafe { lt::cublasLtCreate(&mut handle) }, "cublasLtCreate")?;
        let m = Module::load(dev, "fp8", FP8, &[])?;
        Ok(Fp8Gemm {
            dev: dev.clone(),
            handle,
            workspace: dev.alloc(WORKSPACE_BYTES)?,
            quant: m.func("quant_rows_e4m3")?,
            _m: m,
            plans: RefCell::new(HashMap::new()),
        })
    }

    /// Quantises `rows` bf16 rows of `cols` values (row stride `ld` values) at `x` to e4m3 rows
    /// at `q` (`rows × cols` bytes) and their scales at `scale` (`rows` f32).
    pub fn quantize(
        &self,
        x: u64,
        rows: usize,
        cols: usize,
        ld: usize,
        q: u64,
        scale: u64,
    ) -> DResult<()> {
        if cols % 2 != 0 {
            return Err(DevError(format!(
                "e4m3 rows need an even column count, not {cols}"
            )));
        }
        self.dev.launch(
            &self.quant,
            (rows as u32, 1, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(x),
                Arg::I32(cols as i32),
                Arg::U64(ld as u64),
                Arg::Ptr(q),
                Arg::Ptr(scale),
            ],
        )
    }

    /// `out[m, n] = xs[m] · ws[n] · Σ_k x[m, k] · w[n, k]` (see the module notes).
    /// `fast_accum`: Hopper's faster FP8 accumulation (fewer promotions to full f32).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &self,
        w: u64,
        ws: u64,
        x: u64,
        xs: u64,
        out: Fp8Out,
        (n, m, k): (usize, usize, usize),
        ldc: usize,
        fast_accum: bool,
    ) -> DResult<()> {
        let (out, f32_out) = match out {
            Fp8Out::Bf16(p) => (p, false),
            Fp8Out::F32(p) => (p, true),
        };
        let key = (n, m, k, ldc, fast_accum, f32_out);
        if !self.plans.borrow().contains_key(&key) {
            let p = self.plan(key, ws, xs)?;
            self.plans.borrow_mut().insert(key, p);
        }
        let plans = self.plans.borrow();
        let p = &plans[&key];
        set_desc(
            p.desc,
            lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
            &ws,
        )?;
        set_desc(
            p.desc,
            lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
            &xs,
        )?;
        let (alpha, beta) = (1f32, 0f32);
        // SAFETY: every pointer is a device buffer the caller sized for this shape; the plan's
        // descriptors live until `plans` is dropped.
        let s = unsafe {
            lt::cublasLtMatmul(
                self.handle,
                p.desc,
                &alpha as *const f32 as *const c_void,
                w as *const c_void,
                p.a,
                x as *const c_void,
                p.b,
                &beta as *const f32 as *const c_void,
                out as *const c_void,
                p.d,
                out as *mut c_void,
                p.d,
                &p.algo,
                self.workspace.ptr() as *mut c_void,
                WORKSPACE_BYTES,
                self.dev.stream.cu_stream() as lt::cudaStream_t,
            )
        };
        check(s, "cublasLtMatmul (fp8)")
    }

    fn plan(&self, (n, m, k, ldc, fast, f32_out): ShapeKey, ws: u64, xs: u64) -> DResult<Plan> {
        use lt::cublasLtMatmulDescAttributes_t as A;
        let mut desc: lt::cublasLtMatmulDesc_t = std::ptr::null_mut();
        // SAFETY: writes one descriptor.
        check(
            unsafe {
                lt::cublasLtMatmulDescCreate(
                    &mut desc,
                    lt::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    lt::cudaDataType_t::CUDA_R_32F,
                )
            },
            "cublasLtMatmulDescCreate",
        )?;
        let layout = |ty: lt::cudaDataType,
                      rows: usize,
                      cols: usize,
                      ld: usize|
         -> DResult<lt::cublasLtMatrixLayout_t> {
            let mut l: lt::cublasLtMatrixLayout_t = std::ptr::null_mut();
            // SAFETY: writes one layout.
            check(
                unsafe {
                    lt::cublasLtMatrixLayoutCreate(&mut l, ty, rows as u64, cols as u64, ld as i64)
                },
                "cublasLtMatrixLayoutCreate",
            )?;
            Ok(l)
        };
        let e4m3 = lt::cudaDataType_t::CUDA_R_8F_E4M3;
        let mut p = Plan {
            desc,
            a: layout(e4m3, k, n, k)?,
            b: layout(e4m3, k, m, k)?,
            d: layout(
                if f32_out {
                    lt::cudaDataType_t::CUDA_R_32F
                } else {
                    lt::cudaDataType_t::CUDA_R_16BF
                },
                n,
                m,
                ldc,
            )?,
            // SAFETY: plain data, filled by the heuristic below.
            algo: unsafe { std::mem::zeroed() },
        };
        // cublasOperation_t: 1 = T, 0 = N.
        set_desc(desc, A::CUBLASLT_MATMUL_DESC_TRANSA, &1i32)?;
        set_desc(desc, A::CUBLASLT_MATMUL_DESC_TRANSB, &0i32)?;
        set_desc(desc, A::CUBLASLT_MATMUL_DESC_FAST_ACCUM, &(fast as i8))?;
        let outer =
            lt::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F as u32;
        set_desc(desc, A::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &outer)?;
        set_desc(desc, A::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &outer)?;
        set_desc(desc, A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &ws)?;
        set_desc(desc, A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &xs)?;
        let mut pref: lt::cublasLtMatmulPreference_t = std::ptr::null_mut();
        // SAFETY: writes one preference object, destroyed below.
        check(
            unsafe { lt::cublasLtMatmulPreferenceCreate(&mut pref) },
            "cublasLtMatmulPreferenceCreate",
        )?;
        let max_ws = WORKSPACE_BYTES as u64;
        // SAFETY: pref is live; the buffer is a u64.
        let s = unsafe {
            lt::cublasLtMatmulPreferenceSetAttribute(
                pref,
                lt::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &max_ws as *const u64 as *const c_void,
                8,
            )
        };
        let mut result: lt::cublasLtMatmulHeuristicResult_t = unsafe { std::mem::zeroed() };
        let mut found = 0i32;
        // SAFETY: all descriptors are live; writes at most one result.
        let h = unsafe {
            lt::cublasLtMatmulAlgoGetHeuristic(
                self.handle,
                desc,
                p.a,
                p.b,
                p.d,
                p.d,
                pref,
                1,
                &mut result,
                &mut found,
            )
        };
        // SAFETY: created above.
        unsafe { lt::cublasLtMatmulPreferenceDestroy(pref) };
        check(s, "cublasLtMatmulPreferenceSetAttribute")?;
        check(
            h,
            "cublasLtMatmulAlgoGetHeuristic (fp8, outer-vector scales)",
        )?;
        if found < 1 {
            return Err(DevError(format!(
                "cuBLASLt has no FP8 algorithm with outer-vector scales for n {n}, m {m}, k {k}"
            )));
        }
        p.algo = result.algo;
        Ok(p)
    }
}

fn set_desc<T>(
    desc: lt::cublasLtMatmulDesc_t,
    attr: lt::cublasLtMatmulDescAttributes_t,
    v: &T,
) -> DResult<()> {
    // SAFETY: desc is live; the attribute's value is `v`'s bytes.
    check(
        unsafe {
            lt::cublasLtMatmulDescSetAttribute(
                desc,
                attr,
                v as *const T as *const c_void,
                std::mem::size_of::<T>(),
            )
        },
        "cublasLtMatmulDescSetAttribute",
    )
}

/// e4m3 (the "fn" variant: no infinities, NaN at 0x7f/0xff) to f32, exactly.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((b >> 3) & 0xf) as i32;
    let m = (b & 7) as f32;
    if e == 0xf && b & 7 == 7 {
        return f32::NAN;
    }
    if e == 0 {
        sign * m / 8.0 * 2f32.powi(-6)
    } else {
        sign * (1.0 + m / 8.0) * 2f32.powi(e - 7)
    }
}

#[cfg(test)]
mod tests {
    use super::e4m3_to_f32;

    #[test]
    fn e4m3_decodes_the_format_s_landmarks() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0xb8), -1.0);
        assert_eq!(e4m3_to_f32(0x7e), 448.0); // the largest finite value
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9)); // the smallest subnormal
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6)); // the smallest normal
        assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
    }
}
