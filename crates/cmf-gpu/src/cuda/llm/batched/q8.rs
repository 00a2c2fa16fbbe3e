//! The batched step's q8_row linear layers on tensor cores (kernels/gemm_q8.cu), reading each
//! weight once for all rows. Without them a step of more than one row dequantised every matrix to
//! a bf16 scratch first: about five times the weight traffic. Two GEMMs ([`Q8Gemm`]):
//! - int8 (the verified kernel set): the input rows quantised in blocks of 32 (s8 + one f32 scale
//!   each), exact s32 sums per block, in steps of at most [`Q8_MAX_ROWS`] rows;
//! - W8A16 ([`BatchKernels::Next`]): bf16 input rows, the weights widened to bf16 in registers,
//!   in steps of at most [`W8_MAX_ROWS`] rows, K split over blocks when a matrix has few tiles.
//!
//! Only q8_row matrices (s8 with one scale per row) take them; other codecs and larger steps keep
//! the bf16 GEMM (cuBLAS over a dequantised scratch), and `precise` models the f32 one.

use super::super::kernels::Q8GemmKernels;
use super::super::CudaLlm;
use crate::cuda::runtime::device::{bytes_of, Arg, DResult, Dev};
use crate::cuda::runtime::weights::DevWeight;
use crate::llm::BatchKernels;
use cmf_format::Dtype;

/// Most rows a step runs through the int8 GEMM. Each 32-value block's s32 sum is scaled and
/// added in f32 after its mma, which costs more than the tensor cores save once many input rows
/// share the weights. `cmf bench --parallel` on Qwen3-0.6B q8, two H100s on 2026-12-07: with it,
/// steps of 64 decode rows ran at 0.58× and prefill steps of 2,048+ rows at 0.67–0.78× the bf16
/// path; steps of up to 16 rows were no slower.
pub(super) const Q8_MAX_ROWS: usize = 16;

/// Most rows a step runs through the W8A16 GEMM ([`BatchKernels::Next`]); larger ones (long
/// prefill chunks) take cuBLAS over a dequantised scratch, which the tensor cores keep busy.
const W8_MAX_ROWS: usize = 256;

/// Which q8_row GEMM a batched step runs.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Q8Gemm {
    /// s8 inputs in blocks of 32, int8 tensor cores (`gemm_q8_narrow`).
    Blocks32,
    /// bf16 inputs, the weights widened to bf16 (`gemm_w8_bf16`).
    Bf16,
}

/// The GEMM a step runs and the most rows it takes.
pub(super) fn q8_gemm_choice(kernels: BatchKernels) -> (Q8Gemm, usize) {
    match kernels {
        BatchKernels::Next => (Q8Gemm::Bf16, W8_MAX_ROWS),
        BatchKernels::Verified => (Q8Gemm::Blocks32, Q8_MAX_ROWS),
    }
}

/// Bytes of the W8A16 GEMM's split partial sums: enough for any step (see [`w8_splits`]).
pub(super) fn w8_parts_bytes(dev: &Dev) -> usize {
    4 * W8_TARGET_BLOCKS_PER_SM * dev.sm_count as usize * 64 * 64 * 4
}

/// Blocks per multiprocessor the W8A16 GEMM aims for; it splits K over blocks to get there.
const W8_TARGET_BLOCKS_PER_SM: usize = 2;

/// Values of K a W8A16 block stages at a time (gemm_q8.cu `W8_KC`).
const W8_KC: usize = 256;

/// The W8A16 GEMM's K splits for `t` rows of an `n × k` matrix: (splits, chunks per split). Enough
/// (64 × 64) tiles times splits for [`W8_TARGET_BLOCKS_PER_SM`] blocks a multiprocessor, each
/// split at least two chunks. When it splits, tiles < target, so splits · t · n < 2 · target ·
/// 4096 values ([`w8_parts_bytes`]).
fn w8_splits(dev: &Dev, t: usize, n: usize, k: usize) -> (usize, usize) {
    let target = W8_TARGET_BLOCKS_PER_SM * dev.sm_count as usize;
    let tiles = t.div_ceil(64) * n.div_ceil(64);
    let chunks = k.div_ceil(W8_KC);
    let want = target.div_ceil(tiles).min(chunks / 2).max(1);
    let per = chunks.div_ceil(want);
    (chunks.div_ceil(per), per)
}

/// Bytes of quantised input for `rows` rows of `k` values: s8 values, then one f32 per block.
pub(super) fn scratch_bytes(rows: usize, k: usize) -> usize {
    rows * k + 4 * rows * (k / 32)
}

impl CudaLlm {
    /// Whether `w` runs through the int8 GEMM: inside a batched step, for q8_row matrices.
    pub(in super::super) fn batched_q8(&self, w: &DevWeight) -> bool {
        self.q8_step.get() && w.dtype == Dtype::Q8Row
    }

