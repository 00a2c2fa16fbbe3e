//! Weight × activation products: `matvec` (decode, one input row) and `matmul` (prefill, n rows).
//!
//! Per codec family:
//! - f32 / f16 / bf16: weights widened to f32 exactly, f32 products and sums (f32-accurate).
//! - q8_row / q8_2f: the input is quantized per 32-block to int8 ([`crate::act`]), the products
//!   run in int8 with i32 sums per block, then `Σ_b d_b·I_b` in f32 times the row scale. For q8_2f
//!   the column field is folded into the input first (`x'[i] = x[i]·col[i]`).
//! - q4_block / q4_tiled / q4tp (cols % 32 == 0): the same int8 input; per group
//!   `s_w·(d_x·Σqx − 8·d_x·Σx)`. q4_block tensors whose groups straddle rows (cols % 32 != 0) take
//!   a decode-row path (exact in f32, slow; no converter writes such matrices for the models).
//!
//! Work is split over output rows on the crate's pool. Each ISA module implements the same
//! matvec kernels (one input row against a range of weight rows). `matmul` with a few input rows
//! (n ≤ 16: a batch's decode step) reads each weight row once for all of them — q8 codecs through
//! multi-input kernels (AVX-512: 16-row strips transposed in registers), the others through the
//! matvec kernels row block by row block — and takes the packed GEMM (`gemm.rs`) for larger n on
//! the SIMD paths.

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
#[cfg(target_arch = "x86_64")]
mod gemm;
pub(crate) mod portable;

use cmf_format::Dtype;

use crate::act::{self, Order, QAct};
use crate::codec::{Q4, Q8};
use crate::cpu::Isa;
use crate::pool::{self, SendPtr};
use crate::Weight;

/// f32 / f16 / bf16 weights.
#[derive(Clone, Copy)]
pub(crate) struct FloatW<'a> {
    pub dtype: Dtype,
    pub data: &'a [u8],
    pub cols: usize,
}

impl<'a> FloatW<'a> {
    /// `w` read as a float matrix; `None` for the quantized codecs.
    pub fn of(w: &Weight<'a>) -> Option<Self> {
        matches!(w.dtype, Dtype::F32 | Dtype::F16 | Dtype::Bf16).then_some(FloatW {
            dtype: w.dtype,
            data: w.data,
            cols: w.cols,
        })
    }

    /// Decodes row `r` to f32 (exact for every float codec).
    pub fn decode_row(&self, r: usize, out: &mut [f32]) {
        let c = self.cols;
        match self.dtype {
            Dtype::F32 => {
                for (o, b) in out
                    .iter_mut()
                    .zip(self.data[r * c * 4..(r + 1) * c * 4].chunks_exact(4))
                {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            Dtype::F16 => {
                for (o, b) in out
                    .iter_mut()
                    .zip(self.data[r * c * 2..(r + 1) * c * 2].chunks_exact(2))
                {
                    *o = crate::codec::f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
                }
            }
            Dtype::Bf16 => {
                for (o, b) in out
                    .iter_mut()
                    .zip(self.data[r * c * 2..(r + 1) * c * 2].chunks_exact(2))
                {
                    *o = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
                }
            }
            _ => unreachable!("FloatW holds a float codec"),
        }
    }
}

/// The shape of a product, resolved once per call.
pub(crate) enum Plan<'a> {
    Float(FloatW<'a>),
    Q8(Q8<'a>),
    Q4(Q4<'a>),
    /// q4_block with groups straddling rows: decode each row, f32 dot.
    DecodeRows,
}

fn plan<'a>(w: &Weight<'a>) -> Plan<'a> {
    if let Some(f) = FloatW::of(w) {
        return Plan::Float(f);
    }
    match w.dtype {
        Dtype::Q8Row | Dtype::Q8_2f => Plan::Q8(Q8::new(w)),
        Dtype::Q4Block | Dtype::Q4Tiled | Dtype::Q4Tp => match Q4::new(w) {
            Some(q) => Plan::Q4(q),
            None => Plan::DecodeRows,
        },
        other => panic!("cmf-kernels: codec {other} is not a matrix codec"),
    }
}

/// The activation order each ISA's q4 kernels expect.
fn q4_order(isa: Isa) -> Order {
    match isa {
        Isa::Avx512 => Order::QuadEvenOdd,
        Isa::Avx2 | Isa::Portable => Order::EvenOdd,
    }
}

/// Folds q8_2f's column field into the input rows (x'[i] = x[i]·col[i]).
fn fold_columns(q: &Q8, x: &[f32], n: usize, cols: usize) -> Option<Vec<f32>> {
    let col = q.col?;
    let colf: Vec<f32> = (0..cols).map(|i| crate::codec::f16_at(col, i)).collect();
    let mut out = x.to_vec();
    for t in 0..n {
        for (o, c) in out[t * cols..(t + 1) * cols].iter_mut().zip(&colf) {
            *o *= c;
        }
    }
    Some(out)
}

/// Input rows prepared for one weight's kernels: quantized once per call (int8 codecs, with the
/// q8_2f column field folded in and, on AVX-512, per-token lane tables).
enum Prepared<'x> {
    Float(&'x [f32]),
    Q8 {
        a: QAct,
        lanes: Vec<act::LaneTables>,
        c_total: Vec<f32>,
    },
    Q4 {
        a: QAct,
        lanes: Vec<act::LaneTables>,
    },
}

fn prepare<'x>(isa: Isa, plan: &Plan, x: &'x [f32], n: usize, cols: usize) -> Prepared<'x> {
    match plan {
        Plan::Float(_) | Plan::DecodeRows => Prepared::Float(x),
        Plan::Q8(q) => {
            let folded = fold_columns(q, x, n, cols);
            let a = act::quantize(
                isa,
                folded.as_deref().unwrap_or(x),
                n,
                cols,
                Order::Natural,
                128.0,
            );
            let (mut lanes, mut c_total) = (Vec::new(), Vec::new());
            if isa == Isa::Avx512 {
                for t in 0..n {
                    lanes.push(act::lane_tables(&a, t, Order::Natural, 128.0));
                    c_total.push(a.c[t * a.nb..(t + 1) * a.nb].iter().sum());
                }
            }
            Prepared::Q8 { a, lanes, c_total }
        }
        Plan::Q4(_) => {
            let order = q4_order(isa);
            let a = act::quantize(isa, x, n, cols, order, 8.0);
            let lanes = if isa == Isa::Avx512 {
                (0..n)
                    .map(|t| act::lane_tables(&a, t, order, 8.0))
                    .collect()
            } else {
                Vec::new()
            };
            Prepared::Q4 { a, lanes }
        }
    }
}

