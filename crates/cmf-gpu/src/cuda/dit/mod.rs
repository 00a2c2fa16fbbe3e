//! The Z-Image DiT resident on a CUDA device (the [`DitDevice`] contract).
//!
//! Weights: bf16 planes, dequantised on the device once at load (q8/q4/f16/f32 are uploaded in
//! their codec and expanded there); the 12 GB of bf16 planes fit the card easily. A step is a
//! few dozen GEMMs of ~4k rows: compute-bound, where bf16 tensor cores through cuBLAS run near
//! peak. The file's q8 codes are not used as GEMM operands as they are: their column field
//! (q8_2f) would have to be folded into every activation row, and the 8-bit paths below
//! requantise each plane per row from bf16 instead (one scale per output channel), which
//! costs one pass at load, and keep only the 8-bit plane (each weight resident once: 6.0 GB of
//! block planes for Z-Image-Turbo against 12.0 in bf16). Fused projections:
//! q|k|v is one `[3D, D]` plane, w1|w3 one `[2F, D]`, and every block's adaLN one
//! `[blocks·4D, A]` plane (all modulations of a step in one GEMM).
//!
//! A step (`step`): patches → x_embedder GEMM (+ bias, pad rows) → noise-refiner blocks over
//! the image rows → the resident caption rows copied in → the joint layers → LayerNorm ·
//! (1 + scale) → final Linear → the image rows back to the host. Per block: [rms·(1+s) → bf16]
//! → qkv GEMM → q/k norm + RoPE (+ f16 K/V) → flash attention per item → gather → O GEMM →
//! [sandwich norm + gate + residual + next pre-norm] → w1|w3 GEMM → SwiGLU → w2 GEMM → [same
//! fused residual]. Row layout and the map that ties rows to items: `kernels/dit.cu`.
//!
//! Files: `weights` (checks, planes, upload), `workspace` (buffers, row layout), `attention`
//! (the attention kernels and their choice), `step` (the blocks and the step), `rows` (the row
//! kernels that feed the GEMMs), `kernels` (sources and loaded functions). They share this
//! module's imports (`use super::*`).
//!
//! 8-bit GEMMs (`DitModel::precision`, see `gemm8_request`): block GEMMs
//! whose plane is 8-bit run on 8-bit operands with per-row scales, FP8 (e4m3,
//! runtime/fp8.rs) or int8 (s8 with exact s32 sums, runtime/int8.rs); the row kernels feeding
//! them (rms·(1+s), the fused residual, SwiGLU: `rows`) then write 8-bit rows and row
//! scales instead of bf16 (the int8 path's dit module is compiled for s8 rows), and so does the
//! FP8 attention (`attn_full_ws8`, where it runs: see `attn8_request`) for an FP8 O GEMM;
//! otherwise the attention's output is quantised by a pass of its own.
//! On the int8 path the O, w1|w3 and w2 GEMMs leave their exact s32 sums, which the fused
//! residual and SwiGLU scale as they read them (`GemmRows::S32`); only q|k|v, whose bf16 rows the
//! attention reads, takes int8.rs's scaling pass.

mod attention;
pub(crate) mod kernels;
pub mod rows;
mod step;
mod weights;
mod workspace;