    /// The q8_row GEMM this model's batched steps run (its options' kernel set).
    pub(super) fn q8_gemm(&self) -> Q8Gemm {
        q8_gemm_choice(self.opts.batch_kernels).0
    }

    /// The widest input any linear layer takes (what the quantised-input scratch must hold per
    /// row).
    pub(super) fn widest_input(&self) -> usize {
        let s = &self.spec;
        s.hidden.max(s.q_dim()).max(s.intermediate)
    }

    /// `out[t, col0 + n] (+)= x[t] · w[n]` for the `t` bf16 rows at `x` (row stride = `w.cols`)
    /// and the q8_row matrix `w`, through the scratch the step sized.
    #[allow(clippy::too_many_arguments)]
    pub(in super::super) fn gemm_q8(
        &self,
        w: &DevWeight,
        x: u64,
        t: usize,
        out: u64,
        ldc: usize,
        col0: usize,
        accumulate: bool,
    ) -> DResult<()> {
        let pool = self
            .pool
            .as_ref()
            .expect("a batched step runs over the pool");
        let dst = Q8Out {
            ptr: out,
            ldc,
            col0,
            accumulate,
        };
        if self.q8_gemm() == Q8Gemm::Bf16 {
            return w8_bf16(
                &self.dev,
                &pool.q8_kernels,
                &Q8Mat::of(w),
                (x, t),
                &dst,
                (pool.w8_parts.ptr(), pool.w8_parts.len()),
            );
        }
        let xq = pool.q8_x.ptr();
        quantize(&self.dev, &pool.q8_kernels, (x, t, w.cols), xq)?;
        mma(&self.dev, &pool.q8_kernels, &Q8Mat::of(w), t, xq, &dst)
    }

    /// The same bf16 rows times each of `parts` (matrix, column offset), stored side by side in
    /// the rows of `out`, the input quantised once; false (nothing launched) unless every part
    /// takes the int8 GEMM.
    pub(in super::super) fn gemms_q8_one_input(
        &self,
        parts: &[(&DevWeight, usize)],
        x: u64,
        t: usize,
        out: u64,
        ldc: usize,
    ) -> DResult<bool> {
        if !parts.iter().all(|(w, _)| self.batched_q8(w)) {
            return Ok(false);
        }
        if self.q8_gemm() == Q8Gemm::Bf16 {
            for &(w, col0) in parts {
                self.gemm_q8(w, x, t, out, ldc, col0, false)?;
            }
            return Ok(true);
        }
        let pool = self
            .pool
            .as_ref()
            .expect("a batched step runs over the pool");
        let xq = pool.q8_x.ptr();
        quantize(&self.dev, &pool.q8_kernels, (x, t, parts[0].0.cols), xq)?;
        for &(w, col0) in parts {
            let dst = Q8Out {
                ptr: out,
                ldc,
                col0,
                accumulate: false,
            };
            mma(&self.dev, &pool.q8_kernels, &Q8Mat::of(w), t, xq, &dst)?;
        }
        Ok(true)
    }
}

/// A q8_row matrix on the device: s8 rows and their f16 scales.
struct Q8Mat {
    w: u64,
    scales: u64,
    rows: usize,
    cols: usize,
}

impl Q8Mat {
    fn of(w: &DevWeight) -> Q8Mat {
        Q8Mat {
            w: w.w(),
            scales: w.rs(),
            rows: w.rows,
            cols: w.cols,
        }
    }
}

/// Where a GEMM writes: f32 rows of stride `ldc`, from column `col0`, stored or added.
struct Q8Out {
    ptr: u64,
    ldc: usize,
    col0: usize,
    accumulate: bool,
}

/// Weight rows a block of the GEMM takes (gemm_q8.cu `gemm_q8_narrow`).
const WEIGHT_ROWS: usize = 16;

/// Quantises the `t` bf16 rows of `k` values at `x` into `xq` ([`scratch_bytes`]): s8 values,
/// then the blocks' scales.
fn quantize(dev: &Dev, k8: &Q8GemmKernels, (x, t, k): (u64, usize, usize), xq: u64) -> DResult<()> {
    let blocks = t * (k / 32);
    dev.launch(
        &k8.quant_blocks_s8,
        (blocks.div_ceil(8) as u32, 1, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(x),
            Arg::I32(k as i32),
            Arg::U64(k as u64),
            Arg::I32(t as i32),
            Arg::Ptr(xq),
            Arg::Ptr(xq + (t * k) as u64),
        ],
    )
}

