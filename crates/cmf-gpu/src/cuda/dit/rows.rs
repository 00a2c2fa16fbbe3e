//! The DiT's row kernels that feed its GEMMs (kernels/dit.cu: `rms_mod`, `residual_norm`,
//! `swiglu`): their launch shapes, shared by the DiT (cuda/dit.rs) and the parity tests' hooks.
//!
//! Each writes the next GEMM's input ([`RowOut`]): bf16 rows, or, when that GEMM runs in 8 bits,
//! 8-bit rows with one f32 scale per row (kernels/e4m3.cuh: e4m3, or s8 from a module compiled
//! with `ROW8_S8=1`, the int8 path's): the activation quantisation fused
//! into the producer instead of a pass of its own over bf16 rows. One block per row:
//! [`ROW_THREADS`] or more threads looping over the row, an 8-bit row held in shared memory until
//! its amax is known; swiglu, where the width and the pointers allow, holds the row in registers
//! instead (`swiglu_r8`, `swiglu_r16`: 8 or 16 values a thread, [`RowKernels`] picks per call).

use super::kernels::DIT;
use crate::cuda::runtime::device::{bytes_of, Arg, DResult, Dev, DevError};
use crate::cuda::runtime::kernels::{Func, Module};
use half::bf16;

/// Threads of the per-row kernels (at least: see [`row_threads`]).
pub const ROW_THREADS: u32 = 256;

/// Threads per row block for a row kernel with `smem` bytes of dynamic shared memory: enough
/// that the blocks the SM's 227 KiB hold fill its 2048 threads, from [`ROW_THREADS`] up to 1024.
/// The FP8 path's swiglu stashes 40 KiB rows: 5 blocks of 256 threads (62 % of the SM's
/// threads), or 4 of 512 (all).
pub fn row_threads(smem: usize) -> u32 {
    let blocks = (227 * 1024 / smem.max(1)).max(1) as u32;
    let mut t = ROW_THREADS;
    while t < 1024 && blocks * t < 2048 {
        t *= 2;
    }
    t
}

/// Ints per row in a row map (`MAPW` in dit.cu): item, J, L, p, rope_row.
pub const MAPW: usize = 5;

/// Where a row kernel writes its `[rows, n]` output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowOut {
    /// bf16 rows.
    Bf16(u64),
    /// 8-bit rows (`n` bytes each: e4m3, or s8 where the module was compiled with `ROW8_S8=1`)
    /// and one f32 scale per row.
    Row8 { q: u64, scale: u64 },
}

impl RowOut {
    /// The kernels' trailing `out_b, out_q, out_s` arguments (out_q null: bf16).
    fn args(self) -> [Arg; 3] {
        match self {
            RowOut::Bf16(b) => [Arg::Ptr(b), Arg::Ptr(0), Arg::Ptr(0)],
            RowOut::Row8 { q, scale } => [Arg::Ptr(0), Arg::Ptr(q), Arg::Ptr(scale)],
        }
    }

    /// Where the output rows start (for 8-bit rows the bytes; the scales are a buffer of their own).
    fn ptr(self) -> u64 {
        match self {
            RowOut::Bf16(b) => b,
            RowOut::Row8 { q, .. } => q,
        }
    }

    /// Dynamic shared memory of the 8-bit stash for rows of `n` values (none for bf16).
    fn stash_bytes(self, n: usize) -> usize {
        match self {
            RowOut::Bf16(_) => 0,
            RowOut::Row8 { .. } => n * 4,
        }
    }
}

/// Where a block GEMM left the rows residual_norm or swiglu reads (kernels/dit.cu `GemmRow`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmRows {
    /// bf16 rows.
    Bf16(u64),
    /// The int8 path's s32 sums (`Int8Gemm::sums`), with one f32 scale per activation row `xs`
    /// and per weight row (output column) `ws`: the kernel applies them as it reads.
    S32 { acc: u64, xs: u64, ws: u64 },
}

impl GemmRows {
    /// The kernels' `rows, acc, xs, ws` arguments (rows null: sums).
    fn args(self) -> [Arg; 4] {
        match self {
            GemmRows::Bf16(b) => [Arg::Ptr(b), Arg::Ptr(0), Arg::Ptr(0), Arg::Ptr(0)],
            GemmRows::S32 { acc, xs, ws } => {
                [Arg::Ptr(0), Arg::Ptr(acc), Arg::Ptr(xs), Arg::Ptr(ws)]
            }
        }
    }

