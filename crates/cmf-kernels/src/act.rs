//! Activation quantization for the int8 kernels.
//!
//! Scheme (like llama.cpp's q8_0 activations): blocks of 32 consecutive inputs, one f32 scale per
//! block, `d = max|x| / 127`, `q = round_half_even(x / d)` in [−127, 127]. A block of zeros has
//! d = 0. The per-element error is at most d/2, so for one output
//! `|y − y_exact| ≤ Σ_b (d_b / 2) · Σ_{i∈b} |w_i|` (plus f32 rounding): that is the bound the
//! parity tests check. Per-32 blocks rather than one scale per row keep an outlier channel (common
//! in LLM activations) from flattening the rest of the row; `docs/kernels.md` has the measurements.
//!
//! The int8 kernels multiply unsigned by signed bytes (`vpdpbusd`, `pmaddubsw`) and need the
//! per-block sums Σq to undo an offset: q8 weights are fed as `w + 128` (so Σ(w+128)q = Σwq + 128Σq)
//! and q4 nibbles as `q` (w = q − 8, so Σ(q−8)x = Σqx − 8Σx). `c[b] = offset · d[b] · Σq_b` is that
//! correction in output units, stored per block.
//!
//! Element order inside the quantized row depends on the weight codec and the kernel (see [`Order`]):
//! q4 groups keep element 2j in a low nibble and 2j+1 in a high one, and it is cheaper to permute
//! the activation once than to re-interleave nibbles for every row.

use crate::codec::GROUP;

/// The order quantized inputs are stored in, within each block (or pair of blocks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Order {
    /// x[0], x[1], … unchanged (q8 codecs).
    Natural,
    /// Per 32-block: the 16 even elements, then the 16 odd ones (low nibbles, then high).
    EvenOdd,
    /// Per pair of 32-blocks (b0, b1): b0 even, b1 even, b0 odd, b1 odd (16 each) — the lane order
    /// of the AVX-512 q4 kernels (rows are padded to 64, so every block has a partner).
    PairEvenOdd,
}

/// Quantized activation rows: `n` rows of `kp` int8 values (cols rounded up to 64, zero padded).
pub(crate) struct QAct {
    pub kp: usize,
    /// Blocks per row (kp / 32).
    pub nb: usize,
    /// n × kp
    pub qs: Vec<i8>,
    /// n × nb block scales.
    pub d: Vec<f32>,
    /// n × nb: offset · d · Σq per block (see the module comment).
    pub c: Vec<f32>,
    /// n × nb: Σq per block.
    pub sum: Vec<i32>,
}

impl QAct {
    pub fn row(&self, t: usize) -> &[i8] {
        &self.qs[t * self.kp..(t + 1) * self.kp]
    }
}

/// Padded row length for `cols` inputs.
pub(crate) fn padded(cols: usize) -> usize {
    cols.div_ceil(64) * 64
}

/// Index in the permuted row of input `i` (i < kp).
#[inline]
fn dest(order: Order, i: usize) -> usize {
    let (b, j) = (i / GROUP, i % GROUP);
    match order {
        Order::Natural => i,
        Order::EvenOdd => b * GROUP + (j % 2) * 16 + j / 2,
        // Rows are padded to 64, so blocks always come in pairs.
        Order::PairEvenOdd => (b / 2) * 64 + (j % 2) * 32 + (b % 2) * 16 + j / 2,
    }
}

/// Quantizes `n` rows of `cols` inputs. `offset` is the weight offset the kernel compensates
/// (128 for q8 codecs fed as w+128, 8 for q4 nibbles, 0 when unused).
pub(crate) fn quantize(x: &[f32], n: usize, cols: usize, order: Order, offset: f32) -> QAct {
    let kp = padded(cols);
    let nb = kp / GROUP;
    let mut a = QAct {
        kp,
        nb,
        qs: vec![0; n * kp],
        d: vec![0.0; n * nb],
        c: vec![0.0; n * nb],
        sum: vec![0; n * nb],
    };
    // Each row is independent; rows are split over the pool only when there are many of them.
    let rows_per_task = 16usize;
    let tasks = n.div_ceil(rows_per_task);
    let qs = crate::pool::SendPtr(a.qs.as_mut_ptr());
    let d = crate::pool::SendPtr(a.d.as_mut_ptr());
    let c = crate::pool::SendPtr(a.c.as_mut_ptr());
    let s = crate::pool::SendPtr(a.sum.as_mut_ptr());
    crate::pool::for_each_task(tasks, |task| {
        for t in task * rows_per_task..((task + 1) * rows_per_task).min(n) {
            // SAFETY: row t of each buffer belongs to this task only.
            let (qs, d, c, s) = unsafe {
                (
                    qs.slice(t * kp, kp),
                    d.slice(t * nb, nb),
                    c.slice(t * nb, nb),
                    s.slice(t * nb, nb),
                )
            };
            quantize_row(&x[t * cols..(t + 1) * cols], order, offset, qs, d, c, s);
        }
    });
    a
}