/// y[i] = row(r0 + i) · input row t, for i < y.len(): the per-ISA matvec kernels.
// Off x86-64 only the portable arms exist, which do not read the AVX-512 lane tables.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
fn run_rows(
    isa: Isa,
    w: &Weight,
    plan: &Plan,
    prep: &Prepared,
    t: usize,
    r0: usize,
    y: &mut [f32],
) {
    let cols = w.cols;
    match (plan, prep) {
        (Plan::Float(fw), Prepared::Float(x)) => {
            let x = &x[t * cols..(t + 1) * cols];
            match isa {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the dispatcher checked that the CPU runs this path.
                Isa::Avx512 => unsafe { avx512::float_matvec(fw, x, r0, y) },
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => unsafe { avx2::float_matvec(fw, x, r0, y) },
                _ => portable::float_matvec(fw, x, r0, y),
            }
        }
        (Plan::Q8(q), Prepared::Q8 { a, lanes, c_total }) => match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { avx512::q8_matvec(q, a, t, &lanes[t], c_total[t], r0, y) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { avx2::q8_matvec(q, a, t, r0, y) },
            _ => portable::q8_matvec(q, a, t, r0, y),
        },
        (Plan::Q4(q), Prepared::Q4 { a, lanes }) => match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { avx512::q4_matvec(q, a, t, &lanes[t], r0, y) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { avx2::q4_matvec(q, a, t, r0, y) },
            _ => portable::q4_matvec(q, a, t, r0, y),
        },
        (Plan::DecodeRows, Prepared::Float(x)) => {
            portable::decode_rows_matvec(w, &x[t * cols..(t + 1) * cols], r0, y)
        }
        _ => unreachable!("input prepared for another plan"),
    }
}

/// Row chunk for matvec tasks: a multiple of 16, about 4 chunks per thread (load balance), but
/// not so small that pool overhead dominates.
fn row_chunk(rows: usize, cols: usize) -> usize {
    let threads = pool::num_threads().max(1);
    let by_balance = rows.div_ceil(threads * 4);
    // At least ~64 KiB of weights per task.
    let by_size = (65536 / cols.max(1)).max(1);
    by_balance.max(by_size).div_ceil(16) * 16
}

fn check_shapes(op: &str, w: &Weight, x: &[f32], n: usize, y: &[f32], isa: Isa) {
    w.check()
        .unwrap_or_else(|e| panic!("cmf-kernels::{op}: {e}"));
    assert_eq!(
        x.len(),
        n * w.cols,
        "{op}: x has {} values, expected n·cols = {}·{}",
        x.len(),
        n,
        w.cols
    );
    assert_eq!(
        y.len(),
        n * w.rows,
        "{op}: y has {} values, expected n·rows = {}·{}",
        y.len(),
        n,
        w.rows
    );
    assert!(isa.supported(), "{op}: {isa} is not supported by this CPU");
}

