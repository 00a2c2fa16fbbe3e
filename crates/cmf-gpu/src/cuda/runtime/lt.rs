//! cuBLASLt GEMMs with the algorithm chosen per shape: bf16 operands, or e4m3 operands with one
//! f32 scale per row of each (the DiT's FP8 path, `fp8.rs`).
//!
//! `out[m, n]` (bf16 or f32, row stride `ldc`) = `Σ_k x[m, k] · w[n, k]` (times `xs[m] · ws[n]`
//! for e4m3), `x` and `w` row-major. In cuBLASLt's column-major terms: D (n × m, ld `ldc`) =
//! op(A) · B with A = `w` seen as k × n and op = T (FP8 on Hopper wants this "TN" form), B = `x`
//! seen as k × m; e4m3 scales are outer vectors, A's along D's rows (n) and B's along its columns
//! (m) (`CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F`, cuBLASLt 12.9 and later).
//!
//! `LtIn::I8` (s8 operands, exact s32 sums, `LtOut::I32`) exists to measure the file's int8
//! codec through cuBLASLt (`cmf-fp8-probe`); no model path runs it.
//!
//! A shape's plan keeps every candidate cuBLASLt's heuristics offer; the first runs unless
//! [`LtGemm::tune`] timed them and picked another (`cmf-gemm-tune`). Measured on the H200
//! (2026-12-02, BENCH.md): on the DiT's shapes the first bf16 candidate was the fastest
//! alone, and picking candidates by such timings made whole steps slower, so nothing tunes by
//! default.

use super::device::{DBuf, DResult, Dev, DevError, Timer};
use cudarc::cublaslt::sys as lt;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

/// cuBLASLt workspace: what its algorithms may use for split-K and the like.
const WORKSPACE_BYTES: usize = 32 << 20;

/// How many candidates a plan asks the heuristics for.
const CANDIDATES: usize = 24;

fn check(s: lt::cublasStatus_t, what: &str) -> DResult<()> {
    if s == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(DevError(format!("{what}: {s:?}")))
    }
}

/// The operands of a GEMM.
#[derive(Clone, Copy, Debug)]
pub enum LtIn {
    Bf16,
    /// e4m3 rows with one f32 scale per row of `w` (`ws`) and of `x` (`xs`); `fast`: Hopper's
    /// faster FP8 accumulation (fewer promotions to full f32).
    E4m3 {
        ws: u64,
        xs: u64,
        fast: bool,
    },
    /// s8 rows, unscaled: the output is the exact s32 sums (`LtOut::I32` only).
    I8,
}

/// Where a GEMM writes: bf16 or f32 rows.
#[derive(Clone, Copy, Debug)]
pub enum LtOut {
    Bf16(u64),
    F32(u64),
    /// s32 rows (`LtIn::I8` only).
    I32(u64),
}

impl LtOut {
    fn ptr(self) -> u64 {
        match self {
            LtOut::Bf16(p) | LtOut::F32(p) | LtOut::I32(p) => p,
        }
    }
}

/// One GEMM's operands: `w` (`n × k`) and `x` (`m × k`) device rows, their type (and scales),
/// where the `m × n` output goes and its row stride `ldc`.
#[derive(Clone, Copy, Debug)]
pub struct LtCall {
    pub w: u64,
    pub x: u64,
    pub input: LtIn,
    pub out: LtOut,
    pub nmk: (usize, usize, usize),
    pub ldc: usize,
}

/// (n, m, k, ldc, operands: 0 bf16 / 1 e4m3 / 2 e4m3 fast / 3 s8, f32 output)
type ShapeKey = (usize, usize, usize, usize, u8, bool);

const KIND_I8: u8 = 3;

impl LtCall {
    fn key(&self) -> ShapeKey {
        let kind = match self.input {
            LtIn::Bf16 => 0,
            LtIn::E4m3 { fast: false, .. } => 1,
            LtIn::E4m3 { fast: true, .. } => 2,
            LtIn::I8 => KIND_I8,
        };
        let (n, m, k) = self.nmk;
        (n, m, k, self.ldc, kind, matches!(self.out, LtOut::F32(_)))
    }
}

/// One shape's descriptors, the heuristics' candidates and the one that runs.
struct Plan {
    desc: lt::cublasLtMatmulDesc_t,
    a: lt::cublasLtMatrixLayout_t,
    b: lt::cublasLtMatrixLayout_t,
    d: lt::cublasLtMatrixLayout_t,
    candidates: Vec<lt::cublasLtMatmulAlgo_t>,
    chosen: Cell<usize>,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each created once in LtGemm::plan (null where a later step failed first),
        // destroyed once here.
        unsafe {
            for l in [self.a, self.b, self.d] {
                if !l.is_null() {
                    lt::cublasLtMatrixLayoutDestroy(l);
                }
            }
            lt::cublasLtMatmulDescDestroy(self.desc);
        }
    }
}

pub struct LtGemm {
    dev: Arc<Dev>,
    handle: lt::cublasLtHandle_t,
    workspace: DBuf,
    plans: RefCell<HashMap<ShapeKey, Plan>>,
}

