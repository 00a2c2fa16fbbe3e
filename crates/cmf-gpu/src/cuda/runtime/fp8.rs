//! FP8 (e4m3) GEMMs on Hopper for the DiT's FP8 path (`--dit-precision fp8`): the rows'
//! quantisation (`quant_rows_e4m3`, kernels/fp8.cu: one f32 scale per row, amax / 448) and the
//! GEMM through cuBLASLt (`lt.rs`: `out[m, n] = xs[m] · ws[n] · Σ_k x[m, k] · w[n, k]`).
//!
//! Status (H200, 2026-11-30; BENCH.md): `cuda-test fp8` passes (rel err 1.7e-3 against the exact
//! product of its quantised inputs); a 1024² DiT step takes 93 ms in bf16, 68 ms with
//! `--dit-precision fp8` and 64 ms with `fp8-fast`, with the row kernels writing e4m3 directly
//! (cuda/dit/rows.rs, kernels/e4m3.cuh); images 38.0–38.8 dB PSNR from the bf16 ones on the
//! random-weight full-size pack.

use super::device::{DResult, Dev, DevError};
use super::kernels::{launch_quant_rows, Func, Module, FP8};
pub use super::lt::LtOut as Fp8Out;
use super::lt::{LtCall, LtGemm, LtIn};
use std::sync::Arc;

pub struct Fp8Gemm {
    dev: Arc<Dev>,
    lt: LtGemm,
    quant: Func,
    _m: Module,
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
        let lt = LtGemm::new(dev)?;
        let m = Module::load(dev, "fp8", FP8, &[])?;
        Ok(Fp8Gemm {
            dev: dev.clone(),
            lt,
            quant: m.func("quant_rows_e4m3")?,
            _m: m,
        })
    }

    /// The cuBLASLt GEMMs behind [`Fp8Gemm::gemm`] (their bf16 GEMMs too).
    pub fn lt(&self) -> &LtGemm {
        &self.lt
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
        launch_quant_rows(&self.dev, &self.quant, x, (rows, cols, ld), q, scale)
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
        nmk: (usize, usize, usize),
        ldc: usize,
        fast_accum: bool,
    ) -> DResult<()> {
        let input = LtIn::E4m3 {
            ws,
            xs,
            fast: fast_accum,
        };
        self.lt.gemm(&LtCall {
            w,
            x,
            input,
            out,
            nmk,
            ldc,
        })
    }
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
