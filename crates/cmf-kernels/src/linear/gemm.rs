//! Packed matmul for the SIMD paths (n ≥ 2): Y[n, rows] = X[n, cols]·Wᵀ.
//!
//! Work unit: a panel of 32 weight rows (one pool task each). The task repacks its panel once —
//! a small, cache-resident copy of 32 rows, never the whole matrix — and then runs every input
//! row against it in register tiles:
//! - f32 panel `[cols, 32]` (Wᵀ, widened to f32) + [`crate::sgemm`]: float codecs on every path,
//!   and the int8 codecs on AVX2 (no VNNI there: pmaddwd and f32 FMA do the same number of
//!   products per instruction, and f32 keeps the input exact).
//! - AVX-512 int8 panel for q8_row / q8_2f / q4_*: `[cols/4][32 rows][4 bytes]` unsigned bytes
//!   (q8: w + 128, q4: the nibble q) in the input's element order (q4: `EvenOdd`, one group per
//!   32-byte block), f32 scales `[block][32 rows]`;
//!   the input is quantized once per call ([`crate::act`]); `vpdpbusd` with the 4 input bytes
//!   broadcast (`avx512::gemm_tile`).

use crate::act::{self, Order, QAct};
use crate::codec::{Q4, Q8};
use crate::cpu::Isa;
use crate::pool::{self, SendPtr};
use crate::sgemm::sgemm;

use super::{avx512, fold_columns, FloatW, Plan as WeightPlan};

pub(crate) const PANEL: usize = 32;

/// Widened weight rows for the f32 panels.
trait RowSource: Sync {
    fn decode(&self, r: usize, out: &mut [f32]);
}

impl RowSource for FloatW<'_> {
    fn decode(&self, r: usize, out: &mut [f32]) {
        self.decode_row(r, out)
    }
}

impl RowSource for Q8<'_> {
    fn decode(&self, r: usize, out: &mut [f32]) {
        let s = self.scale(r);
        let row = self.row(r);
        match self.col {
            None => out
                .iter_mut()
                .zip(row)
                .for_each(|(o, &q)| *o = q as i8 as f32 * s),
            Some(col) => {
                for (i, (o, &q)) in out.iter_mut().zip(row).enumerate() {
                    *o = q as i8 as f32 * s * crate::codec::f16_at(col, i);
                }
            }
        }
    }
}

impl RowSource for Q4<'_> {
    fn decode(&self, r: usize, out: &mut [f32]) {
        let mut scales = vec![0f32; self.gpr];
        self.row_scales(r, &mut scales);
        for (g, s) in scales.iter().enumerate() {
            for (j, &byte) in self.nibbles(r, g).iter().enumerate() {
                out[g * 32 + 2 * j] = ((byte & 15) as f32 - 8.0) * s;
                out[g * 32 + 2 * j + 1] = ((byte >> 4) as f32 - 8.0) * s;
            }
        }
    }
}

pub(crate) fn matmul(
    isa: Isa,
    plan: &WeightPlan,
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    y: &mut [f32],
) {
    match (plan, isa) {
        (WeightPlan::Float(fw), _) => float_panels(isa, fw, rows, cols, x, n, y),
        (WeightPlan::Q8(q), Isa::Avx512) => {
            let folded = fold_columns(q, x, n, cols);
            let a = act::quantize(
                isa,
                folded.as_deref().unwrap_or(x),
                n,
                cols,
                Order::Natural,
                128.0,
            );
            int8_panels(&a, rows, n, y, |r0, pack, sc| {
                pack_q8(q, rows, r0, a.kp, pack, sc)
            })
        }
        (WeightPlan::Q4(q), Isa::Avx512) => {
            let a = act::quantize(isa, x, n, cols, Order::EvenOdd, 8.0);
            int8_panels(&a, rows, n, y, |r0, pack, sc| pack_q4(q, r0, pack, sc))
        }
        (WeightPlan::Q8(q), _) => float_panels(isa, q, rows, cols, x, n, y),
        (WeightPlan::Q4(q), _) => float_panels(isa, q, rows, cols, x, n, y),
        (WeightPlan::DecodeRows, _) => unreachable!("decode-row weights take the portable path"),
    }
}