use crate::cuda::runtime::blas::Blas;
use crate::cuda::runtime::device::{
    bytes_of, f32s_from_le_bytes, Arg, DBuf, DResult, Dev, DevError, Graph, PinnedBuf, Timer,
};
use crate::cuda::runtime::fp8::{Fp8Gemm, Fp8Out};
use crate::cuda::runtime::int8::Int8Gemm;
use crate::cuda::runtime::kernels::{
    compile_parallel, fa2_smem, Func, Job, Module, ATTENTION, ROWOPS,
};
use crate::cuda::runtime::tma;
use crate::cuda::runtime::weights::{DequantTo, DevCodec, DevWeight};
use crate::dit::{
    pad_rows, CondId, DitBlockWeights, DitGeometry, DitItemSetup, DitLinear, DitModel,
    DitPrecision, DitStepItem, Fp8Attention, RopeRows,
};
use crate::facade::backend::DitDevice;
use crate::facade::refusal::{Refusal, RefusalReason};
pub use attention::attention_for_test;
use attention::{
    attention_job, attn8_request, default_attention, k8_scale, load_attention, Attn8, Attn8Call,
    AttnCall, AttnKernel, QRows, KR_G, KR_ROWS, QKR_ROWS, W8_KEYS,
};
use cmf_format::Dtype;
use cmf_kernels::Weight;
use half::bf16;
use kernels::{ws8_smem, ws_smem, Kernels, ATTENTION_WG, WS8_SLOTS, WS_KEYS};
use rows::{self as dit_rows, GemmRows, NextNorm, NormRows, RowKernels, RowOut, MAPW, ROW_THREADS};
use std::cell::RefCell;
use std::sync::Arc;
pub use weights::TURBO_BLOCK_GEMMS;
use weights::{
    bf16_weight_bytes, block_q8_bytes, check_model, gemm8_request, Block, Gemm8, Gemm8Kind, Plane,
};
use workspace::{layout_rows, Attn8Bufs, Cond, Layout, Pass, Prepared, Seg, Work};

/// Profile categories (`CMF_DIT_PROFILE=1`): device ms spent in GEMMs, attention, row kernels.
pub const PROFILE_CATEGORIES: [&str; 3] = ["gemm", "attention", "rowops"];
const GEMM: usize = 0;
const ATTN: usize = 1;
const ROWS: usize = 2;

pub struct CudaDit {
    dev: Arc<Dev>,
    blas: Blas,
    k: Kernels,
    geo: DitGeometry,
    x_embed: (DBuf, DBuf),
    x_pad: DBuf,
    cap_norm: DBuf,
    cap_embed: (DBuf, DBuf),
    cap_pad: DBuf,
    /// Every modulated block's adaLN, stacked: `[n_mod·4D, A]` + bias.
    ada: (DBuf, DBuf),
    /// The modulated blocks' norm weights in the modulation's layout (`[blocks, 4, D]`:
    /// attention_norm1, attention_norm2, ffn_norm1, ffn_norm2): ada_finish folds them into the
    /// modulation, and the row kernels of those blocks take no norm weight of their own.
    ada_norms: DBuf,
    final_ada: (DBuf, DBuf),
    final_lin: (DBuf, DBuf),
    noise: Vec<Block>,
    ctx: Vec<Block>,
    layers: Vec<Block>,
    conds: Vec<Option<Cond>>,
    prep: Option<Prepared>,
    /// Device ms per category when profiling (each region is synchronised: slower steps).
    prof: Option<RefCell<[f64; 3]>>,
    /// The 8-bit GEMM path (see `gemm8_request`).
    gemm8: Option<Gemm8>,
    /// Bytes per value of the residual stream X (see [`residual_bf16`]).
    x_bytes: usize,
    /// Steps run eagerly, not as a graph: after a capture failed.
    no_graph: bool,
    /// The activation buffers of the last prepared run, kept by `release` and taken again by
    /// the next `prepare` of the same row count (a warm image skips ~20 allocations).
    spare_work: Option<Work>,
}

/// The residual stream X (and the refined captions) are bf16 rather than f32. diffusers' bf16
/// pipeline keeps it in bf16 as well; the row kernels still add in f32 and round once per
/// update, and the pre-norm that follows an update reads the unrounded row. Halves the bytes
/// `residual_norm` moves (BENCH.md). The kernels keep their f32 form (`X_BF16=0`).
const RESIDUAL_BF16: bool = true;

fn refuse(op: &'static str, why: impl Into<String>) -> Refusal {
    Refusal::new(op, RefusalReason::UnsupportedShape(why.into()))
}

/// The grid of bias_pad_rows: a block per row, grid-stride past 65535 rows.
fn row_grid(rows: usize) -> (u32, u32, u32) {
    (rows.clamp(1, 65535) as u32, 1, 1)
}

/// The grid of the per-column kernels over `[rows, n]` (add_bias, ada_finish): 256 columns a
/// block in x, a row in y, both grid-stride past 65535.
fn column_grid(n: usize, rows: usize) -> (u32, u32, u32) {
    (
        n.div_ceil(256).clamp(1, 65535) as u32,
        rows.clamp(1, 65535) as u32,
        1,
    )
}