// SAFETY: used from one thread at a time (its owner is not Sync); cuBLASLt handles may move
// between threads.
unsafe impl Send for LtGemm {}

impl Drop for LtGemm {
    fn drop(&mut self) {
        self.plans.borrow_mut().clear();
        // SAFETY: created in new(), destroyed once, after the plans that use it.
        unsafe {
            lt::cublasLtDestroy(self.handle);
        }
    }
}

impl LtGemm {
    /// Refuses (an error) where libcublasLt is missing.
    pub fn new(dev: &Arc<Dev>) -> DResult<LtGemm> {
        // SAFETY: only tries to dlopen the library.
        if !unsafe { lt::is_culib_present() } {
            return Err(DevError("libcublasLt is not installed".into()));
        }
        dev.bind_to_thread()?;
        let mut handle: lt::cublasLtHandle_t = std::ptr::null_mut();
        // SAFETY: writes one handle.
        check(unsafe { lt::cublasLtCreate(&mut handle) }, "cublasLtCreate")?;
        Ok(LtGemm {
            dev: dev.clone(),
            handle,
            workspace: dev.alloc(WORKSPACE_BYTES)?,
            plans: RefCell::new(HashMap::new()),
        })
    }

    /// `out[m, n] = Σ_k x[m, k] · w[n, k]` (scaled for e4m3; see the module notes), with the
    /// shape's chosen algorithm.
    pub fn gemm(&self, c: &LtCall) -> DResult<()> {
        let key = self.planned(c)?;
        let plans = self.plans.borrow();
        let p = &plans[&key];
        self.launch(p, p.chosen.get(), c)
    }

    /// Times every candidate for this shape on these buffers ([`Timer::median_ms`] of `reps`
    /// runs), keeps the fastest for later calls and returns each candidate's
    /// description and milliseconds (`None`: the candidate refused this shape). Synchronises.
    pub fn tune(&self, c: &LtCall, reps: usize) -> DResult<Vec<(String, Option<f32>)>> {
        let key = self.planned(c)?;
        let plans = self.plans.borrow();
        let p = &plans[&key];
        let timer = Timer::new()?;
        let mut times = Vec::with_capacity(p.candidates.len());
        for (i, algo) in p.candidates.iter().enumerate() {
            let ms = timer
                .median_ms(&self.dev, reps, || self.launch(p, i, c))
                .ok();
            times.push((describe(algo), ms));
        }
        let best = times
            .iter()
            .enumerate()
            .filter_map(|(i, (_, ms))| ms.map(|ms| (i, ms)))
            .min_by(|a, b| a.1.total_cmp(&b.1));
        if let Some((i, _)) = best {
            p.chosen.set(i);
        }
        Ok(times)
    }

    fn launch(&self, p: &Plan, candidate: usize, c: &LtCall) -> DResult<()> {
        use lt::cublasLtMatmulDescAttributes_t as A;
        let (w, x) = (c.w, c.x);
        if let LtIn::E4m3 { ws, xs, .. } = c.input {
            set_desc(p.desc, A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &ws)?;
            set_desc(p.desc, A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &xs)?;
        }
        // Scalars in the descriptor's scale type: s32 for the int8 GEMM, f32 otherwise.
        let (alpha, beta) = if matches!(c.input, LtIn::I8) {
            (1i32.to_ne_bytes(), 0i32.to_ne_bytes())
        } else {
            (1f32.to_ne_bytes(), 0f32.to_ne_bytes())
        };
        let out = c.out.ptr();
        // SAFETY: every pointer is a device buffer the caller sized for this shape; the plan's
        // descriptors live until `plans` is dropped.
        let s = unsafe {
            lt::cublasLtMatmul(
                self.handle,
                p.desc,
                alpha.as_ptr() as *const c_void,
                w as *const c_void,
                p.a,
                x as *const c_void,
                p.b,
                beta.as_ptr() as *const c_void,
                out as *const c_void,
                p.d,
                out as *mut c_void,
                p.d,
                &p.candidates[candidate],
                self.workspace.ptr() as *mut c_void,
                WORKSPACE_BYTES,
                self.dev.stream.cu_stream() as lt::cudaStream_t,
            )
        };
        check(s, "cublasLtMatmul")
    }

    /// The shape's key, planning it on first use.
    fn planned(&self, c: &LtCall) -> DResult<ShapeKey> {
        if matches!(c.input, LtIn::I8) != matches!(c.out, LtOut::I32(_)) {
            return Err(DevError(
                "cuBLASLt: s32 output goes with s8 operands only".into(),
            ));
        }
        let key = c.key();
        if !self.plans.borrow().contains_key(&key) {
            let p = self.plan(key, c.input)?;
            self.plans.borrow_mut().insert(key, p);
        }
        Ok(key)
    }