/// y[rows] = W · x[cols] on the given path (`isa` must be supported by this CPU).
pub fn matvec_with(isa: Isa, w: &Weight, x: &[f32], y: &mut [f32]) {
    check_shapes("matvec", w, x, 1, y, isa);
    if w.rows == 0 {
        return;
    }
    let plan = plan(w);
    let prep = prepare(isa, &plan, x, 1, w.cols);
    let chunk = row_chunk(w.rows, w.cols);
    let yp = SendPtr(y.as_mut_ptr());
    pool::for_each_task(w.rows.div_ceil(chunk), |i| {
        let (r0, r1) = (i * chunk, ((i + 1) * chunk).min(w.rows));
        // SAFETY: task i owns y[r0..r1].
        run_rows(isa, w, &plan, &prep, 0, r0, unsafe {
            yp.slice(r0, r1 - r0)
        })
    });
}

/// `ys[j] = W_j · x` for several weights that read the same input (q|k|v, gate|up): the input
/// is quantized once and the rows of all of them are split over the pool in one dispatch, so a
/// decode layer waits at one barrier per group instead of one per matrix, and small matrices
/// (k/v) share their tail imbalance with the big ones. Weights whose codecs or column counts
/// differ, or that carry per-weight input transforms (q8_2f's column field, q4_block with rows
/// straddling groups), run one `matvec_with` each: the same results either way.
pub fn matvec_multi_with(isa: Isa, ws: &[&Weight], x: &[f32], ys: &mut [&mut [f32]]) {
    assert_eq!(
        ws.len(),
        ys.len(),
        "matvec_multi: {} weights but {} outputs",
        ws.len(),
        ys.len()
    );
    for (w, y) in ws.iter().zip(ys.iter()) {
        check_shapes("matvec_multi", w, x, 1, y, isa);
    }
    let Some(first) = ws.first() else { return };
    let shared = ws
        .iter()
        .all(|w| w.dtype == first.dtype && w.cols == first.cols)
        && first.dtype != Dtype::Q8_2f;
    let plans: Vec<Plan> = ws.iter().map(|w| plan(w)).collect();
    if !shared || plans.iter().any(|p| matches!(p, Plan::DecodeRows)) {
        for (w, y) in ws.iter().zip(ys.iter_mut()) {
            matvec_with(isa, w, x, y);
        }
        return;
    }
    let cols = first.cols;
    let prep = prepare(isa, &plans[0], x, 1, cols);
    let tasks = row_tasks(ws, cols);
    let yps: Vec<SendPtr<f32>> = ys.iter_mut().map(|y| SendPtr(y.as_mut_ptr())).collect();
    pool::for_each_task(tasks.len(), |i| {
        let (j, r0, r1) = tasks[i];
        // SAFETY: task i owns ys[j][r0..r1]; the tasks' ranges are disjoint.
        run_rows(isa, ws[j], &plans[j], &prep, 0, r0, unsafe {
            yps[j].slice(r0, r1 - r0)
        })
    });
}

/// The pool's tasks over the rows of several weights of `cols` columns, as (weight, first row,
/// end row); a chunk never straddles two weights.
fn row_tasks(ws: &[&Weight], cols: usize) -> Vec<(usize, usize, usize)> {
    let total: usize = ws.iter().map(|w| w.rows).sum();
    let chunk = row_chunk(total, cols);
    let mut tasks = Vec::new();
    for (j, w) in ws.iter().enumerate() {
        let mut r0 = 0;
        while r0 < w.rows {
            let r1 = (r0 + chunk).min(w.rows);
            tasks.push((j, r0, r1));
            r0 = r1;
        }
    }
    tasks
}