impl CudaDit {
    /// Uploads `m` to `dev`, or refuses (a shape it does not take, weights that do not fit).
    pub fn load(dev: &Arc<Dev>, m: &DitModel) -> Result<CudaDit, Refusal> {
        check_model(m)?;
        let dev = dev.clone();
        // The pipeline may preload the DiT from a thread of its own.
        dev.bind_to_thread().map_err(|e| e.refusal("dit.load"))?;
        // The load's peak: every plane in bf16, then (8-bit paths) each block's planes turned
        // 8-bit in turn, its bf16 planes freed as it goes (Uploader::to_q8).
        let copies = if gemm8_request(m.precision).is_some() {
            block_q8_bytes(&m.geo)
        } else {
            0
        };
        let need = bf16_weight_bytes(m) + copies;
        let budget = (dev.free_bytes() as f64 * 0.9) as u64;
        if need > budget {
            return Err(Refusal::new(
                "dit.load",
                RefusalReason::OutOfMemory { need, budget },
            ));
        }
        Self::upload(dev, m).map_err(|e| e.refusal("dit.load"))
    }

    /// Block GEMM planes that run on 8-bit operands (0 unless FP8 or int8 was asked for and
    /// the device takes it; planes whose shape cuBLASLt's 8-bit GEMMs refuse stay bf16, see
    /// `q8_fits`).
    pub fn gemm8_planes(&self) -> usize {
        self.noise
            .iter()
            .chain(&self.ctx)
            .chain(&self.layers)
            .flat_map(|b| [&b.qkv, &b.out, &b.w13, &b.w2])
            .filter(|p| p.q8().is_some())
            .count()
    }

    /// Device bytes of the resident weights: every buffer the model holds between runs (the
    /// GEMM planes once each, in the encoding they run in; the vectors; the x_pad/cap_pad rows).
    pub fn weight_bytes(&self) -> u64 {
        let pair = |p: &(DBuf, DBuf)| p.0.len() + p.1.len();
        let block = |b: &Block| {
            [&b.qkv, &b.out, &b.w13, &b.w2]
                .iter()
                .map(|p| p.bytes())
                .sum::<usize>()
                + [&b.norm_q, &b.norm_k, &b.n1, &b.n2, &b.f1, &b.f2]
                    .iter()
                    .map(|v| v.len())
                    .sum::<usize>()
        };
        let blocks: usize = self
            .noise
            .iter()
            .chain(&self.ctx)
            .chain(&self.layers)
            .map(block)
            .sum();
        let rest = [
            &self.x_embed,
            &self.cap_embed,
            &self.ada,
            &self.final_ada,
            &self.final_lin,
        ]
        .iter()
        .map(|p| pair(p))
        .sum::<usize>()
            + self.x_pad.len()
            + self.cap_norm.len()
            + self.cap_pad.len()
            + self.ada_norms.len();
        (blocks + rest) as u64
    }

    /// Device ms per [`PROFILE_CATEGORIES`] since the last call (None unless `CMF_DIT_PROFILE=1`).
    pub fn take_profile(&self) -> Option<[f64; 3]> {
        self.prof
            .as_ref()
            .map(|p| std::mem::take(&mut *p.borrow_mut()))
    }

    fn prof_start(&self) -> DResult<Option<Timer>> {
        if self.prof.is_none() {
            return Ok(None);
        }
        let t = Timer::new()?;
        t.start(&self.dev)?;
        Ok(Some(t))
    }

    fn prof_stop(&self, t: Option<Timer>, cat: usize) -> DResult<()> {
        if let (Some(t), Some(p)) = (t, &self.prof) {
            p.borrow_mut()[cat] += t.stop_ms(&self.dev)? as f64;
        }
        Ok(())
    }

    fn launch(
        &self,
        f: &Func,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &[Arg],
    ) -> DResult<()> {
        self.dev.launch(f, grid, (block, 1, 1), smem, args)
    }