    fn plan(&self, (n, m, k, ldc, kind, f32_out): ShapeKey, input: LtIn) -> DResult<Plan> {
        use lt::cublasLtMatmulDescAttributes_t as A;
        let (compute, scale) = if kind == KIND_I8 {
            (
                lt::cublasComputeType_t::CUBLAS_COMPUTE_32I,
                lt::cudaDataType_t::CUDA_R_32I,
            )
        } else {
            (
                lt::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                lt::cudaDataType_t::CUDA_R_32F,
            )
        };
        let mut desc: lt::cublasLtMatmulDesc_t = std::ptr::null_mut();
        // SAFETY: writes one descriptor.
        check(
            unsafe { lt::cublasLtMatmulDescCreate(&mut desc, compute, scale) },
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
        let operand = match kind {
            0 => lt::cudaDataType_t::CUDA_R_16BF,
            KIND_I8 => lt::cudaDataType_t::CUDA_R_8I,
            _ => lt::cudaDataType_t::CUDA_R_8F_E4M3,
        };
        // Owned from here on, so that a failure below frees what was made.
        let mut p = Plan {
            desc,
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            d: std::ptr::null_mut(),
            candidates: Vec::new(),
            chosen: Cell::new(0),
        };
        p.a = layout(operand, k, n, k)?;
        p.b = layout(operand, k, m, k)?;
        let out = if kind == KIND_I8 {
            lt::cudaDataType_t::CUDA_R_32I
        } else if f32_out {
            lt::cudaDataType_t::CUDA_R_32F
        } else {
            lt::cudaDataType_t::CUDA_R_16BF
        };
        p.d = layout(out, n, m, ldc)?;
        // cublasOperation_t: 1 = T, 0 = N.
        set_desc(desc, A::CUBLASLT_MATMUL_DESC_TRANSA, &1i32)?;
        set_desc(desc, A::CUBLASLT_MATMUL_DESC_TRANSB, &0i32)?;
        if let LtIn::E4m3 { ws, xs, fast } = input {
            set_desc(desc, A::CUBLASLT_MATMUL_DESC_FAST_ACCUM, &(fast as i8))?;
            let outer =
                lt::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F as u32;
            set_desc(desc, A::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &outer)?;
            set_desc(desc, A::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &outer)?;
            set_desc(desc, A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &ws)?;
            set_desc(desc, A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &xs)?;
        }
        let candidates = self.heuristics(&p)?;
        if candidates.is_empty() {
            return Err(DevError(format!(
                "cuBLASLt has no {} algorithm for n {n}, m {m}, k {k}",
                match kind {
                    0 => "bf16",
                    KIND_I8 => "int8",
                    _ => "FP8 (outer-vector scales)",
                }
            )));
        }
        p.candidates = candidates;
        Ok(p)
    }

    /// The heuristics' candidates for a plan's descriptors, best first.
    fn heuristics(&self, p: &Plan) -> DResult<Vec<lt::cublasLtMatmulAlgo_t>> {
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
        // SAFETY: plain data, filled by the heuristics.
        let mut results: Vec<lt::cublasLtMatmulHeuristicResult_t> = (0..CANDIDATES)
            .map(|_| unsafe { std::mem::zeroed() })
            .collect();
        let mut found = 0i32;
        // SAFETY: all descriptors are live; writes at most CANDIDATES results.
        let h = unsafe {
            lt::cublasLtMatmulAlgoGetHeuristic(
                self.handle,
                p.desc,
                p.a,
                p.b,
                p.d,
                p.d,
                pref,
                CANDIDATES as i32,
                results.as_mut_ptr(),
                &mut found,
            )
        };
        // SAFETY: created above.
        unsafe { lt::cublasLtMatmulPreferenceDestroy(pref) };
        check(s, "cublasLtMatmulPreferenceSetAttribute")?;
        check(h, "cublasLtMatmulAlgoGetHeuristic")?;
        Ok(results
            .into_iter()
            .take(found.max(0) as usize)
            .filter(|r| r.state == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
            .map(|r| r.algo)
            .collect())
    }
}

/// An algorithm's configuration as cuBLASLt numbers it (id, tile, stages, split-K, cluster).
fn describe(algo: &lt::cublasLtMatmulAlgo_t) -> String {
    use lt::cublasLtMatmulAlgoConfigAttributes_t as C;
    // Each attribute is read with its own size (cuBLASLt refuses other sizes): 16 bits for the
    // cluster shape, 32 for the others.
    let get = |attr: C, size: usize| -> i64 {
        let mut v = 0u32;
        let mut written = 0usize;
        // SAFETY: reads `size` ≤ 4 bytes of one attribute into `v`.
        let s = unsafe {
            lt::cublasLtMatmulAlgoConfigGetAttribute(
                algo,
                attr,
                &mut v as *mut u32 as *mut c_void,
                size,
                &mut written,
            )
        };
        if s != lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return -1;
        }
        match size {
            2 => (v & 0xffff) as i64,
            _ => v as i32 as i64,
        }
    };
    format!(
        "id {} tile {} stages {} splitk {} swizzle {} cluster {}",
        get(C::CUBLASLT_ALGO_CONFIG_ID, 4),
        get(C::CUBLASLT_ALGO_CONFIG_TILE_ID, 4),
        get(C::CUBLASLT_ALGO_CONFIG_STAGES_ID, 4),
        get(C::CUBLASLT_ALGO_CONFIG_SPLITK_NUM, 4),
        get(C::CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, 4),
        get(C::CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, 2),
    )
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
