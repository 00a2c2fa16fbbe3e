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
//! kernels; `portable` is the behaviour every other path is tested against (besides `reference`).

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
#[cfg(target_arch = "x86_64")]
mod gemm;
pub(crate) mod portable;

use cmf_format::Dtype;

use crate::act::{self, Order};
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

impl FloatW<'_> {
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
                    *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
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
    match w.dtype {
        Dtype::F32 | Dtype::F16 | Dtype::Bf16 => Plan::Float(FloatW {
            dtype: w.dtype,
            data: w.data,
            cols: w.cols,
        }),
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
        Isa::Avx512 => Order::PairEvenOdd,
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

/// Row chunk for matvec tasks: a multiple of 16, about 4 chunks per thread (load balance), but
/// not so small that pool overhead dominates.
fn row_chunk(rows: usize, cols: usize) -> usize {
    let threads = pool::num_threads().max(1);
    let by_balance = rows.div_ceil(threads * 4);
    // At least ~64 KiB of weights per task.
    let by_size = (65536 / cols.max(1)).max(1);
    by_balance.max(by_size).div_ceil(16) * 16
}

/// Splits `y[rows]` into chunks and runs `f(r0, y_chunk)` on the pool.
fn split_rows(
    rows: usize,
    cols: usize,
    y: &mut [f32],
    f: impl Fn(usize, &mut [f32]) + Sync + Send,
) {
    let chunk = row_chunk(rows, cols);
    let tasks = rows.div_ceil(chunk);
    let yp = SendPtr(y.as_mut_ptr());
    pool::for_each_task(tasks, |i| {
        let r0 = i * chunk;
        let r1 = (r0 + chunk).min(rows);
        // SAFETY: task i owns y[r0..r1].
        f(r0, unsafe { yp.slice(r0, r1 - r0) });
    });
}

/// y[rows] = W · x[cols] on the given path (`isa` must be supported by this CPU).
pub fn matvec_with(isa: Isa, w: &Weight, x: &[f32], y: &mut [f32]) {
    w.check()
        .unwrap_or_else(|e| panic!("cmf-kernels::matvec: {e}"));
    assert_eq!(
        x.len(),
        w.cols,
        "matvec: x has {} values, the weight has {} columns",
        x.len(),
        w.cols
    );
    assert_eq!(
        y.len(),
        w.rows,
        "matvec: y has {} values, the weight has {} rows",
        y.len(),
        w.rows
    );
    assert!(
        isa.supported(),
        "matvec: {isa} is not supported by this CPU"
    );
    let (rows, cols) = (w.rows, w.cols);
    match plan(w) {
        Plan::Float(fw) => split_rows(rows, cols, y, |r0, yc| match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { avx512::float_matvec(&fw, x, r0, yc) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { avx2::float_matvec(&fw, x, r0, yc) },
            _ => portable::float_matvec(&fw, x, r0, yc),
        }),
        Plan::Q8(q) => {
            let folded = fold_columns(&q, x, 1, cols);
            let x = folded.as_deref().unwrap_or(x);
            let a = act::quantize(x, 1, cols, Order::Natural, 128.0);
            match isa {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 => {
                    let lanes = act::lane_tables(&a, 0, Order::Natural, 128.0);
                    let c_total: f32 = a.c.iter().sum();
                    split_rows(rows, cols, y, |r0, yc| unsafe {
                        avx512::q8_matvec(&q, &a, &lanes, c_total, r0, yc)
                    })
                }
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => split_rows(rows, cols, y, |r0, yc| unsafe {
                    avx2::q8_matvec(&q, &a, r0, yc)
                }),
                _ => split_rows(rows, cols, y, |r0, yc| portable::q8_matvec(&q, &a, r0, yc)),
            }
        }
        Plan::Q4(q) => {
            let order = q4_order(isa);
            let a = act::quantize(x, 1, cols, order, 8.0);
            match isa {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 => {
                    let lanes = act::lane_tables(&a, 0, order, 8.0);
                    split_rows(rows, cols, y, |r0, yc| unsafe {
                        avx512::q4_matvec(&q, &a, &lanes, r0, yc)
                    })
                }
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => split_rows(rows, cols, y, |r0, yc| unsafe {
                    avx2::q4_matvec(&q, &a, r0, yc)
                }),
                _ => split_rows(rows, cols, y, |r0, yc| portable::q4_matvec(&q, &a, r0, yc)),
            }
        }
        Plan::DecodeRows => split_rows(rows, cols, y, |r0, yc| {
            portable::decode_rows_matvec(w, x, r0, yc)
        }),
    }
}

/// Y[n, rows] = X[n, cols] · Wᵀ on the given path.
pub fn matmul_with(isa: Isa, w: &Weight, x: &[f32], n: usize, y: &mut [f32]) {
    w.check()
        .unwrap_or_else(|e| panic!("cmf-kernels::matmul: {e}"));
    assert_eq!(
        x.len(),
        n * w.cols,
        "matmul: x has {} values, expected n·cols = {}·{}",
        x.len(),
        n,
        w.cols
    );
    assert_eq!(
        y.len(),
        n * w.rows,
        "matmul: y has {} values, expected n·rows = {}·{}",
        y.len(),
        n,
        w.rows
    );
    assert!(
        isa.supported(),
        "matmul: {isa} is not supported by this CPU"
    );
    if n == 0 || w.rows == 0 {
        return;
    }
    if n == 1 {
        return matvec_with(isa, w, x, y);
    }
    let (rows, cols) = (w.rows, w.cols);
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Portable {
        let p = plan(w);
        if !matches!(p, Plan::DecodeRows) {
            return gemm::matmul(isa, &p, rows, cols, x, n, y);
        }
    }
    // Portable: row-stationary. Each task owns a range of output columns (weight rows) across all
    // n output rows, so writes go through a raw pointer (disjoint per task).
    let yp = SendPtr(y.as_mut_ptr());
    let chunk = (rows.div_ceil(pool::num_threads() * 4)).max(8);
    let tasks = rows.div_ceil(chunk);
    match plan(w) {
        Plan::Float(fw) => pool::for_each_task(tasks, |i| {
            let (r0, r1) = (i * chunk, ((i + 1) * chunk).min(rows));
            portable::float_matmul(&fw, x, n, r0, r1, yp, rows)
        }),
        Plan::Q8(q) => {
            let folded = fold_columns(&q, x, n, cols);
            let a = act::quantize(
                folded.as_deref().unwrap_or(x),
                n,
                cols,
                Order::Natural,
                128.0,
            );
            pool::for_each_task(tasks, |i| {
                let (r0, r1) = (i * chunk, ((i + 1) * chunk).min(rows));
                portable::q8_matmul(&q, &a, n, r0, r1, yp, rows)
            })
        }
        Plan::Q4(q) => {
            let a = act::quantize(x, n, cols, Order::EvenOdd, 8.0);
            pool::for_each_task(tasks, |i| {
                let (r0, r1) = (i * chunk, ((i + 1) * chunk).min(rows));
                portable::q4_matmul(&q, &a, n, r0, r1, yp, rows)
            })
        }
        Plan::DecodeRows => pool::for_each_task(tasks, |i| {
            let (r0, r1) = (i * chunk, ((i + 1) * chunk).min(rows));
            portable::decode_rows(w, x, n, r0, r1, yp, rows)
        }),
    }
}

pub(crate) use Plan as WeightPlan;