    /// y[t, 0..rows) = x[t, :] · Wᵀ for `t_n` rows of bf16 `x`.
    fn gemm(&self, w: &DBuf, rows: usize, k: usize, x: u64, y: u64, t_n: usize) -> DResult<()> {
        self.blas
            .gemm(true, w.ptr(), x, y, rows, t_n, k, rows, false)
    }

    fn add_bias(&self, y: u64, n: usize, rows: usize, bias: &DBuf) -> DResult<()> {
        self.launch(
            &self.k.add_bias,
            column_grid(n, rows),
            256,
            0,
            &[
                Arg::Ptr(y),
                Arg::I32(n as i32),
                Arg::U64(rows as u64),
                Arg::Ptr(bias.ptr()),
            ],
        )
    }
}

impl DitDevice for CudaDit {
    fn condition(&mut self, cap: &[f32], len: usize, rope: RopeRows) -> Result<CondId, Refusal> {
        let g = &self.geo;
        let half = g.head_dim() / 2;
        let lp = pad_rows(len.max(1));
        if len == 0 || cap.len() != len * g.cap_feat_dim {
            return Err(refuse(
                "dit.condition",
                format!(
                    "caption of {} floats is not [{len}, {}]",
                    cap.len(),
                    g.cap_feat_dim
                ),
            ));
        }
        if rope.cos.len() != lp * half || rope.sin.len() != lp * half {
            return Err(refuse(
                "dit.condition",
                "RoPE rows do not cover the padded caption",
            ));
        }
        self.condition_dev(cap, len, rope)
            .map_err(|e| e.refusal("dit.condition"))
    }

    fn prepare(&mut self, items: &[DitItemSetup], ni: usize) -> Result<(), Refusal> {
        let half = self.geo.head_dim() / 2;
        let np = pad_rows(ni);
        if items.is_empty() || ni == 0 {
            return Err(refuse("dit.prepare", "no items or an empty image"));
        }
        for it in items {
            let Some(Some(c)) = self.conds.get(it.cond.0) else {
                return Err(refuse("dit.prepare", "unknown caption id"));
            };
            let want = (np + c.lp) * half;
            if it.rope.cos.len() != want || it.rope.sin.len() != want {
                return Err(refuse(
                    "dit.prepare",
                    "RoPE rows do not cover [image ; caption]",
                ));
            }
        }
        let rows: usize = items
            .iter()
            .map(|it| np + self.conds[it.cond.0].as_ref().map_or(0, |c| c.lp))
            .sum();
        if rows > 65535 {
            return Err(refuse(
                "dit.prepare",
                format!("{rows} rows exceed one grid dimension"),
            ));
        }
        self.prepare_dev(items, ni)
            .map_err(|e| e.refusal("dit.prepare"))
    }

    fn step(&mut self, items: &[DitStepItem], out: &mut [f32]) -> Result<(), Refusal> {
        let Some(p) = &self.prep else {
            return Err(refuse("dit.step", "prepare was not called"));
        };
        let (ni, pd, a) = (p.ni, self.geo.patch_dim, self.geo.adaln_dim);
        if items.is_empty() || out.len() != items.len() * ni * pd {
            return Err(refuse("dit.step", "output is not [items, Ni, patch_dim]"));
        }
        let mut seen = vec![false; p.items.len()];
        for it in items {
            if it.slot >= p.items.len() || std::mem::replace(&mut seen[it.slot], true) {
                return Err(refuse("dit.step", "an item slot is unknown or repeated"));
            }
            if it.patches.len() != ni * pd || it.t_emb.len() != a {
                return Err(refuse(
                    "dit.step",
                    "patches or t-embedding of the wrong size",
                ));
            }
        }
        let mut host = Vec::new();
        self.step_dev(items, &mut host)
            .map_err(|e| e.refusal("dit.step"))?;
        out.copy_from_slice(&host);
        Ok(())
    }

    fn release(&mut self) {
        self.keep_work();
        self.conds.clear();
    }

    fn gemm8_planes(&self) -> usize {
        CudaDit::gemm8_planes(self)
    }
    fn weight_bytes(&self) -> u64 {
        CudaDit::weight_bytes(self)
    }
}