/// `Y_j = X·W_jᵀ` for several weights reading the same `n` input rows (q|k|v, gate|up of a
/// batch's decode step): for a few rows (n ≤ [`SMALL_N`]) the input is quantized once and the
/// rows of all the weights are split over the pool in one dispatch, as [`matvec_multi_with`]
/// does for one row. Each result is `matmul_with`'s, bit for bit; more rows, and the groups
/// `matvec_multi_with` runs one by one, run one `matmul_with` each.
pub fn matmul_multi_with(isa: Isa, ws: &[&Weight], x: &[f32], n: usize, ys: &mut [&mut [f32]]) {
    assert_eq!(
        ws.len(),
        ys.len(),
        "matmul_multi: {} weights but {} outputs",
        ws.len(),
        ys.len()
    );
    for (w, y) in ws.iter().zip(ys.iter()) {
        check_shapes("matmul_multi", w, x, n, y, isa);
    }
    let Some(first) = ws.first() else { return };
    let shared = ws
        .iter()
        .all(|w| w.dtype == first.dtype && w.cols == first.cols)
        && first.dtype != Dtype::Q8_2f;
    let plans: Vec<Plan> = ws.iter().map(|w| plan(w)).collect();
    if n == 0 || n > SMALL_N || !shared || plans.iter().any(|p| matches!(p, Plan::DecodeRows)) {
        for (w, y) in ws.iter().zip(ys.iter_mut()) {
            matmul_with(isa, w, x, n, y);
        }
        return;
    }
    let cols = first.cols;
    let prep = prepare(isa, &plans[0], x, n, cols);
    let tasks = row_tasks(ws, cols);
    let yps: Vec<SendPtr<f32>> = ys.iter_mut().map(|y| SendPtr(y.as_mut_ptr())).collect();
    pool::for_each_task(tasks.len(), |i| {
        let (j, r0, r1) = tasks[i];
        // SAFETY: task i owns columns r0..r1 of every output row of ys[j]; the tasks' ranges
        // are disjoint.
        unsafe {
            run_rows_all_inputs(
                isa,
                ws[j],
                &plans[j],
                &prep,
                n,
                r0,
                r1,
                yps[j].ptr(),
                ws[j].rows,
            )
        }
    });
}

/// Inputs up to this many rows read each weight row once for all of them
/// ([`run_rows_all_inputs`]); more take the packed GEMM on the SIMD paths.
const SMALL_N: usize = 16;

/// Y[n, rows] = X[n, cols] · Wᵀ on the given path.
pub fn matmul_with(isa: Isa, w: &Weight, x: &[f32], n: usize, y: &mut [f32]) {
    check_shapes("matmul", w, x, n, y, isa);
    if n == 0 || w.rows == 0 {
        return;
    }
    let (rows, cols) = (w.rows, w.cols);
    let plan = plan(w);
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Portable && n > SMALL_N && !matches!(plan, Plan::DecodeRows) {
        return gemm::matmul(isa, &plan, rows, cols, x, n, y);
    }
    // A task owns rows r0..r1 of every output row (disjoint writes).
    let prep = prepare(isa, &plan, x, n, cols);
    let chunk = row_chunk(rows, cols);
    let yp = SendPtr(y.as_mut_ptr());
    pool::for_each_task(rows.div_ceil(chunk), |i| {
        let (r0, r1) = (i * chunk, ((i + 1) * chunk).min(rows));
        // SAFETY: columns r0..r1 of every output row belong to this task.
        unsafe { run_rows_all_inputs(isa, w, &plan, &prep, n, r0, r1, yp.ptr(), rows) }
    });
}

/// Weight rows `r0..r1` against all `n` prepared input rows, `Y[t, r]` at `y + t·ldy + r`.
/// q8 codecs read each weight row once for several inputs: on AVX-512 in strips of 16 rows
/// transposed in registers (the matvec's result to f32 rounding), on AVX2 and the portable path
/// row by row with the matvec's arithmetic per input (bit for bit). Other codecs run the
/// matvec kernels per input over row blocks of ~32 KiB, so every input meets a block while it
/// is cache-resident.
///
/// # Safety
/// `y` must be writable at `t·ldy + r` for t < n, r0 ≤ r < r1, and written by no one else.
#[allow(clippy::too_many_arguments)]
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
unsafe fn run_rows_all_inputs(
    isa: Isa,
    w: &Weight,
    plan: &Plan,
    prep: &Prepared,
    n: usize,
    r0: usize,
    r1: usize,
    y: *mut f32,
    ldy: usize,
) {
    match (isa, plan, prep) {
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512, Plan::Q8(q), Prepared::Q8 { a, c_total, .. }) if n >= 2 => {
            avx512::q8_strip_matmul(q, a, c_total, r0, r1 - r0, y.add(r0), ldy)
        }
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, Plan::Q8(q), Prepared::Q8 { a, .. }) => {
            avx2::q8_matmul_rows(q, a, n, r0, r1 - r0, y.add(r0), ldy)
        }
        (Isa::Portable, Plan::Q8(q), Prepared::Q8 { a, .. }) => {
            portable::q8_matmul_rows(q, a, n, r0, r1 - r0, y.add(r0), ldy)
        }
        _ => {
            let block = (32768 / w.cols.max(1)).max(4);
            let mut b0 = r0;
            while b0 < r1 {
                let b1 = (b0 + block).min(r1);
                for t in 0..n {
                    // SAFETY: output row t, columns b0..b1 ⊂ r0..r1, are the caller's to write.
                    let out = std::slice::from_raw_parts_mut(y.add(t * ldy + b0), b1 - b0);
                    run_rows(isa, w, plan, prep, t, b0, out);
                }
                b0 = b1;
            }
        }
    }
}