    /// The pointers a 16-byte access reads through (for the register form's alignment test).
    fn ptrs(self) -> [u64; 2] {
        match self {
            GemmRows::Bf16(b) => [b, 0],
            GemmRows::S32 { acc, ws, .. } => [acc, ws],
        }
    }
}

/// Lets `f` use `bytes` of dynamic shared memory where that exceeds the 48 KiB default (a
/// stash of more than 12288 values).
pub fn allow_row_smem(f: &Func, bytes: usize) -> DResult<()> {
    if bytes + f.static_smem() > 48 * 1024 {
        f.allow_smem(bytes)?;
    }
    Ok(())
}

/// The row kernels of one `dit` module (kernels/dit.cu).
pub struct RowKernels {
    rms_mod: Func,
    residual_norm: Func,
    swiglu: Func,
    /// swiglu_r8 and swiglu_r16, with their values a thread; None: the shared-memory form only.
    swiglu_regs: Option<[(usize, Func); 2]>,
}

impl RowKernels {
    pub fn load(m: &Module) -> DResult<RowKernels> {
        Self::load_as(m, true)
    }

    fn load_as(m: &Module, registers: bool) -> DResult<RowKernels> {
        Ok(RowKernels {
            rms_mod: m.func("rms_mod")?,
            residual_norm: m.func("residual_norm")?,
            swiglu: m.func("swiglu")?,
            swiglu_regs: if registers {
                Some([(8, m.func("swiglu_r8")?), (16, m.func("swiglu_r16")?)])
            } else {
                None
            },
        })
    }

    /// Lets the shared-memory kernels keep rows of width `dim` (the norms) and `ffn` (swiglu).
    pub fn allow_rows(&self, dim: usize, ffn: usize) -> DResult<()> {
        allow_row_smem(&self.residual_norm, dim * 4)?;
        allow_row_smem(&self.rms_mod, dim * 4)?;
        allow_row_smem(&self.swiglu, ffn * 4)
    }

    /// swiglu's register-resident kernel for rows of `ffn` at `ptrs`, and its threads a block:
    /// the first that takes `ffn` (a multiple of its values a thread, at most 1024 threads) with
    /// every pointer 16-byte aligned (its loads and stores are 16 bytes).
    fn swiglu_reg(&self, ffn: usize, ptrs: &[u64]) -> Option<(&Func, u32)> {
        if ptrs.iter().any(|p| p % 16 != 0) {
            return None;
        }
        self.swiglu_regs.as_ref()?.iter().find_map(|(per, f)| {
            (ffn % per == 0 && ffn / per <= 1024).then(|| (f, (ffn / per).div_ceil(32) as u32 * 32))
        })
    }
}

/// The rows a norm kernel works on: `[rows, d]` at `x` (f32, or bf16 where the module was
/// compiled with `X_BF16`: the residual stream's type, cuda/dit.rs), with a block's adaLN
/// modulation, finished (`ada_finish`: 1 + scale, tanh(gate)):
/// item 0's `[4, d]` slots at `modulation` (0: unmodulated), item i's `mod_stride` floats
/// further; `map` (`MAPW` ints per row) ties each row to its item.
#[derive(Clone, Copy)]
pub struct NormRows {
    pub x: u64,
    pub rows: usize,
    pub d: usize,
    pub eps: f32,
    pub modulation: u64,
    pub mod_stride: usize,
    pub map: u64,
}

/// The pre-norm `residual_norm` applies to the updated rows for the next GEMM: weight `w`,
/// the adaLN scale in slot `slot` of the modulation at `modulation` (0: none), written to
/// `out`.
#[derive(Clone, Copy)]
pub struct NextNorm {
    pub w: u64,
    pub modulation: u64,
    pub slot: i32,
    pub out: RowOut,
}