#[cfg(test)]
mod tests {
    use super::attention::tail_split_from;
    use super::weights::block_plane_shapes;
    use super::*;

    fn prepared_stub(np: usize, lps: &[usize]) -> Vec<(CondId, usize, usize)> {
        let mut ro = 0;
        lps.iter()
            .enumerate()
            .map(|(i, &lp)| {
                let r = (CondId(i), lp, ro);
                ro += np + lp;
                r
            })
            .collect()
    }

    #[test]
    fn turbo_block_gemms_are_the_planes_of_turbo_geometry() {
        let turbo = DitGeometry {
            dim: 3840,
            n_heads: 30,
            ffn: 10240,
            norm_eps: 1e-5,
            qk_eps: 1e-5,
            final_eps: 1e-6,
            patch_dim: 64,
            cap_feat_dim: 2560,
            adaln_dim: 256,
        };
        let named: Vec<_> = TURBO_BLOCK_GEMMS.iter().map(|&(_, n, k)| (n, k)).collect();
        assert_eq!(named, block_plane_shapes(&turbo));
    }

    #[test]
    fn tail_split_takes_a_last_round_at_most_half_full() {
        // 1024²: 33 query blocks × 30 heads on 132 SMs: 7 rounds and 66 tiles.
        assert_eq!(tail_split_from(990, 33, 132), 924);
        // 512²: 9 × 30 = 270: 2 rounds and 6.
        assert_eq!(tail_split_from(270, 9, 132), 264);
        // Whole rounds, a last round over half full, one key tile: nothing split.
        assert_eq!(tail_split_from(264, 9, 132), 264);
        assert_eq!(tail_split_from(200, 9, 132), 200);
        assert_eq!(tail_split_from(990, 1, 132), 990);
        // Fewer tiles than half the SMs: all split.
        assert_eq!(tail_split_from(27, 9, 132), 0);
    }

    /// The row map ties every X row to its item, joint position and RoPE row (host logic only).
    #[test]
    fn layout_of_two_items_puts_images_first_then_captions() {
        let np = 32;
        let items = prepared_stub(np, &[32, 64]);
        let lay = layout_for(np, &items, &[0, 1]);
        assert_eq!(lay.rows, 2 * np + 32 + 64);
        let jl = |v: &[Seg]| v.iter().map(|s| (s.j, s.l)).collect::<Vec<_>>();
        assert_eq!(jl(&lay.segs_main), vec![(0, 64), (64, 96)]);
        assert_eq!(jl(&lay.segs_nr), vec![(0, 32), (32, 32)]);
        // Attention writes item 1's image rows at X row 32, its caption rows at X row 96.
        assert_eq!(
            lay.segs_main[1],
            Seg {
                j: 64,
                l: 96,
                img_row0: 32,
                np: 32,
                cap_row0: 96
            }
        );
        assert_eq!(lay.cap_rows, vec![64, 96]);
        let row = |m: &[i32], r: usize| m[r * MAPW..(r + 1) * MAPW].to_vec();
        // item 1's first image row: X row 32, joint J = 64, L = 96, p = 0, rope row 64.
        assert_eq!(row(&lay.main, 32), vec![1, 64, 96, 0, 64]);
        // item 0's first caption row: X row 64, position np in its joint sequence.
        assert_eq!(row(&lay.main, 64), vec![0, 0, 64, 32, 32]);
        // item 1's last caption row.
        assert_eq!(
            row(&lay.main, 2 * np + 96 - 1),
            vec![1, 64, 96, 95, 64 + 95]
        );
        // noise-refiner map: compact joint space, RoPE rows of the image part.
        assert_eq!(row(&lay.nr, 33), vec![1, 32, 32, 1, 65]);
        // Only the negative item (CFG truncation off-steps use a subset).
        let lay = layout_for(np, &items, &[1]);
        assert_eq!(jl(&lay.segs_main), vec![(0, 96)]);
        assert_eq!(row(&lay.main, 0), vec![0, 0, 96, 0, 64]);
    }

    fn layout_for(np: usize, items: &[(CondId, usize, usize)], active: &[usize]) -> Layout {
        super::layout_rows(np, items, active)
    }
}