/// The GEMM over `t` rows quantised at `xq` by [`quantize`].
fn mma(dev: &Dev, k8: &Q8GemmKernels, w: &Q8Mat, t: usize, xq: u64, out: &Q8Out) -> DResult<()> {
    let k = w.cols;
    dev.launch(
        &k8.gemm,
        (
            w.rows.div_ceil(WEIGHT_ROWS) as u32,
            t.div_ceil(64) as u32,
            1,
        ),
        (128, 1, 1),
        0,
        &[
            Arg::Ptr(w.w),
            Arg::Ptr(w.scales),
            Arg::I32(w.rows as i32),
            Arg::I32(k as i32),
            Arg::Ptr(xq),
            Arg::Ptr(xq + (t * k) as u64),
            Arg::I32(t as i32),
            Arg::Ptr(out.ptr),
            Arg::U64(out.ldc as u64),
            Arg::I32(out.col0 as i32),
            Arg::I32(out.accumulate as i32),
        ],
    )
}

/// The W8A16 GEMM over the `t` bf16 rows at `x` (row stride = `w.cols`), its K split over
/// blocks through `parts` (device address, bytes) when the matrix has too few tiles to fill the
/// device.
fn w8_bf16(
    dev: &Dev,
    k8: &Q8GemmKernels,
    w: &Q8Mat,
    (x, t): (u64, usize),
    out: &Q8Out,
    (parts, parts_len): (u64, usize),
) -> DResult<()> {
    let (splits, per) = w8_splits(dev, t, w.rows, w.cols);
    if splits > 1 && 4 * splits * t * w.rows > parts_len {
        return Err(crate::cuda::runtime::device::DevError(format!(
            "W8A16 GEMM: {splits} splits of {t} × {} outputs exceed the {parts_len}-byte scratch",
            w.rows
        )));
    }
    dev.launch(
        &k8.gemm_w8,
        (
            t.div_ceil(64) as u32,
            w.rows.div_ceil(64) as u32,
            splits as u32,
        ),
        (128, 1, 1),
        0,
        &[
            Arg::Ptr(w.w),
            Arg::Ptr(w.scales),
            Arg::I32(w.rows as i32),
            Arg::I32(w.cols as i32),
            Arg::Ptr(x),
            Arg::U64(w.cols as u64),
            Arg::I32(t as i32),
            Arg::Ptr(out.ptr),
            Arg::U64(out.ldc as u64),
            Arg::I32(out.col0 as i32),
            Arg::I32(out.accumulate as i32),
            Arg::Ptr(parts),
            Arg::I32(per as i32),
        ],
    )?;
    if splits == 1 {
        return Ok(());
    }
    dev.launch(
        &k8.gemm_w8_reduce,
        ((t * w.rows).div_ceil(256) as u32, 1, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(parts),
            Arg::I32(splits as i32),
            Arg::Ptr(w.scales),
            Arg::I32(w.rows as i32),
            Arg::I32(t as i32),
            Arg::Ptr(out.ptr),
            Arg::U64(out.ldc as u64),
            Arg::I32(out.col0 as i32),
            Arg::I32(out.accumulate as i32),
        ],
    )
}

/// Test hook: the GEMM alone over host inputs, in the layouts of
/// [`crate::llm::batch::q8_gemm_reference`]: `w` s8 `[n, k]` with f16 row scales, `x` f32
/// `[t, k]` (rounded to bf16 here, as the step's inputs are), `out` `[t, ldc]` updated from
/// column `col0` (added to when `accumulate`).
#[allow(clippy::too_many_arguments)]
pub fn q8_gemm_probe(
    dev: &Dev,
    (w, scales): (&[i8], &[half::f16]),
    k: usize,
    x: &[f32],
    out: &mut [f32],
    (ldc, col0, accumulate): (usize, usize, bool),
    bf16_inputs: bool,
) -> DResult<()> {
    let (n, t) = (scales.len(), x.len() / k);
    let k8 = Q8GemmKernels::load(dev)?;
    let wq: Vec<u8> = w.iter().map(|&v| v as u8).collect();
    let ws: Vec<u16> = scales.iter().map(|s| s.to_bits()).collect();
    let xb: Vec<u16> = x
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_bits())
        .collect();
    let (wd, sd, xd) = (
        dev.upload_new(&wq)?,
        dev.upload_new(bytes_of(&ws))?,
        dev.upload_new(bytes_of(&xb))?,
    );
    let scratch = dev.alloc(scratch_bytes(t, k))?;
    let od = dev.upload_new(bytes_of(out))?;
    let mat = Q8Mat {
        w: wd.ptr(),
        scales: sd.ptr(),
        rows: n,
        cols: k,
    };
    let dst = Q8Out {
        ptr: od.ptr(),
        ldc,
        col0,
        accumulate,
    };
    if bf16_inputs {
        let parts = dev.alloc(w8_parts_bytes(dev))?;
        w8_bf16(
            dev,
            &k8,
            &mat,
            (xd.ptr(), t),
            &dst,
            (parts.ptr(), parts.len()),
        )?;
    } else {
        quantize(dev, &k8, (xd.ptr(), t, k), scratch.ptr())?;
        mma(dev, &k8, &mat, t, scratch.ptr(), &dst)?;
    }
    dev.download_f32(out, od.ptr())
}