/// `out = rmsnorm(x) · w · (1 + scale)`, the adaLN scale from slot `slot`.
pub fn rms_mod(
    dev: &Dev,
    k: &RowKernels,
    n: &NormRows,
    w: u64,
    slot: i32,
    out: RowOut,
) -> DResult<()> {
    let [ob, oq, os] = out.args();
    dev.launch(
        &k.rms_mod,
        (n.rows as u32, 1, 1),
        (row_threads(out.stash_bytes(n.d)), 1, 1),
        out.stash_bytes(n.d) as u32,
        &[
            Arg::Ptr(n.x),
            Arg::Ptr(w),
            Arg::F32(n.eps),
            Arg::I32(n.d as i32),
            Arg::Ptr(n.modulation),
            Arg::U64(n.mod_stride as u64),
            Arg::I32(slot),
            Arg::Ptr(n.map),
            ob,
            oq,
            os,
        ],
    )
}

/// `x += tanh(gate) · rmsnorm(o) · w` (gate from slot `gate_slot`), then `next`'s pre-norm of
/// the updated rows.
pub fn residual_norm(
    dev: &Dev,
    k: &RowKernels,
    n: &NormRows,
    (o, w): (GemmRows, u64),
    gate_slot: i32,
    next: Option<NextNorm>,
) -> DResult<()> {
    let (nw, nm, ns, out) = match next {
        Some(x) => (x.w, x.modulation, x.slot, x.out),
        None => (0, 0, 0, RowOut::Bf16(0)),
    };
    let [ob, oq, os] = out.args();
    let [o_rows, o_acc, o_xs, o_ws] = o.args();
    dev.launch(
        &k.residual_norm,
        (n.rows as u32, 1, 1),
        (row_threads(n.d * 4), 1, 1),
        // The updated row; the 8-bit stash takes its place.
        (n.d * 4) as u32,
        &[
            Arg::Ptr(n.x),
            o_rows,
            o_acc,
            o_xs,
            o_ws,
            Arg::Ptr(w),
            Arg::F32(n.eps),
            Arg::I32(n.d as i32),
            Arg::Ptr(n.modulation),
            Arg::I32(gate_slot),
            Arg::Ptr(nw),
            Arg::Ptr(nm),
            Arg::I32(ns),
            Arg::U64(n.mod_stride as u64),
            Arg::Ptr(n.map),
            ob,
            oq,
            os,
        ],
    )
}

/// `out[r] = silu(gu[r, ..ffn]) · gu[r, ffn..]` for `rows` rows of `gu [rows, 2·ffn]`.
pub fn swiglu(
    dev: &Dev,
    k: &RowKernels,
    gu: GemmRows,
    rows: usize,
    ffn: usize,
    out: RowOut,
) -> DResult<()> {
    let [ob, oq, os] = out.args();
    let [gb, acc, xs, ws] = gu.args();
    let [p0, p1] = gu.ptrs();
    let (f, threads, smem) = match k.swiglu_reg(ffn, &[p0, p1, out.ptr()]) {
        Some((f, t)) => (f, t, 0),
        None => (
            &k.swiglu,
            row_threads(out.stash_bytes(ffn)),
            out.stash_bytes(ffn),
        ),
    };
    dev.launch(
        f,
        (rows as u32, 1, 1),
        (threads, 1, 1),
        smem as u32,
        &[gb, acc, xs, ws, Arg::I32(ffn as i32), ob, oq, os],
    )
}

/// Which form of swiglu its test hook runs (the register-resident one only where it applies; the
/// shared-memory one everywhere).
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowForm {
    Shared,
    Registers,
}

/// The output encoding a test hook asks the row kernels for.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowEnc {
    Bf16,
    E4m3,
    /// s8 rows (the module compiled with `ROW8_S8=1`).
    S8,
}

/// What a test hook read back: bf16 rows (as f32), or 8-bit rows (e4m3 or s8 bytes, per the
/// [`RowEnc`] asked for) and their row scales.
#[doc(hidden)]
#[derive(Debug)]
pub enum RowsBack {
    Bf16(Vec<f32>),
    Row8 { q: Vec<u8>, scale: Vec<f32> },
}

/// A GEMM output a test hook uploads for residual_norm or swiglu: bf16 rows (bits), or s32
/// sums with their activation-row and weight-row scales ([`GemmRows::S32`]).
#[doc(hidden)]
#[derive(Clone, Copy)]
pub enum GemmIn<'a> {
    Bf16(&'a [u16]),
    S32 {
        acc: &'a [i32],
        xs: &'a [f32],
        ws: &'a [f32],
    },
}

impl GemmIn<'_> {
    fn len(&self) -> usize {
        match self {
            GemmIn::Bf16(v) => v.len(),
            GemmIn::S32 { acc, .. } => acc.len(),
        }
    }
}

