//! int8 GEMMs for the DiT's int8 path (`--dit-precision int8`): rows quantised to s8 with one
//! f32 scale per row (`quant_rows_s8`, kernels/int8.cu: amax / 127), cuBLASLt's s8 × s8 GEMM
//! with exact s32 sums (`lt.rs`, `LtIn::I8`), and those sums scaled to bf16 rows
//! (`dequant_s32_bf16`): `out[m, n] = xs[m] · ws[n] · Σ_k x[m, k] · w[n, k]`. The DiT's swiglu
//! and residual_norm read the sums and scales themselves (`Int8Gemm::sums`), so only the q|k|v
//! GEMM, whose bf16 rows the attention reads, takes the scaling pass.
//!
//! Why int8 beside FP8: at the DiT's shapes on the H200 cuBLASLt's s8 GEMM runs as fast as the
//! e4m3 one with fast accumulation (1212–1477 against 1174–1442 TOP/s), and per-row s8 keeps
//! ~7 significant bits where e4m3 keeps 4: the GEMM's error against bf16 is 5.8e-3 against
//! 3.6e-2 (`cmf-fp8-probe`, H200, 2026-12-04). cuBLASLt writes s32 (its IMMA kernels
//! take no bf16 output), so the scales are applied after the GEMM.

use super::device::{Arg, DResult, Dev, DevError};
use super::kernels::{launch_quant_rows, Func, Module, INT8};
use super::lt::{LtCall, LtGemm, LtIn, LtOut};
use std::sync::Arc;

pub struct Int8Gemm {
    dev: Arc<Dev>,
    lt: LtGemm,
    quant: Func,
    dequant: Func,
    _m: Module,
}

impl Int8Gemm {
    /// Refuses (an error) where cuBLASLt is missing or the device has no int8 tensor cores of
    /// the kind cuBLASLt's IMMA kernels use (compute capability 8.0 or later).
    pub fn new(dev: &Arc<Dev>) -> DResult<Int8Gemm> {
        if dev.cc < (8, 0) {
            return Err(DevError(format!(
                "int8 GEMMs need compute capability 8.0 or later (this device: {}.{})",
                dev.cc.0, dev.cc.1
            )));
        }
        let lt = LtGemm::new(dev)?;
        let m = Module::load(dev, "int8", INT8, &[])?;
        Ok(Int8Gemm {
            dev: dev.clone(),
            lt,
            quant: m.func("quant_rows_s8")?,
            dequant: m.func("dequant_s32_bf16")?,
            _m: m,
        })
    }

    /// Quantises `rows` bf16 rows of `cols` values (row stride `ld` values) at `x` to s8 rows
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
        if cols % 4 != 0 || ld % 4 != 0 {
            return Err(DevError(format!(
                "s8 rows: {cols} values a row, stride {ld} (both must be multiples of 4)"
            )));
        }
        launch_quant_rows(&self.dev, &self.quant, x, (rows, cols, ld), q, scale)
    }

    /// `out[m, n]` (bf16, row stride `ldc`) `= xs[m] · ws[n] · Σ_k x[m, k] · w[n, k]` for s8
    /// rows `w` (`n × k`) and `x` (`m × k`) with their row scales; `acc` holds the `m × n` s32
    /// sums in between (`4 · m · n` bytes): [`Int8Gemm::sums`], then [`Int8Gemm::scale`].
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &self,
        (w, ws): (u64, u64),
        (x, xs): (u64, u64),
        acc: u64,
        out: u64,
        (n, m, k): (usize, usize, usize),
        ldc: usize,
    ) -> DResult<()> {
        self.sums(w, x, acc, (n, m, k))?;
        self.scale(acc, (n, m), xs, ws, out, ldc)
    }

    /// `acc[m, n] = Σ_k x[m, k] · w[n, k]` (s32, row stride n) for s8 rows `w` (`n × k`) and
    /// `x` (`m × k`): the GEMM alone, for a consumer that applies the scales itself (the DiT's
    /// swiglu and residual_norm, cuda/dit/kernels/dit.cu `GemmRow`).
    pub fn sums(&self, w: u64, x: u64, acc: u64, (n, m, k): (usize, usize, usize)) -> DResult<()> {
        self.lt.gemm(&LtCall {
            w,
            x,
            input: LtIn::I8,
            out: LtOut::I32(acc),
            nmk: (n, m, k),
            ldc: n,
        })
    }

    /// `out[r, c] = bf16(acc[r, c] · xs[r] · ws[c])` for `m` rows of `n` sums (row stride n),
    /// `out` with row stride `ldc`.
    pub fn scale(
        &self,
        acc: u64,
        (n, m): (usize, usize),
        xs: u64,
        ws: u64,
        out: u64,
        ldc: usize,
    ) -> DResult<()> {
        if n % 4 != 0 || ldc % 4 != 0 || m > 65535 {
            return Err(DevError(format!(
                "int8 GEMM: n {n}, ldc {ldc} (multiples of 4), m {m} (at most 65535)"
            )));
        }
        self.dev.launch(
            &self.dequant,
            (n.div_ceil(1024) as u32, m as u32, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(acc),
                Arg::I32(n as i32),
                Arg::Ptr(xs),
                Arg::Ptr(ws),
                Arg::Ptr(out),
                Arg::U64(ldc as u64),
            ],
        )
    }
}