fn quantize_row(
    x: &[f32],
    order: Order,
    offset: f32,
    qs: &mut [i8],
    d: &mut [f32],
    c: &mut [f32],
    s: &mut [i32],
) {
    let nb = d.len();
    let mut buf = [0i8; GROUP];
    for b in 0..nb {
        let lo = (b * GROUP).min(x.len());
        let hi = ((b + 1) * GROUP).min(x.len());
        let xb = &x[lo..hi];
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let (db, inv) = if amax > 0.0 && amax.is_finite() {
            (amax / 127.0, 127.0 / amax)
        } else {
            (0.0, 0.0)
        };
        let mut sum = 0i32;
        buf.fill(0);
        for (q, v) in buf.iter_mut().zip(xb) {
            *q = (v * inv).round_ties_even().clamp(-127.0, 127.0) as i8;
            sum += *q as i32;
        }
        if order == Order::Natural {
            qs[b * GROUP..(b + 1) * GROUP].copy_from_slice(&buf);
        } else {
            for (j, q) in buf.iter().enumerate() {
                qs[dest(order, b * GROUP + j)] = *q;
            }
        }
        d[b] = db;
        s[b] = sum;
        c[b] = offset * db * sum as f32;
    }
}

/// Per-lane tables for the AVX-512 matvec kernels, whose i32 lanes each sum 4 consecutive bytes
/// of the (permuted) row: `dl[l]` is the scale of the block lane `l` belongs to, `cl[l]` is
/// `offset · d · Σq` over the lane's 4 inputs.
pub(crate) struct LaneTables {
    pub dl: Vec<f32>,
    pub cl: Vec<f32>,
}

pub(crate) fn lane_tables(a: &QAct, t: usize, order: Order, offset: f32) -> LaneTables {
    let lanes = a.kp / 4;
    let mut dl = vec![0f32; lanes];
    let mut cl = vec![0f32; lanes];
    let row = a.row(t);
    // Invert the permutation lane by lane: which block does permuted position p come from?
    let mut block_of = vec![0usize; a.kp];
    for i in 0..a.kp {
        block_of[dest(order, i)] = i / GROUP;
    }
    for l in 0..lanes {
        let b = block_of[4 * l];
        let db = a.d[t * a.nb + b];
        let sum: i32 = row[4 * l..4 * l + 4].iter().map(|&q| q as i32).sum();
        dl[l] = db;
        cl[l] = offset * db * sum as f32;
    }
    LaneTables { dl, cl }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orders_are_permutations_within_blocks() {
        for nb in [2usize, 4, 6] {
            for order in [Order::Natural, Order::EvenOdd, Order::PairEvenOdd] {
                let mut seen = vec![false; nb * GROUP];
                for i in 0..nb * GROUP {
                    let p = dest(order, i);
                    assert!(!seen[p], "{order:?} nb {nb}: {i} collides");
                    seen[p] = true;
                    // A permuted position stays inside its own block, or its own pair of blocks.
                    assert_eq!(p / 64, i / 64);
                }
            }
        }
    }

    #[test]
    fn quantization_error_within_half_step() {
        let x: Vec<f32> = (0..100)
            .map(|i| ((i * 37 % 17) as f32 - 8.0) * 0.31 + if i == 40 { 50.0 } else { 0.0 })
            .collect();
        let a = quantize(&x, 1, 100, Order::Natural, 0.0);
        assert_eq!(a.kp, 128);
        for (i, v) in x.iter().enumerate() {
            let d = a.d[i / 32];
            let back = a.qs[i] as f32 * d;
            assert!((back - v).abs() <= d * 0.5 + 1e-6, "{i}: {v} vs {back}");
        }
        assert!(a.qs[100..].iter().all(|&q| q == 0));
        assert!(a.d[3] > 0.0);
    }
}