/// Inputs of the norm kernels' test hooks: `x [rows, d]`, modulation slots `mods [items, 4,
/// d]` as the adaLN Linear gives them (the hook finishes them as `ada_finish` does) and each
/// row's item (`mods` empty: unmodulated); `x_bf16`: the residual stream as bf16
/// (the kernels compiled with `X_BF16`; `x` is rounded to bf16 on upload).
#[doc(hidden)]
pub struct NormCase<'a> {
    pub x: &'a [f32],
    pub x_bf16: bool,
    pub d: usize,
    pub eps: f32,
    pub mods: &'a [f32],
    pub items: &'a [usize],
}

/// The device side of a test hook: the kernels, the uploaded norm case, the output buffers
/// (poisoned: an unwritten value reads back as NaN).
struct Hook<'d> {
    dev: &'d Dev,
    k: RowKernels,
    keep: Vec<crate::cuda::runtime::device::DBuf>,
}

impl<'d> Hook<'d> {
    fn new(dev: &'d Dev, x_bf16: bool, form: RowForm, enc: RowEnc) -> DResult<Hook<'d>> {
        // The row kernels do not depend on the head dim; any HD compiles them.
        let mut defs = vec![
            ("HD", "128".to_string()),
            ("X_BF16", (x_bf16 as u8).to_string()),
        ];
        if enc == RowEnc::S8 {
            defs.push(("ROW8_S8", "1".to_string()));
        }
        let m = Module::load(dev, "dit", DIT, &defs)?;
        Ok(Hook {
            dev,
            k: RowKernels::load_as(&m, form == RowForm::Registers)?,
            keep: Vec::new(),
        })
    }

    fn up<T: Copy>(&mut self, v: &[T]) -> DResult<u64> {
        let b = self.dev.upload_new(bytes_of(v))?;
        let p = b.ptr();
        self.keep.push(b);
        Ok(p)
    }

    fn gemm_rows(&mut self, g: &GemmIn) -> DResult<GemmRows> {
        Ok(match g {
            GemmIn::Bf16(v) => GemmRows::Bf16(self.up(v)?),
            GemmIn::S32 { acc, xs, ws } => GemmRows::S32 {
                acc: self.up(acc)?,
                xs: self.up(xs)?,
                ws: self.up(ws)?,
            },
        })
    }

    fn poisoned(&mut self, bytes: usize) -> DResult<u64> {
        self.up(&vec![0xffu8; bytes.max(1)])
    }

    /// Output buffers for `rows × n` values.
    fn out(&mut self, rows: usize, n: usize, enc: RowEnc) -> DResult<RowOut> {
        Ok(if enc != RowEnc::Bf16 {
            RowOut::Row8 {
                q: self.poisoned(rows * n)?,
                scale: self.poisoned(rows * 4)?,
            }
        } else {
            RowOut::Bf16(self.poisoned(rows * n * 2)?)
        })
    }

    fn back(&self, out: RowOut, rows: usize, n: usize) -> DResult<RowsBack> {
        let down = |p: u64, bytes: usize| -> DResult<Vec<u8>> {
            let mut v = vec![0u8; bytes];
            self.dev.download(&mut v, p)?;
            Ok(v)
        };
        Ok(match out {
            RowOut::Bf16(b) => RowsBack::Bf16(self.dev.download_bf16(b, rows * n)?),
            RowOut::Row8 { q, scale } => {
                let mut s = vec![0f32; rows];
                self.dev.download_f32(&mut s, scale)?;
                RowsBack::Row8 {
                    q: down(q, rows * n)?,
                    scale: s,
                }
            }
        })
    }

    fn norm_rows(&mut self, c: &NormCase) -> DResult<NormRows> {
        let rows = c.x.len() / c.d;
        if c.x.len() != rows * c.d || c.items.len() != rows {
            return Err(DevError("NormCase: x is not [items.len(), d]".into()));
        }
        let map: Vec<i32> = c
            .items
            .iter()
            .flat_map(|&i| [i as i32, 0, 0, 0, 0])
            .collect();
        let x = if c.x_bf16 {
            let b: Vec<u16> = c.x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
            self.up(&b)?
        } else {
            self.up(c.x)?
        };
        Ok(NormRows {
            x,
            rows,
            d: c.d,
            eps: c.eps,
            modulation: if c.mods.is_empty() {
                0
            } else {
                // ada_finish's: slots 0 and 2 (scales) → 1 + v, 1 and 3 (gates) → tanh v.
                let fin: Vec<f32> = c
                    .mods
                    .iter()
                    .enumerate()
                    .map(|(i, &v)| {
                        if (i / c.d) % 2 == 1 {
                            v.tanh()
                        } else {
                            1.0 + v
                        }
                    })
                    .collect();
                self.up(&fin)?
            },
            mod_stride: 4 * c.d,
            map: self.up(&map)?,
        })
    }
}

/// Test hook: `rms_mod` on `c` with norm weight `w` and the scale of slot `slot`.
#[doc(hidden)]
pub fn rms_mod_for_test(
    dev: &Dev,
    c: &NormCase,
    w: &[f32],
    slot: i32,
    enc: RowEnc,
) -> DResult<RowsBack> {
    let mut h = Hook::new(dev, c.x_bf16, RowForm::Shared, enc)?;
    let n = h.norm_rows(c)?;
    let (wp, out) = (h.up(w)?, h.out(n.rows, n.d, enc)?);
    h.k.allow_rows(n.d, 0)?;
    rms_mod(dev, &h.k, &n, wp, slot, out)?;
    h.back(out, n.rows, n.d)
}

/// Test hook: `residual_norm` on `c` with the GEMM output `o`, norm weight `w` and gate slot
/// `gate_slot`, then the pre-norm `next_w` with the scale of slot
/// `next_slot` (same modulation). Returns the updated `x` and the next GEMM's input.
#[doc(hidden)]
pub fn residual_norm_for_test(
    dev: &Dev,
    c: &NormCase,
    (o, w): (GemmIn, &[f32]),
    gate_slot: i32,
    (next_w, next_slot): (&[f32], i32),
    enc: RowEnc,
) -> DResult<(Vec<f32>, RowsBack)> {
    let mut h = Hook::new(dev, c.x_bf16, RowForm::Shared, enc)?;
    let n = h.norm_rows(c)?;
    if o.len() != c.x.len() {
        return Err(DevError(
            "residual_norm_for_test: o is not [rows, d]".into(),
        ));
    }
    let (op, wp, nwp) = (h.gemm_rows(&o)?, h.up(w)?, h.up(next_w)?);
    let out = h.out(n.rows, n.d, enc)?;
    h.k.allow_rows(n.d, 0)?;
    let next = NextNorm {
        w: nwp,
        modulation: n.modulation,
        slot: next_slot,
        out,
    };
    residual_norm(dev, &h.k, &n, (op, wp), gate_slot, Some(next))?;
    let x = if c.x_bf16 {
        dev.download_bf16(n.x, c.x.len())?
    } else {
        let mut x = vec![0f32; c.x.len()];
        dev.download_f32(&mut x, n.x)?;
        x
    };
    Ok((x, h.back(out, n.rows, n.d)?))
}

/// Test hook: `swiglu` on the GEMM output `gu [rows, 2·ffn]`.
#[doc(hidden)]
pub fn swiglu_for_test(
    dev: &Dev,
    gu: GemmIn,
    ffn: usize,
    enc: RowEnc,
    form: RowForm,
) -> DResult<RowsBack> {
    let rows = gu.len() / (2 * ffn);
    if gu.len() != rows * 2 * ffn {
        return Err(DevError("swiglu_for_test: gu is not [rows, 2·ffn]".into()));
    }
    let mut h = Hook::new(dev, false, form, enc)?;
    let (g, out) = (h.gemm_rows(&gu)?, h.out(rows, ffn, enc)?);
    h.k.allow_rows(0, ffn)?;
    swiglu(dev, &h.k, g, rows, ffn, out)?;
    h.back(out, rows, ffn)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_blocks_fill_the_sm_threads() {
        // bf16 rows (no stash) and D = 3840 f32 rows (15 blocks fit): the default.
        assert_eq!(row_threads(0), ROW_THREADS);
        assert_eq!(row_threads(3840 * 4), ROW_THREADS);
        // The FP8 swiglu's 40 KiB stash: 5 blocks fit, 512 threads fill 2048.
        assert_eq!(row_threads(10240 * 4), 512);
        // A stash only one block fits: as many threads as a block takes.
        assert_eq!(row_threads(200 * 1024), 1024);
    }
}