/// f32 panels: pack Wᵀ `[cols, 32]`, then Y[:, r0..r0+32] = X·panel on the register tiles.
fn float_panels(
    isa: Isa,
    src: &impl RowSource,
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    y: &mut [f32],
) {
    let panels = rows.div_ceil(PANEL);
    let yp = SendPtr(y.as_mut_ptr());
    pool::for_each_task(panels, |p| {
        let r0 = p * PANEL;
        let nr = (rows - r0).min(PANEL);
        let mut panel = vec![0f32; cols * PANEL];
        let mut row = vec![0f32; cols];
        for j in 0..nr {
            src.decode(r0 + j, &mut row);
            for (k, v) in row.iter().enumerate() {
                panel[k * PANEL + j] = *v;
            }
        }
        if nr == PANEL {
            // SAFETY: columns r0..r0+32 of every output row belong to this task; x is n × cols.
            unsafe {
                sgemm(
                    isa,
                    n,
                    PANEL,
                    cols,
                    x.as_ptr(),
                    cols,
                    panel.as_ptr(),
                    PANEL,
                    yp.ptr().add(r0),
                    rows,
                    false,
                )
            };
        } else {
            let mut tmp = vec![0f32; n * PANEL];
            // SAFETY: tmp is n × 32.
            unsafe {
                sgemm(
                    isa,
                    n,
                    PANEL,
                    cols,
                    x.as_ptr(),
                    cols,
                    panel.as_ptr(),
                    PANEL,
                    tmp.as_mut_ptr(),
                    PANEL,
                    false,
                )
            };
            for t in 0..n {
                // SAFETY: as above, only columns r0..r0+nr.
                unsafe { yp.slice(t * rows + r0, nr) }
                    .copy_from_slice(&tmp[t * PANEL..t * PANEL + nr]);
            }
        }
    });
}

/// AVX-512 int8 panels. `pack_panel(r0, pack, scales)` fills `pack[kp/4 × 128]` and
/// `scales[nb × 32]` for rows r0..r0+32 (zero weights and scales past the last row).
fn int8_panels(
    a: &QAct,
    rows: usize,
    n: usize,
    y: &mut [f32],
    pack_panel: impl Fn(usize, &mut [u8], &mut [f32]) + Sync,
) {
    let panels = rows.div_ceil(PANEL);
    let yp = SendPtr(y.as_mut_ptr());
    pool::for_each_task(panels, |p| {
        let r0 = p * PANEL;
        let nr = (rows - r0).min(PANEL);
        let mut pack = vec![0u8; a.kp / 4 * 128];
        let mut scales = vec![0f32; a.nb * PANEL];
        pack_panel(r0, &mut pack, &mut scales);
        // SAFETY: columns r0..r0+nr of every output row belong to this task.
        unsafe { avx512::gemm_panel(&pack, &scales, a, n, yp.ptr().add(r0), rows, nr) };
    });
}

/// Stores byte `v` of row j (of the panel) at input position k (k < kp) of the packed layout.
#[inline(always)]
fn put(pack: &mut [u8], j: usize, k: usize, v: u8) {
    pack[(k / 4) * 128 + (j / 16) * 64 + (j % 16) * 4 + k % 4] = v;
}

fn pack_q8(q: &Q8, rows: usize, r0: usize, kp: usize, pack: &mut [u8], scales: &mut [f32]) {
    let nb = kp / 32;
    pack.fill(0x80); // w = 0 (+128): padding rows and columns add nothing against zero inputs
    for j in 0..PANEL.min(rows - r0) {
        let row = q.row(r0 + j);
        let at = (j / 16) * 64 + (j % 16) * 4;
        // Four bytes (one k-quad) at a time, flipped to w + 128.
        let mut quads = row.chunks_exact(4);
        for (kq, b) in (&mut quads).enumerate() {
            let v = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) ^ 0x8080_8080;
            pack[kq * 128 + at..kq * 128 + at + 4].copy_from_slice(&v.to_le_bytes());
        }
        let done = row.len() - quads.remainder().len();
        for (i, &b) in quads.remainder().iter().enumerate() {
            put(pack, j, done + i, b ^ 0x80);
        }
        let s = q.scale(r0 + j);
        for b in 0..nb {
            scales[b * PANEL + j] = s;
        }
    }
}

fn pack_q4(q: &Q4, r0: usize, pack: &mut [u8], scales: &mut [f32]) {
    // Element order: `Order::EvenOdd` (per group: 16 low nibbles, 16 high), so that each 32-byte
    // block of the panel is exactly one group with one scale.
    let mut s = vec![0f32; q.gpr];
    for j in 0..PANEL.min(q.rows - r0) {
        let r = r0 + j;
        q.row_scales(r, &mut s);
        for g in 0..q.gpr {
            scales[g * PANEL + j] = s[g];
            // Four nibble bytes = one k-quad of low nibbles and one of high nibbles.
            let at = (j / 16) * 64 + (j % 16) * 4;
            for (i, b) in q.nibbles(r, g).chunks_exact(4).enumerate() {
                let v = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                let (lo, hi) = ((g * 32) / 4 + i, (g * 32 + 16) / 4 + i);
                pack[lo * 128 + at..lo * 128 + at + 4]
                    .copy_from_slice(&(v & 0x0F0F_0F0F).to_le_bytes());
                pack[hi * 128 + at..hi * 128 + at + 4]
                    .copy_from_slice(&((v >> 4) & 0x0F0F_0F0F).to_le_bytes());
            }
        }
    }
}
