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
//! 8-bit GEMMs (`DitModel::precision`, see `gemm8_request`): block GEMMs
//! whose plane is 8-bit run on 8-bit operands with per-row scales, FP8 (e4m3,
//! cuda/fp8.rs) or int8 (s8 with exact s32 sums, cuda/int8.rs); the row kernels feeding them
//! (rms·(1+s), the fused residual, SwiGLU: cuda/dit_rows.rs) then write 8-bit rows and row
//! scales instead of bf16 (the int8 path's dit module is compiled for s8 rows), and so does the
//! FP8 attention (`attn_full_ws8`, where it runs: see `attn8_request`) for an FP8 O GEMM;
//! otherwise the attention's output is quantised by a pass of its own.
//! On the int8 path the O, w1|w3 and w2 GEMMs leave their exact s32 sums, which the fused
//! residual and SwiGLU scale as they read them (`GemmRows::S32`); only q|k|v, whose bf16 rows the
//! attention reads, takes int8.rs's scaling pass.

pub(crate) mod kernels;
pub mod rows;

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
    DitPrecision, DitStepItem, RopeRows,
};
use crate::facade::backend::DitDevice;
use crate::facade::refusal::{Refusal, RefusalReason};
use cmf_format::Dtype;
use cmf_kernels::Weight;
use half::bf16;
use kernels::{ws8_smem, ws_smem, ATTENTION_WG, DIT, WS8_SLOTS, WS_KEYS};
use rows::{self as dit_rows, GemmRows, NextNorm, NormRows, RowKernels, RowOut, MAPW, ROW_THREADS};
use std::cell::RefCell;
use std::sync::Arc;

/// Profile categories (`CMF_DIT_PROFILE=1`): device ms spent in GEMMs, attention, row kernels.
pub const PROFILE_CATEGORIES: [&str; 3] = ["gemm", "attention", "rowops"];
const GEMM: usize = 0;
const ATTN: usize = 1;
const ROWS: usize = 2;

struct Kernels {
    rows: RowKernels,
    qk_norm_rope: Func,
    /// K (and V's maxima) where the attention makes Q and reads V from the rows.
    k_norm_rope: Option<Func>,
    bias_pad: Func,
    ada_finish: Func,
    add_bias: Func,
    rms: Func,
    final_norm: Func,
    /// The attention kernel ([`default_attention`]).
    attn: AttnKernel,
    /// The FP8 attention, which replaces `attn` when loaded (see [`attn8_request`]).
    attn8: Option<Attn8>,
    dequant: Func,
    _mods: Vec<Module>,
}

impl Kernels {
    /// `row8_s8`: the row kernels write s8 GEMM rows (the int8 path) where they write 8-bit ones.
    fn load(
        dev: &Dev,
        hd: usize,
        attn8: Option<usize>,
        x_bf16: bool,
        row8_s8: bool,
    ) -> DResult<Kernels> {
        let defs = vec![
            ("HD", hd.to_string()),
            ("GQA", "1".to_string()),
            ("KV_F32", "0".to_string()),
        ];
        let mut dit_defs = defs.clone();
        dit_defs.push(("X_BF16", (x_bf16 as u8).to_string()));
        if row8_s8 {
            dit_defs.push(("ROW8_S8", "1".to_string()));
        }
        let variant = default_attention(dev, hd);
        // Every module compiles at once (a first run on a machine), then each loads.
        let arch = dev.arch();
        let attn8_job = attn8.and_then(|_| Attn8::job(dev, hd, &defs));
        let mut jobs = vec![
            Job::new("dit", DIT, &dit_defs, &arch),
            Job::new("rowops", ROWOPS, &defs, &arch),
            attention_job(dev, &variant, &defs),
        ];
        jobs.extend(attn8_job.as_ref().map(|(j, _)| j.clone()));
        compile_parallel(&jobs);
        let dit = Module::load_job(dev, &jobs[0])?;
        let rows = Module::load_job(dev, &jobs[1])?;
        let attn = load_attention(dev, hd, variant, &jobs[2])?;
        let attn8 = match (attn8, attn8_job) {
            (Some(min_keys), Some(job)) => {
                Some(Attn8::load(dev, job, min_keys, attn.split.clone())?)
            }
            _ => None,
        };
        Ok(Kernels {
            rows: RowKernels::load(&dit)?,
            qk_norm_rope: dit.func("qk_norm_rope")?,
            k_norm_rope: Some(dit.func("k_norm_rope")?),
            bias_pad: dit.func("bias_pad_rows")?,
            ada_finish: dit.func("ada_finish")?,
            add_bias: dit.func("add_bias")?,
            rms: dit.func("rms_bf16")?,
            final_norm: dit.func("final_norm_bf16")?,
            attn,
            attn8,
            dequant: rows.func("dequant_rows")?,
            _mods: vec![dit, rows],
        })
    }

    /// Lets the row kernels keep a row of the model's widths in shared memory (the updated row
    /// of `residual_norm`, the e4m3 stashes).
    fn allow_rows(&self, g: &DitGeometry) -> DResult<()> {
        self.rows.allow_rows(g.dim, g.ffn)
    }
}

/// Threads, query rows and dynamic shared memory of one attention block.
#[derive(Clone, Copy)]
struct AttnShape {
    threads: u32,
    rows: usize,
    smem: usize,
}

/// A loaded attention kernel (its module kept alive with it).
struct AttnKernel {
    f: Func,
    shape: AttnShape,
    /// K and V reach the kernel as TMA tensor maps of boxes of this many keys (attn_full_ws)
    /// rather than as pointers; such a kernel splits its last round (`split`).
    tma_keys: Option<u32>,
    split: Option<Arc<TailSplit>>,
    _m: Module,
}

/// The tail split of attn_full_ws and attn_full_ws8 (kernels/attention_wg.cu, `ws_work`): their
/// tiles (128 query rows of one head) run in rounds of one block per SM, and where a launch's last
/// round would be at most half full (1024²: 990 tiles on 132 SMs, 7 rounds and 66), its tiles
/// run as two halves of the key tiles each, the second to finish merging the first's state, so
/// the round takes about half as long. One serves
/// both kernels: their launches queue on one stream, and each leaves the counters zero.
struct TailSplit {
    /// Per split tile and half, each consumer thread's state (`WS_PART` floats).
    part: DBuf,
    /// A u32 counter per split tile (zero between launches: the second half resets it).
    pairs: DBuf,
    max_pairs: usize,
    sms: usize,
}

/// The first split tile of a launch of `tiles` tiles over `key_tiles` key tiles on `sms` SMs
/// (`tiles`: none split): the last round's, where it holds at most half as many tiles as SMs.
fn tail_split_from(tiles: usize, key_tiles: usize, sms: usize) -> usize {
    let tail = tiles % sms;
    if key_tiles >= 2 && tail > 0 && tail <= sms / 2 {
        tiles - tail
    } else {
        tiles
    }
}

/// Floats of a consumer thread's state in [`TailSplit::part`]: `WS_PART(N)` for the larger N of
/// the two kernels (attn_full_ws8's 64 accumulators and 4 ones columns).
const WS_PART_FLOATS: usize = 68 + 4;

impl TailSplit {
    fn new(dev: &Dev) -> DResult<TailSplit> {
        let sms = (dev.sm_count as usize).max(1);
        let max_pairs = sms / 2 + 1;
        Ok(TailSplit {
            part: dev.alloc(max_pairs * 2 * WS_PART_FLOATS * 256 * 4)?,
            pairs: dev.alloc_zeroed(max_pairs * 4)?,
            max_pairs,
            sms,
        })
    }

    /// The first tile that runs split: the tail split where it pays ([`tail_split_from`]), or,
    /// with `force` (the test hook's), half of the tiles, as many as the scratch holds.
    fn split_from(&self, tiles: usize, key_tiles: usize, force: bool) -> usize {
        if force && key_tiles >= 2 {
            (tiles / 2).max(tiles.saturating_sub(self.max_pairs))
        } else if !force {
            tail_split_from(tiles, key_tiles, self.sms)
        } else {
            tiles
        }
    }

    /// The kernel's trailing `split_from, part, pairs` and its 1D grid, for `tiles` work tiles
    /// of `key_tiles` key tiles each.
    fn launch_parts(&self, tiles: usize, key_tiles: usize, force: bool) -> ([Arg; 3], u32) {
        let split_from = self.split_from(tiles, key_tiles, force);
        let args = [
            Arg::I32(split_from as i32),
            Arg::Ptr(self.part.ptr()),
            Arg::Ptr(self.pairs.ptr()),
        ];
        (args, (split_from + 2 * (tiles - split_from)) as u32)
    }
}

impl AttnKernel {
    /// Whether the kernel reads Q as f16 (attn_full_ws) rather than f32.
    fn q_f16(&self) -> bool {
        self.tma_keys.is_some()
    }

    /// Whether the kernel reads V as bf16 (attn_full_ws: from the q|k|v rows where it can, see
    /// [`AttnCall::v_ld`]) rather than f16.
    fn v_bf16(&self) -> bool {
        self.tma_keys.is_some()
    }

    /// Bytes of one Q value as the kernel reads it.
    fn q_bytes(&self) -> usize {
        if self.q_f16() {
            2
        } else {
            4
        }
    }
}

/// One item's attention: q `[l, NH, HD]` f32 (f16 where [`AttnKernel::q_f16`]) and k, v
/// `[NH, l, HD]` f16 (v bf16 where [`AttnKernel::v_bf16`]) at these addresses,
/// the output as bf16 rows of `out` (`[*, NH · HD]`): row r < np → img_row0 + r, else
/// cap_row0 + r − np.
struct AttnCall {
    q: u64,
    k: u64,
    v: u64,
    /// `Some(ld)`: v is instead the item's first V value in the q|k|v GEMM's rows (bf16, `ld`
    /// values a row, the keys' rows consecutive: see [`Seg::keys_contiguous`]); attn_full_ws only.
    v_ld: Option<usize>,
    len: usize,
    n_heads: usize,
    scale: f32,
    img_row0: usize,
    np: usize,
    cap_row0: usize,
    out: u64,
    /// The test hook's: split half of the tiles whatever the round (see [`TailSplit`]).
    force_split: bool,
    /// attn_full_ws only: `q` is instead the q|k|v GEMM's rows, which the kernel normalises and
    /// rotates itself as it loads Q (qk_norm_rope then skips Q).
    q_rows: Option<QRows>,
}

/// What attn_full_ws needs to make Q from the q|k|v rows (its `WsQRows`): the rows' stride in
/// values, the q norm weight and eps, the RoPE tables and the row map (each X row's table row
/// is its map entry's last field).
#[derive(Clone, Copy)]
struct QRows {
    ld: usize,
    norm: u64,
    eps: f32,
    cos: u64,
    sin: u64,
    map: u64,
}

impl QRows {
    /// The kernels' trailing arguments (`q_ld` .. `q_rope_stride`); zeros (q_norm null) for none.
    fn args(qr: Option<QRows>) -> [Arg; 7] {
        [
            Arg::I32(qr.map_or(0, |r| r.ld as i32)),
            Arg::Ptr(qr.map_or(0, |r| r.norm)),
            Arg::F32(qr.map_or(0.0, |r| r.eps)),
            Arg::Ptr(qr.map_or(0, |r| r.cos)),
            Arg::Ptr(qr.map_or(0, |r| r.sin)),
            // The map's rope_row field: the fifth int of each MAPW-int entry.
            Arg::Ptr(qr.map_or(0, |r| r.map + 4 * 4)),
            Arg::I32(dit_rows::MAPW as i32),
        ]
    }
}

impl AttnKernel {
    fn launch(&self, dev: &Dev, c: &AttnCall) -> DResult<()> {
        const HD: u64 = 128;
        let shape = self.shape;
        let tail = [
            Arg::I32(c.len as i32),
            Arg::F32(c.scale),
            Arg::I32(c.n_heads as i32),
            Arg::I32(c.img_row0 as i32),
            Arg::I32(c.np as i32),
            Arg::I32(c.cap_row0 as i32),
            Arg::Ptr(c.out),
        ];
        let mut args = Vec::with_capacity(11);
        if let Some(keys) = self.tma_keys {
            // Boxes of 64 dims (128 bytes, the swizzle span) × one K/V tile of attn_full_ws
            // × 1 head; keys past len read as zeros.
            let (len, nh) = (c.len as u64, c.n_heads as u64);
            let map =
                |base, strides| tma::f16_3d_swizzled(base, [HD, len, nh], strides, [64, keys, 1]);
            let compact = [HD * 2, len * HD * 2];
            args.push(Arg::Bytes(map(c.k, compact)?.to_vec()));
            // V from the GEMM's rows: keys ld values apart, heads HD (the bytes are bf16; the
            // map's element type only sizes them).
            let v_strides = c.v_ld.map_or(compact, |ld| [ld as u64 * 2, HD * 2]);
            args.push(Arg::Bytes(map(c.v, v_strides)?.to_vec()));
            args.push(Arg::Ptr(c.q));
        } else {
            debug_assert!(c.q_rows.is_none(), "Q from the rows: attn_full_ws only");
            args.extend([
                Arg::Ptr(c.q),
                Arg::Ptr(c.k),
                Arg::Ptr(c.v),
                Arg::I32(c.len as i32),
            ]);
        }
        args.extend(tail);
        let (nq, nh) = (c.len.div_ceil(shape.rows), c.n_heads);
        let grid = match (&self.split, self.tma_keys) {
            (Some(sp), Some(keys)) => {
                let key_tiles = c.len.div_ceil(keys as usize);
                let (split_args, blocks) = sp.launch_parts(nq * nh, key_tiles, c.force_split);
                args.extend(split_args);
                args.extend(QRows::args(c.q_rows));
                (blocks, 1, 1)
            }
            _ => (nq as u32, nh as u32, 1),
        };
        dev.launch(
            &self.f,
            grid,
            (shape.threads, 1, 1),
            shape.smem as u32,
            &args,
        )
    }
}

/// attn_full_ws8 and its V preparation (kernels/attention_ws8.cu): both attention GEMMs in FP8,
/// K scaled per layer (qk_norm_rope writes it, [`Block::k8_scale`]), V per head from the maxima
/// qk_norm_rope folds into `Attn8Bufs::amax`.
struct Attn8 {
    prep: Func,
    attn: Func,
    smem: usize,
    /// A pass runs it only when every item has at least this many keys ([`attn8_request`]).
    min_keys: usize,
    /// Q rows to e4m3 as qk_norm_rope writes them (the test hook's).
    quant_q: Func,
    split: Arc<TailSplit>,
    _m: Module,
}

/// Rows per qk_norm_rope block (`QKR_ROWS` in dit.cu); its warps take 256 / HD heads of a row
/// each (`QKR_HPW`), 4 a block.
const QKR_ROWS: usize = 16;

/// k_norm_rope's head pairs a warp (`KR_G` in dit.cu) and rows a block (`KR_ROWS`: `KR_WARPS`
/// warps of one row).
const KR_G: usize = 5;
const KR_ROWS: usize = 8;

/// Keys per attn_full_ws8 tile (`W8_KEYS`): Vᵀ rows are padded to a multiple of it.
const W8_KEYS: usize = 128;

/// Where one item's FP8 attention operands live (f16 V, and the test hook's f16 K: the
/// [`AttnCall`]'s `v` and `k`).
struct Attn8Call {
    /// `[l, NH, 128]` e4m3 Q and `[l, NH]` f32 scales (qk_norm_rope writes them).
    q8: u64,
    qsc: u64,
    /// `[NH, l, 128]` e4m3 K (qk_norm_rope writes it; attn8_prep from the f16 K when
    /// `k_from_f16`) and its scale.
    k8: u64,
    k_scale: f32,
    k_from_f16: bool,
    /// `[NH, 128, lp]` e4m3 Vᵀ (attn8_prep writes it).
    vt8: u64,
    lp: usize,
    /// The item's `[NH]` V maxima (u32 bits).
    amax: u64,
    /// Where the output goes as e4m3 rows and per-row scales (the O GEMM's FP8 input), or
    /// `None`: bf16 rows at the [`AttnCall`]'s `out`.
    out_e4m3: Option<(u64, u64)>,
    /// V as the q|k|v GEMM wrote it: the first V value of X row 0 (bf16) and the row stride in
    /// values; the [`AttnCall`]'s rows map keys to X rows. `None`: the f16 V at its `v`.
    v_rows: Option<(u64, usize)>,
}

impl Attn8 {
    /// Loads the module [`Attn8::job`] made (with its slot count).
    /// `split`: the bf16 attention's tail-split scratch where it has one, else a new one.
    fn load(
        dev: &Dev,
        (job, slots): (Job, usize),
        min_keys: usize,
        split: Option<Arc<TailSplit>>,
    ) -> DResult<Attn8> {
        let m = Module::load_job(dev, &job)?;
        let attn = m.func("attn_full_ws8")?;
        let smem = ws8_smem(slots);
        attn.allow_smem(smem)?;
        Ok(Attn8 {
            prep: m.func("attn8_prep")?,
            attn,
            smem,
            min_keys,
            quant_q: m.func("q_rows_e4m3")?,
            split: match split {
                Some(s) => s,
                None => Arc::new(TailSplit::new(dev)?),
            },
            _m: m,
        })
    }

    /// The module of the FP8 attention and its K/V slots; None where it cannot run (not
    /// Hopper, head dim ≠ 128: the bf16 attention stays).
    fn job(dev: &Dev, hd: usize, defs: &[(&'static str, String)]) -> Option<(Job, usize)> {
        let arch = dev.arch_specific().filter(|_| hd == 128)?;
        let mut defs = defs.to_vec();
        defs.push(("WS_KEYS", WS_KEYS.to_string()));
        Some((
            Job::new("attention_wg", ATTENTION_WG, &defs, &arch),
            WS8_SLOTS,
        ))
    }

    fn launch(&self, dev: &Dev, c: &AttnCall, e: &Attn8Call) -> DResult<()> {
        const HD: u64 = 128;
        let (len, nh, lp) = (c.len as u64, c.n_heads as u64, e.lp as u64);
        dev.launch(
            &self.prep,
            ((e.lp / W8_KEYS) as u32, c.n_heads as u32, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(if e.k_from_f16 { c.k } else { 0 }),
                Arg::Ptr(if e.v_rows.is_some() { 0 } else { c.v }),
                Arg::Ptr(e.v_rows.map_or(0, |(p, _)| p)),
                Arg::U64(e.v_rows.map_or(0, |(_, ld)| ld as u64)),
                Arg::I32(c.img_row0 as i32),
                Arg::I32(c.np as i32),
                Arg::I32(c.cap_row0 as i32),
                Arg::I32(c.len as i32),
                Arg::I32(e.lp as i32),
                Arg::Ptr(e.amax),
                Arg::F32(1.0 / e.k_scale),
                Arg::Ptr(e.k8),
                Arg::Ptr(e.vt8),
            ],
        )?;
        let keys = W8_KEYS as u32;
        let tk = tma::swizzled_3d(
            tma::TmaElem::U8,
            e.k8,
            [HD, len, nh],
            [HD, len * HD],
            [128, keys, 1],
        )?;
        let tv = tma::swizzled_3d(
            tma::TmaElem::U8,
            e.vt8,
            [lp, HD, nh],
            [lp, HD * lp],
            [keys, 128, 1],
        )?;
        let (tiles, key_tiles) = (c.len.div_ceil(128) * c.n_heads, c.len.div_ceil(W8_KEYS));
        let (split_args, blocks) = self.split.launch_parts(tiles, key_tiles, c.force_split);
        let [sa, sb, sc] = split_args;
        let [qa, qb, qc, qd, qe, qf, qg] = QRows::args(c.q_rows);
        dev.launch(
            &self.attn,
            (blocks, 1, 1),
            (384, 1, 1),
            self.smem as u32,
            &[
                Arg::Bytes(tk.to_vec()),
                Arg::Bytes(tv.to_vec()),
                Arg::Ptr(e.q8),
                Arg::Ptr(e.qsc),
                Arg::I32(c.len as i32),
                Arg::F32(c.scale),
                Arg::I32(c.n_heads as i32),
                Arg::I32(c.img_row0 as i32),
                Arg::I32(c.np as i32),
                Arg::I32(c.cap_row0 as i32),
                Arg::Ptr(c.out),
                Arg::Ptr(e.amax),
                Arg::F32(e.k_scale),
                Arg::Ptr(e.out_e4m3.map_or(0, |(q, _)| q)),
                Arg::Ptr(e.out_e4m3.map_or(0, |(_, s)| s)),
                sa,
                sb,
                sc,
                // Q from the q|k|v rows (c.q is then their base), or the e4m3 q8 above.
                Arg::Ptr(if c.q_rows.is_some() { c.q } else { 0 }),
                qa,
                qb,
                qc,
                qd,
                qe,
                qf,
                qg,
            ],
        )
    }
}

/// The static e4m3 scale of a layer's K for the FP8 attention: RMSNorm makes a head's
/// Σ (k/w)² = HD (less with eps), so |k| ≤ √HD · max |norm_k| (RoPE rotates pairs and keeps the
/// bound); that bound maps to 448. Typical |k| sit a factor ~√HD lower, still e4m3 normals.
fn k8_scale(norm_k: &[f32], hd: usize) -> f32 {
    let wmax = norm_k.iter().fold(0f32, |m, w| m.max(w.abs()));
    let bound = (hd as f32).sqrt() * wmax;
    if bound > 0.0 && bound.is_finite() {
        bound / 448.0
    } else {
        1.0
    }
}

/// Whether the DiT attention may run in FP8 (attn_full_ws8), and from how many keys per item
/// on: `CMF_DIT_ATTN8=1` always (tests: the FP8 attention beside bf16 GEMMs and at short
/// lengths), `0` never; else with the FP8 GEMMs (the model's precision) from [`ATTN8_MIN_KEYS`].
/// Read when the model loads.
fn attn8_request(precision: DitPrecision) -> Option<usize> {
    match std::env::var("CMF_DIT_ATTN8").as_deref() {
        Ok("1") => Some(0),
        Ok("0") => None,
        _ => {
            let fp8 = matches!(gemm8_request(precision), Some(Gemm8Kind::Fp8 { .. }));
            (ATTN8_WITH_FP8 && fp8).then_some(ATTN8_MIN_KEYS)
        }
    }
}

/// Shorter sequences keep the bf16 attention by default. Measured on the H200 (2026-12-01):
/// at 512² (1056 keys) the FP8 attention is now faster too (fp8-fast step 15.86 → 15.58 ms; image
/// 38.3 dB from the bf16 path's, 38.5 with the bf16 attention); before its O output and K scale
/// changed it was slower there (16.1 → 16.7). Below 1024 keys it was not measured.
const ATTN8_MIN_KEYS: usize = 1024;

/// Whether `--dit-precision fp8` / `fp8-fast` include the FP8 attention by default. Measured on
/// the H200 (2026-12-01, side by side): fp8-fast 1024² step 61.1–61.4 ms with the bf16 attention,
/// 58.9 with the FP8 one; the 1024² image 37.8 dB from the bf16 path's (38.1 dB without it).
const ATTN8_WITH_FP8: bool = true;

#[derive(Clone, PartialEq, Debug)]
enum AttnVariant {
    /// attn_full_ws (attention_wg.cu): TMA loads, warp-specialised and ping-ponged; tiles of
    /// this many keys.
    WarpSpecialized(String, usize),
    /// An attention.cu entry point and its warps per block.
    MmaSync(&'static str, u32),
}

/// The kernel a test names (production runs [`default_attention`]): `ws` (Hopper, head dim
/// 128 on sm_90 only: TMA loads by a producer warpgroup, ping-ponged wgmma warpgroups, P in
/// registers, 176-key tiles) or `base` (mma.sync, 4 warps, 32-bit K loads, every device).
/// Anything else: the default. Measured on the H200 (attention of a 1024² step, 8 layers +
/// refiners): `ws` 5.0 ms against 8.3 for the earlier wgmma kernel (loads by every thread, P
/// through shared memory), which took 26.9 ms against 45.7 with `base` over 30 layers. K loads
/// through ldmatrix were slower than `base` (1024² step: 4 warps 126.3 ms, 8 warps 124.6,
/// `base` 121.8).
fn attention_variant(dev: &Dev, hd: usize, choice: &str) -> AttnVariant {
    let base = AttnVariant::MmaSync("attn_full_fa2", 4);
    let ws = dev
        .arch_specific()
        .filter(|_| hd == 128)
        .map(|a| AttnVariant::WarpSpecialized(a, WS_KEYS));
    match choice {
        "base" => base,
        _ => ws.unwrap_or(base),
    }
}

/// The DiT's attention: `ws` where it applies (Hopper, head dim 128), else `base`.
fn default_attention(dev: &Dev, hd: usize) -> AttnVariant {
    attention_variant(dev, hd, "")
}

/// The module one attention variant lives in.
fn attention_job(dev: &Dev, variant: &AttnVariant, defs: &[(&'static str, String)]) -> Job {
    match variant {
        AttnVariant::WarpSpecialized(arch, keys) => {
            let mut defs = defs.to_vec();
            defs.push(("WS_KEYS", keys.to_string()));
            Job::new("attention_wg", ATTENTION_WG, &defs, arch)
        }
        AttnVariant::MmaSync(..) => {
            // Only the non-causal variants (attention.cu's DIT_FULL), not the LLM's prefill.
            let mut defs = defs.to_vec();
            defs.push(("DIT_FULL", "1".to_string()));
            Job::new("attention", ATTENTION, &defs, &dev.arch())
        }
    }
}

/// Loads one attention variant from its module ([`attention_job`]) and allows its shared memory.
fn load_attention(dev: &Dev, hd: usize, variant: AttnVariant, job: &Job) -> DResult<AttnKernel> {
    let tma_keys = match variant {
        AttnVariant::WarpSpecialized(_, keys) => Some(keys as u32),
        _ => None,
    };
    let m = Module::load_job(dev, job)?;
    let (f, shape) = match variant {
        AttnVariant::WarpSpecialized(_, keys) => {
            let shape = AttnShape {
                threads: 384,
                rows: 128,
                smem: ws_smem(keys),
            };
            (m.func("attn_full_ws")?, shape)
        }
        AttnVariant::MmaSync(entry, warps) => {
            let shape = AttnShape {
                threads: 32 * warps,
                rows: 16 * warps as usize,
                smem: fa2_smem(hd),
            };
            (m.func(entry)?, shape)
        }
    };
    f.allow_smem(shape.smem)?;
    let split = match tma_keys {
        Some(_) => Some(Arc::new(TailSplit::new(dev)?)),
        None => None,
    };
    Ok(AttnKernel {
        f,
        shape,
        tma_keys,
        split,
        _m: m,
    })
}

/// Test hook: the DiT attention kernel `variant` (a name
/// [`attention_variant`], or `ws8`: attn_full_ws8 with K scaled by its maximum over all heads and
/// V by its per-head maxima; `ws8q`: the same writing e4m3 rows, read back with their scales;
/// `+split` after `ws`, `ws8` or `ws8q`: half of the tiles split, see [`TailSplit`])
/// on one item of
/// `t` rows, `nh` heads of 128: q `[t, nh, 128]` f32, k and v `[nh, t, 128]` (rounded to f16
/// here, as the DiT stores them; v to bf16 for attn_full_ws, which reads the GEMM's bf16 V).
/// Returns the output `[t, nh · 128]`, read back from bf16.
#[doc(hidden)]
pub fn attention_for_test(
    dev: &Dev,
    variant: &str,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    t: usize,
    nh: usize,
) -> DResult<Vec<f32>> {
    const HD: usize = 128;
    let (variant, force_split) = match variant.strip_suffix("+split") {
        Some(v) => (v, true),
        None => (variant, false),
    };
    let n = t * nh * HD;
    if q.len() != n || k.len() != n || v.len() != n {
        return Err(DevError(format!(
            "attention_for_test: q/k/v must hold {n} values"
        )));
    }
    let defs = vec![
        ("HD", HD.to_string()),
        ("GQA", "1".to_string()),
        ("KV_F32", "0".to_string()),
    ];
    let f16s = |x: &[f32]| -> Vec<u16> {
        x.iter()
            .map(|&a| half::f16::from_f32(a).to_bits())
            .collect()
    };
    let bf16s = |x: &[f32]| -> Vec<u16> {
        x.iter()
            .map(|&a| half::bf16::from_f32(a).to_bits())
            .collect()
    };
    let kernel = match variant {
        "ws8" | "ws8q" => None,
        _ => {
            let v = attention_variant(dev, HD, variant);
            let job = attention_job(dev, &v, &defs);
            Some(load_attention(dev, HD, v, &job)?)
        }
    };
    let dq = dev.upload_new(bytes_of(q))?;
    let dk = dev.upload_new(bytes_of(&f16s(k)))?;
    let v_bf16 = kernel.as_ref().is_some_and(|k| k.v_bf16());
    let dv = dev.upload_new(bytes_of(&if v_bf16 { bf16s(v) } else { f16s(v) }))?;
    let out = dev.alloc(n * 2)?;
    // Poison: a row the kernel leaves unwritten reads back as NaN.
    dev.upload(out.ptr(), bytes_of(&vec![0x7fc0u16; n]))?;
    let call = AttnCall {
        q: dq.ptr(),
        k: dk.ptr(),
        v: dv.ptr(),
        v_ld: None,
        len: t,
        n_heads: nh,
        scale: 1.0 / (HD as f32).sqrt(),
        img_row0: 0,
        np: t,
        cap_row0: 0,
        out: out.ptr(),
        force_split,
        q_rows: None,
    };
    if variant == "ws8" || variant == "ws8q" {
        let job = Attn8::job(dev, HD, &defs)
            .ok_or_else(|| DevError("ws8: needs sm_90a and head dim 128".into()))?;
        let a8 = Attn8::load(dev, job, 0, None)?;
        let abs_max = |x: &[f32]| {
            x.iter()
                .map(|&a| half::f16::from_f32(a).to_f32().abs())
                .fold(0f32, f32::max)
        };
        // The per-head V maxima qk_norm_rope would fold in, of the f16 values.
        let amax: Vec<u32> = v.chunks(t * HD).map(|h| abs_max(h).to_bits()).collect();
        let k_max = abs_max(k);
        let lp = t.next_multiple_of(W8_KEYS);
        let amax_d = dev.upload_new(bytes_of(&amax))?;
        let (q8, qsc) = (dev.alloc(n)?, dev.alloc(t * nh * 4)?);
        dev.launch(
            &a8.quant_q,
            ((t * nh).div_ceil(4) as u32, 1, 1),
            (128, 1, 1),
            0,
            &[
                Arg::Ptr(dq.ptr()),
                Arg::I32((t * nh) as i32),
                Arg::Ptr(q8.ptr()),
                Arg::Ptr(qsc.ptr()),
            ],
        )?;
        let k8 = dev.alloc(n)?;
        let vt8 = dev.alloc(nh * HD * lp)?;
        let (oq, os) = (dev.alloc(n)?, dev.alloc(t * 4)?);
        let e = Attn8Call {
            q8: q8.ptr(),
            qsc: qsc.ptr(),
            k8: k8.ptr(),
            k_scale: if k_max > 0.0 { k_max / 448.0 } else { 1.0 },
            k_from_f16: true,
            vt8: vt8.ptr(),
            lp,
            amax: amax_d.ptr(),
            out_e4m3: (variant == "ws8q").then(|| (oq.ptr(), os.ptr())),
            v_rows: None,
        };
        a8.launch(dev, &call, &e)?;
        if e.out_e4m3.is_some() {
            let (mut bytes, mut scales) = (vec![0u8; n], vec![0f32; t]);
            dev.download(&mut bytes, oq.ptr())?;
            dev.download_f32(&mut scales, os.ptr())?;
            let row = nh * HD;
            return Ok(bytes
                .iter()
                .enumerate()
                .map(|(i, &b)| crate::cuda::runtime::fp8::e4m3_to_f32(b) * scales[i / row])
                .collect());
        }
    } else if let Some(kernel) = kernel {
        // Q as the kernel reads it: f16 for attn_full_ws (qk_norm_rope writes it so), else f32.
        let q16 = if kernel.q_f16() {
            Some(dev.upload_new(bytes_of(&f16s(q)))?)
        } else {
            None
        };
        let q = q16.as_ref().map_or(call.q, |b| b.ptr());
        kernel.launch(dev, &AttnCall { q, ..call })?;
    }
    dev.download_bf16(out.ptr(), n)
}

/// One block's GEMM planes and norm weights (f32).
struct Block {
    qkv: Plane,
    out: Plane,
    w13: Plane,
    w2: Plane,
    norm_q: DBuf,
    norm_k: DBuf,
    /// The e4m3 scale of K in the FP8 attention ([`k8_scale`]).
    k8_scale: f32,
    n1: DBuf,
    n2: DBuf,
    f1: DBuf,
    f2: DBuf,
}

/// A block GEMM's weight plane `[n, k]`, resident once: bf16, or 8-bit (the encoding of the
/// model's [`Gemm8`]) when an 8-bit path is on (`gemm8_request`) and cuBLASLt can run this
/// shape on 8-bit operands ([`q8_fits`]). The 8-bit plane is made on the device from the bf16
/// one, which is freed then: nothing reads it afterwards (a failed 8-bit GEMM refuses the step,
/// and the CPU runs it from the host's weights). The GEMM runs in 8 bits exactly on `Q8`.
enum Plane {
    Bf16(DBuf),
    Q8(Plane8),
}

impl Plane {
    fn q8(&self) -> Option<&Plane8> {
        match self {
            Plane::Q8(p) => Some(p),
            Plane::Bf16(_) => None,
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Plane::Bf16(w) => w.len(),
            Plane::Q8(p) => p.q.len() + p.s.len(),
        }
    }
}

/// Whether cuBLASLt's 8-bit GEMMs take an `[n, k]` plane: its FP8 and IMMA kernels want every
/// operand and leading dimension 16-byte aligned (an 8-bit row of k values is k bytes) and find
/// no FP8 algorithm for dimensions that are not multiples of 16 (PyTorch's `_scaled_mm` checks
/// the same). The activation row count m is a multiple of 32 here (`pad_rows`).
fn q8_fits(n: usize, k: usize) -> bool {
    n % 16 == 0 && k % 16 == 0
}

/// A block's four GEMM planes as `[n, k]`: q|k|v, O, w1|w3, w2.
fn block_plane_shapes(g: &DitGeometry) -> [(usize, usize); 4] {
    let (d, f) = (g.dim, g.ffn);
    [(3 * d, d), (d, d), (2 * f, d), (d, f)]
}

/// Z-Image-Turbo's block GEMMs (D = 3840, F = 10240) as (name, n, k), in
/// [`block_plane_shapes`]' order: the shapes the GEMM tools (`cmf-gemm-tune`, `cmf-fp8-probe`)
/// time.
pub const TURBO_BLOCK_GEMMS: [(&str, usize, usize); 4] = [
    ("q|k|v", 11520, 3840),
    ("O", 3840, 3840),
    ("w1|w3", 20480, 3840),
    ("w2", 3840, 10240),
];

/// A weight plane as 8-bit rows with one f32 scale per row ([`Gemm8::quantize`]).
struct Plane8 {
    q: DBuf,
    s: DBuf,
}

impl Plane8 {
    fn of(dev: &Dev, g: &Gemm8, plane: &DBuf, rows: usize, cols: usize) -> DResult<Plane8> {
        let p = Plane8 {
            q: dev.alloc(rows * cols)?,
            s: dev.alloc(rows * 4)?,
        };
        g.quantize(plane.ptr(), rows, cols, cols, p.q.ptr(), p.s.ptr())?;
        Ok(p)
    }
}

/// A refined caption: `[lp, D]` rows of the residual stream's type.
struct Cond {
    rows: DBuf,
    lp: usize,
}

/// Activation buffers for up to `rows` rows.
struct Work {
    rows: usize,
    /// The O and w2 GEMMs' output, bf16 `[rows, d]` (read by `residual_norm`).
    o: DBuf,
    hb: DBuf,
    qkv: DBuf,
    /// Q for the attention; before the blocks, the embedding GEMMs' f32 output `[rows, d]`.
    q: DBuf,
    kc: DBuf,
    vc: DBuf,
    g: DBuf,
    /// 8-bit path: the 8-bit activation rows (up to max(D, F) wide) and their scales.
    xq: Option<(DBuf, DBuf)>,
    /// int8 path: the s32 sums of the widest block GEMM (`[rows, max(3D, 2F)]`).
    acc: Option<DBuf>,
    /// FP8 attention: its operands.
    attn8: Option<Attn8Bufs>,
}

/// The FP8 attention's operands for up to `rows` rows in at most [`Attn8Bufs::SEGS`] items.
struct Attn8Bufs {
    /// e4m3 Q rows `[rows, NH, 128]` and their f32 scales `[rows, NH]`.
    q8: DBuf,
    qsc: DBuf,
    /// e4m3 K, laid out as the f16 `kc`.
    k8: DBuf,
    /// e4m3 Vᵀ, item after item, each `[NH, 128, lp]` (lp: its length rounded up to 128).
    vt8: DBuf,
    /// u32 `[SEGS, NH]`: per item the V maxima of each head.
    amax: DBuf,
}

impl Attn8Bufs {
    const SEGS: usize = 8;
}

impl Work {
    /// The 8-bit input rows and scales of the GEMM on `w` when it runs in 8 bits.
    fn q8_input(&self, w: &Plane) -> Option<(u64, u64)> {
        match (w.q8(), &self.xq) {
            (Some(_), Some((q, s))) => Some((q.ptr(), s.ptr())),
            _ => None,
        }
    }

    /// Where a row kernel writes the input of the GEMM on `w`: 8-bit rows when that GEMM runs
    /// in 8 bits, else bf16 rows in `hb`.
    fn gemm_input(&self, w: &Plane) -> RowOut {
        match self.q8_input(w) {
            Some((q, scale)) => RowOut::Row8 { q, scale },
            None => RowOut::Bf16(self.hb.ptr()),
        }
    }
}

/// A pass of blocks over `rows` rows of `x`.
struct Pass<'p> {
    x: u64,
    rows: usize,
    map: u64,
    cos: u64,
    sin: u64,
    /// Every item's attention sequence.
    segs: &'p [Seg],
}

/// One item's attention sequence: joint rows `j .. j + l`; its first `np` rows are X rows
/// `img_row0 ..`, the rest X rows `cap_row0 ..`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Seg {
    j: usize,
    l: usize,
    img_row0: usize,
    np: usize,
    cap_row0: usize,
}

impl Seg {
    /// Whether the item's keys are consecutive X rows (its caption right after its image, or
    /// no caption keys): true at batch 1, where attn_full_ws reads V from the GEMM's rows.
    fn keys_contiguous(&self) -> bool {
        self.l == self.np || self.cap_row0 == self.img_row0 + self.np
    }
}

/// What `prepare` set up.
struct Prepared {
    ni: usize,
    np: usize,
    /// Per item: caption, its padded length, its first row in the RoPE tables.
    items: Vec<(CondId, usize, usize)>,
    cos: DBuf,
    sin: DBuf,
    x: DBuf,
    work: Work,
    map_main: DBuf,
    map_nr: DBuf,
    patches: DBuf,
    temb: DBuf,
    temb_silu: DBuf,
    modv: DBuf,
    fscale: DBuf,
    out: DBuf,
    /// Where the step's output is read back to (pinned; `None`: pinned memory was refused, the
    /// readback goes to pageable memory).
    out_host: Option<PinnedBuf>,
    /// The active slots the maps were last built for (the last step's).
    maps_for: Vec<usize>,
    /// The step graph and the active slots it was captured for.
    graph: Option<(Vec<usize>, Graph)>,
}

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

/// The block GEMMs' 8-bit operand encodings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Gemm8Kind {
    /// e4m3 (FP8 tensor cores), with fast accumulation or not.
    Fp8 { fast: bool },
    /// s8 with exact s32 sums (int8 tensor cores).
    Int8,
}

/// Whether the blocks' q|k|v, O, w1|w3 and w2 GEMMs run on 8-bit operands with per-row scales
/// on weights and activations (cuBLASLt), each whose shape cuBLASLt takes ([`q8_fits`]; the
/// others stay bf16), and in which encoding: the model's [`DitPrecision`].
fn gemm8_request(precision: DitPrecision) -> Option<Gemm8Kind> {
    match precision {
        DitPrecision::Bf16 => None,
        DitPrecision::Fp8 => Some(Gemm8Kind::Fp8 { fast: false }),
        DitPrecision::Fp8Fast => Some(Gemm8Kind::Fp8 { fast: true }),
        DitPrecision::Int8 => Some(Gemm8Kind::Int8),
    }
}

/// The block GEMMs' 8-bit path, loaded.
enum Gemm8 {
    /// e4m3 operands, with fast accumulation or not.
    Fp8(Fp8Gemm, bool),
    /// s8 operands.
    Int8(Int8Gemm),
}

impl Gemm8 {
    fn new(dev: &Arc<Dev>, kind: Gemm8Kind) -> DResult<Gemm8> {
        Ok(match kind {
            Gemm8Kind::Fp8 { fast } => Gemm8::Fp8(Fp8Gemm::new(dev)?, fast),
            Gemm8Kind::Int8 => Gemm8::Int8(Int8Gemm::new(dev)?),
        })
    }

    /// `rows` bf16 rows of `cols` values (row stride `ld`) at `x` to 8-bit rows at `q` and
    /// their scales at `s`.
    fn quantize(&self, x: u64, rows: usize, cols: usize, ld: usize, q: u64, s: u64) -> DResult<()> {
        match self {
            Gemm8::Fp8(g, _) => g.quantize(x, rows, cols, ld, q, s),
            Gemm8::Int8(g) => g.quantize(x, rows, cols, ld, q, s),
        }
    }
}

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

/// Checks the geometry and every weight before anything is uploaded.
fn check_model(m: &DitModel) -> Result<(), Refusal> {
    let g = &m.geo;
    let op = "dit.load";
    if g.n_heads == 0 || g.dim % g.n_heads != 0 {
        return Err(refuse(op, "n_heads must divide dim"));
    }
    let hd = g.head_dim();
    if hd > 128 || hd % 16 != 0 || !hd.is_power_of_two() {
        return Err(refuse(
            op,
            format!("head dim {hd}: the device kernels need a power of two from 16 to 128"),
        ));
    }
    if g.dim % 8 != 0 {
        return Err(refuse(op, "dim must be a multiple of 8"));
    }
    let mut all: Vec<(String, &Weight)> = vec![
        ("x_embedder".into(), &m.x_embedder.w),
        ("cap_embedder".into(), &m.cap_embedder.w),
        ("final_ada".into(), &m.final_ada.w),
        ("final_linear".into(), &m.final_linear.w),
    ];
    for (part, blocks) in [
        ("noise_refiner", &m.noise_refiner),
        ("context_refiner", &m.context_refiner),
        ("layers", &m.layers),
    ] {
        for (i, b) in blocks.iter().enumerate() {
            let p = format!("{part}.{i}");
            for (n, w) in [
                ("to_q", &b.to_q),
                ("to_k", &b.to_k),
                ("to_v", &b.to_v),
                ("to_out", &b.to_out),
                ("w1", &b.w1),
                ("w2", &b.w2),
                ("w3", &b.w3),
            ] {
                all.push((format!("{p}.{n}"), w));
            }
            if let Some(a) = &b.ada {
                all.push((format!("{p}.adaLN"), &a.w));
            }
            if (b.ada.is_some()) != (part != "context_refiner") {
                return Err(refuse(
                    op,
                    format!("{p}: adaLN presence does not match the part"),
                ));
            }
        }
    }
    // Any column count: matrices whose columns the device dequantiser cannot take (not a
    // multiple of 32, e.g. the tiny fixture's FFN of 341) are expanded to bf16 on the host.
    for (name, w) in all {
        DevCodec::of(w.dtype).map_err(|r| Refusal::new(op, r))?;
        if w.rows == 0 || w.cols == 0 {
            return Err(refuse(op, format!("{name}: empty matrix")));
        }
    }
    let (d, f) = (g.dim, g.ffn);
    for b in m
        .noise_refiner
        .iter()
        .chain(&m.context_refiner)
        .chain(&m.layers)
    {
        let shapes_ok = [&b.to_q, &b.to_k, &b.to_v, &b.to_out]
            .iter()
            .all(|w| (w.rows, w.cols) == (d, d))
            && (b.w1.rows, b.w1.cols) == (f, d)
            && (b.w3.rows, b.w3.cols) == (f, d)
            && (b.w2.rows, b.w2.cols) == (d, f);
        if !shapes_ok {
            return Err(refuse(
                op,
                "a block's matrix shapes do not match the geometry",
            ));
        }
    }
    Ok(())
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

    fn upload(dev: Arc<Dev>, m: &DitModel) -> DResult<CudaDit> {
        let x_bf16 = RESIDUAL_BF16;
        let gemm8 = gemm8_request(m.precision).and_then(|kind| match Gemm8::new(&dev, kind) {
            Ok(g) => Some(g),
            Err(e) => {
                crate::facade::log::debug(&format!(
                    "dit: {kind:?} GEMMs unavailable, bf16 instead: {}",
                    e.0
                ));
                None
            }
        });
        let row8_s8 = matches!(gemm8, Some(Gemm8::Int8(_)));
        let hd = m.geo.head_dim();
        let k = Kernels::load(&dev, hd, attn8_request(m.precision), x_bf16, row8_s8)?;
        k.allow_rows(&m.geo)?;
        let blas = Blas::new(&dev)?;
        let up = Uploader {
            dev: &dev,
            dequant: &k.dequant,
            shapes: block_plane_shapes(&m.geo),
        };
        // Blocks upload on several threads (Dev::each_parallel) in bf16; where the 8-bit path
        // is on, this thread then turns their planes 8-bit on the device (Gemm8's cuBLASLt
        // state is not Sync), freeing each bf16 plane as it goes.
        let blocks = |bs: &[DitBlockWeights]| -> DResult<Vec<Block>> {
            let mut blocks = dev.each_parallel(bs, Dev::LOADER_THREADS, |b| up.block(b))?;
            if let Some(g) = &gemm8 {
                for b in &mut blocks {
                    up.to_q8(g, b)?;
                }
            }
            Ok(blocks)
        };
        let ada_ws: Vec<&DitLinear> = m
            .noise_refiner
            .iter()
            .chain(&m.layers)
            .map(|b| b.ada.as_ref().expect("checked"))
            .collect();
        let ada_bias: Vec<f32> = ada_ws
            .iter()
            .flat_map(|l| match l.b {
                Some(b) => b.to_vec(),
                None => vec![0.0; l.w.rows],
            })
            .collect();
        let ada_plane = up.plane(&ada_ws.iter().map(|l| &l.w).collect::<Vec<_>>())?;
        let ada_norms: Vec<f32> = m
            .noise_refiner
            .iter()
            .chain(&m.layers)
            .flat_map(|b| {
                [
                    b.attention_norm1,
                    b.attention_norm2,
                    b.ffn_norm1,
                    b.ffn_norm2,
                ]
                .into_iter()
                .flatten()
                .copied()
            })
            .collect();
        let dit = CudaDit {
            x_embed: up.linear(&m.x_embedder)?,
            x_pad: up.vec(m.x_pad_token)?,
            cap_norm: up.vec(m.cap_norm)?,
            cap_embed: up.linear(&m.cap_embedder)?,
            cap_pad: up.vec(m.cap_pad_token)?,
            ada: (ada_plane, up.vec(&ada_bias)?),
            ada_norms: up.vec(&ada_norms)?,
            final_ada: up.linear(&m.final_ada)?,
            final_lin: up.linear(&m.final_linear)?,
            noise: blocks(&m.noise_refiner)?,
            ctx: blocks(&m.context_refiner)?,
            layers: blocks(&m.layers)?,
            geo: m.geo.clone(),
            conds: Vec::new(),
            prep: None,
            prof: (std::env::var("CMF_DIT_PROFILE").as_deref() == Ok("1"))
                .then(|| RefCell::new([0.0; 3])),
            gemm8,
            x_bytes: if x_bf16 { 2 } else { 4 },
            no_graph: false,
            spare_work: None,
            blas,
            k,
            dev: dev.clone(),
        };
        dev.sync()?;
        Ok(dit)
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

    /// Drops the prepared run, keeping its activation buffers for the next (`spare_work`).
    fn keep_work(&mut self) {
        if let Some(p) = self.prep.take() {
            self.spare_work = Some(p.work);
        }
    }

    fn new_work(&self, rows: usize) -> DResult<Work> {
        let g = &self.geo;
        let (d, f) = (g.dim, g.ffn);
        let hb_w = d.max(f).max(g.cap_feat_dim).max(g.patch_dim);
        Ok(Work {
            rows,
            o: self.dev.alloc(rows * d * 2)?,
            hb: self.dev.alloc(rows * hb_w * 2)?,
            qkv: self.dev.alloc(rows * 3 * d * 2)?,
            q: self.dev.alloc(rows * d * 4)?,
            kc: self.dev.alloc(rows * d * 2)?,
            vc: self.dev.alloc(rows * d * 2)?,
            g: self.dev.alloc(rows * 2 * f * 2)?,
            xq: match self.gemm8_planes() {
                0 => None,
                _ => Some((self.dev.alloc(rows * d.max(f))?, self.dev.alloc(rows * 4)?)),
            },
            acc: match (&self.gemm8, self.gemm8_planes()) {
                (Some(Gemm8::Int8(_)), 1..) => Some(self.dev.alloc(rows * (3 * d).max(2 * f) * 4)?),
                _ => None,
            },
            attn8: match self.k.attn8 {
                Some(_) => Some(Attn8Bufs {
                    q8: self.dev.alloc(rows * d)?,
                    qsc: self.dev.alloc(rows * g.n_heads * 4)?,
                    k8: self.dev.alloc(rows * d)?,
                    vt8: self.dev.alloc((rows + Attn8Bufs::SEGS * W8_KEYS) * d)?,
                    amax: self.dev.alloc_zeroed(Attn8Bufs::SEGS * g.n_heads * 4)?,
                }),
                None => None,
            },
        })
    }

    /// `a[r, 0..k) · Wᵀ` for block plane `w` (`n × k`) and the activation rows `a` where
    /// [`Work::gemm_input`] put them: in 8 bits where the plane is 8-bit,
    /// else bf16 from `hb`. Returns where the rows are: bf16 rows `[r, n]` at `out`, or, on the
    /// int8 path where `sums` allows (a consumer that reads them: swiglu, residual_norm), the
    /// s32 sums in `work.acc` with their scales.
    fn block_gemm(
        &self,
        work: &Work,
        w: &Plane,
        (n, k): (usize, usize),
        r: usize,
        out: u64,
        sums: bool,
    ) -> DResult<GemmRows> {
        if let (Some((xq, xs)), Plane::Q8(p)) = (work.q8_input(w), w) {
            let g8 = self
                .gemm8
                .as_ref()
                .expect("8-bit planes exist only with Gemm8");
            match g8 {
                Gemm8::Fp8(g, fast) => {
                    let to = Fp8Out::Bf16(out);
                    g.gemm(p.q.ptr(), p.s.ptr(), xq, xs, to, (n, r, k), n, *fast)?;
                }
                Gemm8::Int8(g) => {
                    let acc = work.acc.as_ref().expect("int8 work has its sums").ptr();
                    g.sums(p.q.ptr(), xq, acc, (n, r, k))?;
                    if sums {
                        let ws = p.s.ptr();
                        return Ok(GemmRows::S32 { acc, xs, ws });
                    }
                    g.scale(acc, (n, r), xs, p.s.ptr(), out, n)?;
                }
            }
        } else {
            let Plane::Bf16(w) = w else {
                return Err(DevError(
                    "an 8-bit plane without 8-bit activation buffers".into(),
                ));
            };
            self.blas
                .gemm_bf16_out(w.ptr(), work.hb.ptr(), out, n, r, k, n)?;
        }
        Ok(GemmRows::Bf16(out))
    }

    /// q/k RMSNorm + RoPE of block `b`'s q|k|v rows: K (to f16, or e4m3 for the FP8 attention,
    /// whose V maxima `a8` also gets), Q where the attention does not make it from the rows
    /// (`q_rows` None), V's copy where `v_copy`. k_norm_rope where only K and the maxima are
    /// needed, else qk_norm_rope over every unit (q, k, v heads) that needs work.
    fn norm_rope(
        &self,
        b: &Block,
        w: &Work,
        p: &Pass,
        a8: Option<&Attn8Bufs>,
        v_copy: bool,
        q_rows: Option<QRows>,
    ) -> DResult<()> {
        let g = &self.geo;
        let (nh, hd, r) = (g.n_heads, g.head_dim(), p.rows);
        let (amax, q8, qsc, k8) = match a8 {
            Some(a8) => {
                if p.segs.len() > Attn8Bufs::SEGS {
                    return Err(DevError(format!(
                        "FP8 attention: {} items in one pass, at most {}",
                        p.segs.len(),
                        Attn8Bufs::SEGS
                    )));
                }
                self.dev.memset0(a8.amax.ptr(), p.segs.len() * nh * 4)?;
                (a8.amax.ptr(), a8.q8.ptr(), a8.qsc.ptr(), a8.k8.ptr())
            }
            None => (0, 0, 0, 0),
        };
        match (&self.k.k_norm_rope, q_rows.is_some() && !v_copy) {
            (Some(f), true) => {
                let kchunks = nh.div_ceil(256 / hd).div_ceil(KR_G);
                let chunks = kchunks * if a8.is_some() { 2 } else { 1 };
                self.launch(
                    f,
                    (chunks as u32, r.div_ceil(KR_ROWS) as u32, 1),
                    32 * KR_ROWS as u32,
                    0,
                    &[
                        Arg::Ptr(w.qkv.ptr()),
                        Arg::Ptr(b.norm_k.ptr()),
                        Arg::F32(g.qk_eps),
                        Arg::Ptr(p.cos),
                        Arg::Ptr(p.sin),
                        Arg::Ptr(p.map),
                        Arg::I32(nh as i32),
                        Arg::I32(r as i32),
                        Arg::I32(kchunks as i32),
                        Arg::Ptr(w.kc.ptr()),
                        Arg::Ptr(k8),
                        Arg::F32(1.0 / b.k8_scale),
                        Arg::Ptr(amax),
                    ],
                )?;
            }
            _ => {
                let units = if v_copy || a8.is_some() {
                    3 * nh
                } else {
                    2 * nh
                } - if q_rows.is_some() { nh } else { 0 };
                self.launch(
                    &self.k.qk_norm_rope,
                    (
                        units.div_ceil(256 / hd).div_ceil(4) as u32,
                        r.div_ceil(QKR_ROWS) as u32,
                        1,
                    ),
                    128,
                    0,
                    &[
                        Arg::Ptr(w.qkv.ptr()),
                        Arg::Ptr(b.norm_q.ptr()),
                        Arg::Ptr(b.norm_k.ptr()),
                        Arg::F32(g.qk_eps),
                        Arg::Ptr(p.cos),
                        Arg::Ptr(p.sin),
                        Arg::Ptr(p.map),
                        Arg::I32(nh as i32),
                        Arg::I32(r as i32),
                        Arg::Ptr(w.q.ptr()),
                        Arg::Ptr(w.kc.ptr()),
                        Arg::Ptr(if v_copy { w.vc.ptr() } else { 0 }),
                        Arg::Ptr(amax),
                        Arg::Ptr(q8),
                        Arg::Ptr(qsc),
                        Arg::Ptr(k8),
                        Arg::F32(1.0 / b.k8_scale),
                        Arg::I32(self.k.attn.q_f16() as i32),
                        Arg::I32(self.k.attn.v_bf16() as i32),
                        Arg::I32(q_rows.is_some() as i32),
                    ],
                )?;
            }
        }
        Ok(())
    }

    /// Runs `blocks` over a pass; `mods[i]` is block i's modulation slice (0: unmodulated).
    fn run_blocks(
        &self,
        blocks: &[Block],
        mods: &[u64],
        mod_stride: usize,
        p: &Pass,
        w: &Work,
    ) -> DResult<()> {
        let g = &self.geo;
        let (d, f, nh, hd) = (g.dim, g.ffn, g.n_heads, g.head_dim());
        let r = p.rows;
        debug_assert!(r <= w.rows);
        let rows = |modulation: u64| NormRows {
            x: p.x,
            rows: r,
            d,
            eps: g.norm_eps,
            modulation,
            mod_stride,
            map: p.map,
        };
        // The FP8 attention, where loaded and every item is long enough for it.
        let attn8 = match (&self.k.attn8, &w.attn8) {
            (Some(k8), Some(b)) if p.segs.iter().all(|sg| sg.l >= k8.min_keys) => Some((k8, b)),
            _ => None,
        };
        // A modulated block's norm weights are folded into its modulation (ada_finish).
        let norm_w = |modulation: u64, w: &DBuf| if modulation != 0 { 0 } else { w.ptr() };
        let first = &blocks[0];
        let t = self.prof_start()?;
        let out = w.gemm_input(&first.qkv);
        dit_rows::rms_mod(
            &self.dev,
            &self.k.rows,
            &rows(mods[0]),
            norm_w(mods[0], &first.n1),
            0,
            out,
        )?;
        self.prof_stop(t, ROWS)?;
        let scale = 1.0 / (hd as f32).sqrt();
        for (i, b) in blocks.iter().enumerate() {
            let m = mods[i];
            // x += gate · rmsnorm(o) · norm, then the next GEMM's pre-norm of x.
            let residual = |o: GemmRows, norm: &DBuf, gate_slot: i32, next: Option<NextNorm>| {
                let o = (o, norm_w(m, norm));
                dit_rows::residual_norm(&self.dev, &self.k.rows, &rows(m), o, gate_slot, next)
            };
            let t = self.prof_start()?;
            let qkv_out = w.qkv.ptr();
            self.block_gemm(w, &b.qkv, (3 * d, d), r, qkv_out, false)?;
            self.prof_stop(t, GEMM)?;
            let t = self.prof_start()?;
            // Where V goes. The FP8 attention (attn8_prep) and attn_full_ws read it from the
            // q|k|v rows, the latter where every item's keys are consecutive rows; otherwise
            // qk_norm_rope copies it to vc (bf16 for attn_full_ws, f16 for the older kernels).
            let ws_rows = self.k.attn.v_bf16() && p.segs.iter().all(Seg::keys_contiguous);
            let v_copy = attn8.is_none() && !ws_rows;
            // The attention makes Q itself from the rows: attn_full_ws (f16) and attn_full_ws8
            // (e4m3 with a scale per row and head, as qk_norm_rope encodes it).
            let q_rows = (attn8.is_some() || self.k.attn.q_f16()).then_some(QRows {
                ld: 3 * d,
                norm: b.norm_q.ptr(),
                eps: g.qk_eps,
                cos: p.cos,
                sin: p.sin,
                map: p.map,
            });
            self.norm_rope(b, w, p, attn8.map(|(_, a8)| a8), v_copy, q_rows)?;
            self.prof_stop(t, ROWS)?;
            let t = self.prof_start()?;
            // The FP8 attention writes the O GEMM's e4m3 input itself when that GEMM runs in FP8.
            let fp8_gemms = matches!(self.gemm8, Some(Gemm8::Fp8(..)));
            let o_e4m3 = attn8.and(w.q8_input(&b.out).filter(|_| fp8_gemms));
            if let Some((_, a8)) = attn8 {
                let vt: usize = p
                    .segs
                    .iter()
                    .map(|sg| sg.l.next_multiple_of(W8_KEYS) * d)
                    .sum();
                if vt > a8.vt8.len() {
                    return Err(DevError("FP8 attention: Vᵀ buffer too small".into()));
                }
            }
            let mut vt_off = 0;
            for (si, sg) in p.segs.iter().enumerate() {
                let call = AttnCall {
                    q: match q_rows {
                        Some(_) => w.qkv.ptr(),
                        None => w.q.at(sg.j * d * self.k.attn.q_bytes()),
                    },
                    k: w.kc.at(sg.j * d * 2),
                    v: if ws_rows {
                        w.qkv.at((sg.img_row0 * 3 * d + 2 * d) * 2)
                    } else {
                        w.vc.at(sg.j * d * 2)
                    },
                    v_ld: ws_rows.then_some(3 * d),
                    len: sg.l,
                    n_heads: nh,
                    scale,
                    img_row0: sg.img_row0,
                    np: sg.np,
                    cap_row0: sg.cap_row0,
                    out: w.hb.ptr(),
                    force_split: false,
                    q_rows,
                };
                match attn8 {
                    Some((k8, a8)) => {
                        let lp = sg.l.next_multiple_of(W8_KEYS);
                        let e = Attn8Call {
                            q8: a8.q8.at(sg.j * d),
                            qsc: a8.qsc.at(sg.j * nh * 4),
                            k8: a8.k8.at(sg.j * d),
                            k_scale: b.k8_scale,
                            k_from_f16: false,
                            vt8: a8.vt8.at(vt_off),
                            lp,
                            amax: a8.amax.at(si * nh * 4),
                            out_e4m3: o_e4m3,
                            // V straight from the GEMM's rows: qk_norm_rope made no f16 copy.
                            v_rows: Some((w.qkv.at(2 * d * 2), 3 * d)),
                        };
                        vt_off += lp * d;
                        k8.launch(&self.dev, &call, &e)?;
                    }
                    None => self.k.attn.launch(&self.dev, &call)?,
                }
            }
            self.prof_stop(t, ATTN)?;
            let t = self.prof_start()?;
            if o_e4m3.is_none() {
                self.quantize_attention(w, &b.out, d, r)?;
            }
            let attn_o = self.block_gemm(w, &b.out, (d, d), r, w.o.ptr(), true)?;
            self.prof_stop(t, GEMM)?;
            let t = self.prof_start()?;
            let ffn_norm = NextNorm {
                w: norm_w(m, &b.f1),
                modulation: m,
                slot: 2,
                out: w.gemm_input(&b.w13),
            };
            residual(attn_o, &b.n2, 1, Some(ffn_norm))?;
            self.prof_stop(t, ROWS)?;
            let t = self.prof_start()?;
            let gu = self.block_gemm(w, &b.w13, (2 * f, d), r, w.g.ptr(), true)?;
            self.prof_stop(t, GEMM)?;
            let t = self.prof_start()?;
            let out = w.gemm_input(&b.w2);
            dit_rows::swiglu(&self.dev, &self.k.rows, gu, r, f, out)?;
            self.prof_stop(t, ROWS)?;
            let t = self.prof_start()?;
            let ffn_o = self.block_gemm(w, &b.w2, (d, f), r, w.o.ptr(), true)?;
            self.prof_stop(t, GEMM)?;
            let t = self.prof_start()?;
            let next = blocks.get(i + 1).map(|nb| NextNorm {
                w: norm_w(mods[i + 1], &nb.n1),
                modulation: mods[i + 1],
                slot: 0,
                out: w.gemm_input(&nb.qkv),
            });
            residual(ffn_o, &b.f2, 3, next)?;
            self.prof_stop(t, ROWS)?;
        }
        Ok(())
    }

    /// Before the O GEMM, where the attention wrote its output as bf16 rows in `hb`: when the
    /// GEMM on `w` runs in 8 bits they are quantised here (the attention kernels write per head
    /// and a row's amax spans all heads; the FP8 attention writes e4m3 itself, with a scale its
    /// V maxima bound, where the O GEMM runs in FP8).
    fn quantize_attention(&self, work: &Work, w: &Plane, k: usize, r: usize) -> DResult<()> {
        match (work.q8_input(w), &self.gemm8) {
            (Some((q, s)), Some(g)) => g.quantize(work.hb.ptr(), r, k, k, q, s),
            _ => Ok(()),
        }
    }

    fn condition_dev(&mut self, cap: &[f32], len: usize, rope: RopeRows) -> DResult<CondId> {
        let g = self.geo.clone();
        let (d, cf) = (g.dim, g.cap_feat_dim);
        let lp = pad_rows(len.max(1));
        let dev = self.dev.clone();
        let work = self.new_work(lp)?;
        let capd = dev.upload_new(bytes_of(cap))?;
        let rows = dev.alloc(lp * d * self.x_bytes)?;
        self.launch(
            &self.k.rms,
            (len as u32, 1, 1),
            ROW_THREADS,
            0,
            &[
                Arg::Ptr(capd.ptr()),
                Arg::Ptr(self.cap_norm.ptr()),
                Arg::F32(g.norm_eps),
                Arg::I32(cf as i32),
                Arg::Ptr(work.hb.ptr()),
            ],
        )?;
        self.gemm(&self.cap_embed.0, d, cf, work.hb.ptr(), work.q.ptr(), len)?;
        self.launch(
            &self.k.bias_pad,
            row_grid(lp),
            256,
            0,
            &[
                Arg::Ptr(work.q.ptr()),
                Arg::Ptr(rows.ptr()),
                Arg::I32(d as i32),
                Arg::U64(lp as u64),
                Arg::I32(lp as i32),
                Arg::I32(len as i32),
                Arg::Ptr(self.cap_embed.1.ptr()),
                Arg::Ptr(self.cap_pad.ptr()),
            ],
        )?;
        let map: Vec<i32> = (0..lp)
            .flat_map(|j| [0, 0, lp as i32, j as i32, j as i32])
            .collect();
        let mapd = dev.upload_new(bytes_of(&map))?;
        let cos = dev.upload_new(bytes_of(rope.cos))?;
        let sin = dev.upload_new(bytes_of(rope.sin))?;
        if !self.ctx.is_empty() {
            let segs = [Seg {
                j: 0,
                l: lp,
                img_row0: 0,
                np: lp,
                cap_row0: 0,
            }];
            let pass = Pass {
                x: rows.ptr(),
                rows: lp,
                map: mapd.ptr(),
                cos: cos.ptr(),
                sin: sin.ptr(),
                segs: &segs,
            };
            let mods = vec![0u64; self.ctx.len()];
            self.run_blocks(&self.ctx, &mods, 0, &pass, &work)?;
        }
        dev.sync()?;
        let id = CondId(self.conds.len());
        self.conds.push(Some(Cond { rows, lp }));
        Ok(id)
    }

    fn prepare_dev(&mut self, items: &[DitItemSetup], ni: usize) -> DResult<()> {
        self.keep_work();
        let g = self.geo.clone();
        let (d, a, pd) = (g.dim, g.adaln_dim, g.patch_dim);
        let half = g.head_dim() / 2;
        let np = pad_rows(ni);
        let nb = items.len();
        let mut rope_rows = 0;
        let mut its = Vec::with_capacity(nb);
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for it in items {
            let lp = self.conds[it.cond.0].as_ref().expect("checked").lp;
            its.push((it.cond, lp, rope_rows));
            rope_rows += np + lp;
            cos.extend_from_slice(it.rope.cos);
            sin.extend_from_slice(it.rope.sin);
        }
        debug_assert_eq!(cos.len(), rope_rows * half);
        let rows: usize = its.iter().map(|&(_, lp, _)| np + lp).sum();
        let n_mod = self.noise.len() + self.layers.len();
        let dev = self.dev.clone();
        let prep = Prepared {
            ni,
            np,
            items: its,
            cos: dev.upload_new(bytes_of(&cos))?,
            sin: dev.upload_new(bytes_of(&sin))?,
            x: dev.alloc(rows * d * self.x_bytes)?,
            work: match self.spare_work.take() {
                Some(w) if w.rows == rows => w,
                _ => self.new_work(rows)?,
            },
            map_main: dev.alloc(rows * MAPW * 4)?,
            map_nr: dev.alloc(nb * np * MAPW * 4)?,
            patches: dev.alloc(nb * ni * pd * 2)?,
            temb: dev.alloc(nb * a * 2)?,
            temb_silu: dev.alloc(nb * a * 2)?,
            modv: dev.alloc(nb * n_mod * 4 * d * 4)?,
            fscale: dev.alloc(nb * d * 4)?,
            out: dev.alloc(nb * ni * pd * 4)?,
            out_host: PinnedBuf::new(nb * ni * pd * 4).ok(),
            maps_for: Vec::new(),
            graph: None,
        };
        dev.sync()?;
        self.prep = Some(prep);
        Ok(())
    }

    fn step_dev(&mut self, items: &[DitStepItem], out: &mut Vec<f32>) -> DResult<()> {
        let g = self.geo.clone();
        let (a, pd) = (g.adaln_dim, g.patch_dim);
        let p = self.prep.as_ref().expect("checked");
        let (ni, np, nb) = (p.ni, p.np, items.len());
        let active: Vec<usize> = items.iter().map(|it| it.slot).collect();
        let lay = layout_rows(np, &p.items, &active);
        let dev = self.dev.clone();
        if p.maps_for != active {
            dev.upload(p.map_main.ptr(), bytes_of(&lay.main))?;
            dev.upload(p.map_nr.ptr(), bytes_of(&lay.nr))?;
        }
        // Where a step's wall time goes, at debug verbosity: host conversions, uploads, the
        // device's own time (events around the launch) and the readback.
        let timing = crate::facade::log::debug_enabled();
        let w0 = std::time::Instant::now();
        // Host inputs: patches and t-embeddings as bf16 GEMM operands.
        let to_bf16 = |v: &mut Vec<u16>, xs: &[f32]| {
            v.extend(xs.iter().map(|&x| bf16::from_f32(x).to_bits()))
        };
        let mut pb = Vec::with_capacity(nb * ni * pd);
        let mut tb = Vec::with_capacity(nb * a);
        let mut sb = Vec::with_capacity(nb * a);
        for it in items {
            to_bf16(&mut pb, it.patches);
            to_bf16(&mut tb, it.t_emb);
            let silu: Vec<f32> = it.t_emb.iter().map(|&x| x / (1.0 + (-x).exp())).collect();
            to_bf16(&mut sb, &silu);
        }
        let convert_s = w0.elapsed().as_secs_f64();
        dev.upload(p.patches.ptr(), bytes_of(&pb))?;
        dev.upload(p.temb.ptr(), bytes_of(&tb))?;
        dev.upload(p.temb_silu.ptr(), bytes_of(&sb))?;
        let upload_s = w0.elapsed().as_secs_f64() - convert_s;

        // The device work: replayed as a graph captured for this set of active items. The first
        // step with a set runs eagerly (which also sets up what capture may not: cuBLAS's and
        // cuBLASLt's state, the FP8 plans) and the graph is captured right after it is enqueued,
        // while the GPU runs it, so the capture costs no device time. Eager when profiling, with
        // after a capture failed.
        let graphs = self.prof.is_none() && !self.no_graph;
        let p = self.prep.as_ref().expect("checked");
        let timer = if timing { Some(Timer::new()?) } else { None };
        if let Some(t) = &timer {
            t.start(&dev)?;
        }
        let l0 = std::time::Instant::now();
        let replay = matches!(&p.graph, Some((a, _)) if graphs && *a == active);
        match &p.graph {
            Some((_, gr)) if replay => gr.launch()?,
            _ => self.enqueue_step(p, &lay, &active)?,
        }
        let launch_s = l0.elapsed().as_secs_f64();
        if let Some(t) = &timer {
            t.stop(&dev)?;
        }
        let c0 = std::time::Instant::now();
        if graphs && !replay {
            match dev.capture(|| self.enqueue_step(p, &lay, &active)) {
                Ok(gr) => {
                    crate::facade::log::debug(&format!(
                        "dit: step graph captured for {} item(s) in {:.2} ms, beside the eager step",
                        active.len(),
                        1e3 * c0.elapsed().as_secs_f64()
                    ));
                    self.prep.as_mut().expect("checked").graph = Some((active.clone(), gr));
                }
                Err(e) => {
                    let why = format!(
                        "dit: the step graph's capture failed, eager from here: {}",
                        e.0
                    );
                    crate::facade::log::debug(&why);
                    self.no_graph = true;
                }
            }
        }
        let gpu_ms = match &timer {
            Some(t) => t.elapsed_ms()?,
            None => 0.0,
        };
        let r0 = std::time::Instant::now();
        out.resize(nb * ni * pd, 0.0);
        let p = self.prep.as_mut().expect("checked");
        match &mut p.out_host {
            Some(host) => {
                let bytes = &mut host.bytes_mut()[..4 * out.len()];
                dev.download(bytes, p.out.ptr())?;
                f32s_from_le_bytes(out, bytes);
            }
            None => dev.download_f32(out, p.out.ptr())?,
        }
        if timing {
            crate::facade::log::debug(&format!(
                "dit device step ({}): convert {:.2} ms, upload {:.2} ms, launch {:.2} ms, device {:.2} ms, readback {:.2} ms",
                if replay { "graph" } else { "eager" },
                1e3 * convert_s,
                1e3 * upload_s,
                1e3 * launch_s,
                gpu_ms,
                1e3 * r0.elapsed().as_secs_f64()
            ));
        }
        self.prep.as_mut().expect("checked").maps_for = active;
        Ok(())
    }

    /// Every launch of one step for the active items `active` (laid out as `lay`), in order:
    /// what the step graph captures. Reads the step's inputs where `step_dev` uploaded them and
    /// leaves the output in `p.out`.
    fn enqueue_step(&self, p: &Prepared, lay: &Layout, active: &[usize]) -> DResult<()> {
        let g = &self.geo;
        let (d, a, pd) = (g.dim, g.adaln_dim, g.patch_dim);
        let (ni, np, nb) = (p.ni, p.np, active.len());
        let dev = &self.dev;
        // Modulations of every block (one GEMM, then 1 + scale and tanh(gate) once for all the
        // row kernels) and the final layer's scale.
        let n_mod = self.noise.len() + self.layers.len();
        let mod_stride = n_mod * 4 * d;
        self.gemm(&self.ada.0, mod_stride, a, p.temb.ptr(), p.modv.ptr(), nb)?;
        self.launch(
            &self.k.ada_finish,
            column_grid(mod_stride, nb),
            256,
            0,
            &[
                Arg::Ptr(p.modv.ptr()),
                Arg::I32(mod_stride as i32),
                Arg::U64(nb as u64),
                Arg::I32(d as i32),
                Arg::Ptr(self.ada.1.ptr()),
                Arg::Ptr(self.ada_norms.ptr()),
            ],
        )?;
        self.gemm(
            &self.final_ada.0,
            d,
            a,
            p.temb_silu.ptr(),
            p.fscale.ptr(),
            nb,
        )?;
        self.add_bias(p.fscale.ptr(), d, nb, &self.final_ada.1)?;

        // Embed the patches of each item into its Np image rows (f32, in the work's Q buffer),
        // then into X with the bias; pad rows take x_pad_token.
        for k in 0..nb {
            self.gemm(
                &self.x_embed.0,
                d,
                pd,
                p.patches.at(k * ni * pd * 2),
                p.work.q.at(k * np * d * 4),
                ni,
            )?;
        }
        self.launch(
            &self.k.bias_pad,
            row_grid(nb * np),
            256,
            0,
            &[
                Arg::Ptr(p.work.q.ptr()),
                Arg::Ptr(p.x.ptr()),
                Arg::I32(d as i32),
                Arg::U64((nb * np) as u64),
                Arg::I32(np as i32),
                Arg::I32(ni as i32),
                Arg::Ptr(self.x_embed.1.ptr()),
                Arg::Ptr(self.x_pad.ptr()),
            ],
        )?;
        let mod_at = |b: usize| p.modv.at(b * 4 * d * 4);
        if !self.noise.is_empty() {
            let mods: Vec<u64> = (0..self.noise.len()).map(mod_at).collect();
            let pass = Pass {
                x: p.x.ptr(),
                rows: nb * np,
                map: p.map_nr.ptr(),
                cos: p.cos.ptr(),
                sin: p.sin.ptr(),
                segs: &lay.segs_nr,
            };
            self.run_blocks(&self.noise, &mods, mod_stride, &pass, &p.work)?;
        }
        for (k, &s) in active.iter().enumerate() {
            let (cond, lp, _) = p.items[s];
            let c = self.conds[cond.0].as_ref().expect("checked");
            let xb = self.x_bytes;
            dev.copy_d2d(p.x.at(lay.cap_rows[k] * d * xb), c.rows.ptr(), lp * d * xb)?;
        }
        if !self.layers.is_empty() {
            let mods: Vec<u64> = (0..self.layers.len())
                .map(|l| mod_at(self.noise.len() + l))
                .collect();
            let pass = Pass {
                x: p.x.ptr(),
                rows: lay.rows,
                map: p.map_main.ptr(),
                cos: p.cos.ptr(),
                sin: p.sin.ptr(),
                segs: &lay.segs_main,
            };
            self.run_blocks(&self.layers, &mods, mod_stride, &pass, &p.work)?;
        }
        // Final layer on the real image rows.
        self.launch(
            &self.k.final_norm,
            ((nb * ni) as u32, 1, 1),
            ROW_THREADS,
            0,
            &[
                Arg::Ptr(p.x.ptr()),
                Arg::I32(d as i32),
                Arg::F32(g.final_eps),
                Arg::I32(np as i32),
                Arg::I32(ni as i32),
                Arg::Ptr(p.fscale.ptr()),
                Arg::Ptr(p.work.hb.ptr()),
            ],
        )?;
        self.gemm(
            &self.final_lin.0,
            pd,
            d,
            p.work.hb.ptr(),
            p.out.ptr(),
            nb * ni,
        )?;
        self.add_bias(p.out.ptr(), pd, nb * ni, &self.final_lin.1)
    }
}

/// Row maps and attention segments of a step over the `active` prepared items.
fn layout_rows(np: usize, items: &[(CondId, usize, usize)], active: &[usize]) -> Layout {
    let n = active.len();
    let mut main = vec![0i32; 0];
    let mut nr = vec![0i32; 0];
    let mut segs_main = Vec::with_capacity(n);
    let mut segs_nr = Vec::with_capacity(n);
    let mut cap_rows = Vec::with_capacity(n);
    let mut joint = 0;
    let mut caps = Vec::with_capacity(n);
    for (k, &s) in active.iter().enumerate() {
        let (_, lp, ro) = items[s];
        segs_nr.push(Seg {
            j: k * np,
            l: np,
            img_row0: k * np,
            np,
            cap_row0: 0,
        });
        caps.push((k, joint, lp, ro));
        joint += np + lp;
    }
    // X rows: [img of each active item] then [caption of each].
    for &(k, j, lp, ro) in &caps {
        for q in 0..np {
            main.extend([k, j, np + lp, q, ro + q].map(|v| v as i32));
            nr.extend([k, k * np, np, q, ro + q].map(|v| v as i32));
        }
    }
    let mut cap_row = n * np;
    for &(k, j, lp, ro) in &caps {
        cap_rows.push(cap_row);
        segs_main.push(Seg {
            j,
            l: np + lp,
            img_row0: k * np,
            np,
            cap_row0: cap_row,
        });
        for q in 0..lp {
            let pos = np + q;
            main.extend([k, j, np + lp, pos, ro + pos].map(|v| v as i32));
        }
        cap_row += lp;
    }
    Layout {
        main,
        nr,
        segs_main,
        segs_nr,
        cap_rows,
        rows: cap_row,
    }
}

struct Layout {
    main: Vec<i32>,
    nr: Vec<i32>,
    segs_main: Vec<Seg>,
    segs_nr: Vec<Seg>,
    /// First X row of each active item's caption.
    cap_rows: Vec<usize>,
    rows: usize,
}

/// Device bytes of the weights as bf16 planes (the vectors not counted: a rounding error).
fn bf16_weight_bytes(m: &DitModel) -> u64 {
    let w = |w: &Weight| (w.rows * w.cols * 2) as u64;
    let blk = |b: &DitBlockWeights| {
        [&b.to_q, &b.to_k, &b.to_v, &b.to_out, &b.w1, &b.w2, &b.w3]
            .iter()
            .map(|x| w(x))
            .sum::<u64>()
            + b.ada.as_ref().map_or(0, |a| w(&a.w))
    };
    let blocks: u64 = m
        .noise_refiner
        .iter()
        .chain(&m.context_refiner)
        .chain(&m.layers)
        .map(blk)
        .sum();
    blocks
        + [
            &m.x_embedder,
            &m.cap_embedder,
            &m.final_ada,
            &m.final_linear,
        ]
        .iter()
        .map(|l| w(&l.w))
        .sum::<u64>()
}

/// Device bytes of one block's 8-bit planes (rows and row scales; those that run in 8 bits).
fn block_q8_bytes(g: &DitGeometry) -> u64 {
    block_plane_shapes(g)
        .iter()
        .filter(|&&(n, k)| q8_fits(n, k))
        .map(|&(n, k)| (n * k + 4 * n) as u64)
        .sum()
}

/// `w` decoded to bf16 bytes on the host (the slow path for odd column counts).
fn host_bf16(w: &Weight) -> Vec<u8> {
    let mut row = vec![0f32; w.cols];
    let mut out = Vec::with_capacity(w.rows * w.cols * 2);
    for r in 0..w.rows {
        cmf_kernels::reference::decode_row(w, r, &mut row);
        out.extend(row.iter().flat_map(|&v| bf16::from_f32(v).to_le_bytes()));
    }
    out
}

/// Weight upload: any codec → a bf16 plane on the device; [`Uploader::to_q8`] turns a block's
/// GEMM planes 8-bit when an 8-bit path is on.
struct Uploader<'u> {
    dev: &'u Dev,
    /// `dequant_rows` (rowops.cu).
    dequant: &'u Func,
    /// [`block_plane_shapes`] of the model.
    shapes: [(usize, usize); 4],
}

impl Uploader<'_> {
    /// Stacks `ws` (same column count) row-wise into one bf16 plane.
    fn plane(&self, ws: &[&Weight]) -> DResult<DBuf> {
        let cols = ws[0].cols;
        let rows: usize = ws.iter().map(|w| w.rows).sum();
        let plane = self.dev.alloc(rows * cols * 2)?;
        let mut r0 = 0;
        for w in ws {
            if w.cols != cols {
                return Err(DevError(
                    "stacked matrices must share their column count".into(),
                ));
            }
            let dst = plane.at(r0 * cols * 2);
            if w.dtype == Dtype::Bf16 {
                self.dev.upload(dst, w.data)?;
            } else if w.cols % 32 != 0 {
                self.dev.upload(dst, &host_bf16(w))?;
            } else {
                // The temporary codec planes are freed in stream order (after the kernel),
                // so the next weight's upload overlaps this one's.
                let tmp = DevWeight::upload(self.dev, w)?;
                tmp.dequant(self.dev, self.dequant, 0, w.rows, DequantTo::Bf16(dst))?;
            }
            r0 += w.rows;
        }
        Ok(plane)
    }

    fn vec(&self, v: &[f32]) -> DResult<DBuf> {
        self.dev.upload_new(bytes_of(v))
    }

    fn linear(&self, l: &DitLinear) -> DResult<(DBuf, DBuf)> {
        let b = match l.b {
            Some(b) => b.to_vec(),
            None => vec![0.0; l.w.rows],
        };
        Ok((self.plane(&[&l.w])?, self.vec(&b)?))
    }

    fn block(&self, b: &DitBlockWeights) -> DResult<Block> {
        Ok(Block {
            qkv: Plane::Bf16(self.plane(&[&b.to_q, &b.to_k, &b.to_v])?),
            out: Plane::Bf16(self.plane(&[&b.to_out])?),
            w13: Plane::Bf16(self.plane(&[&b.w1, &b.w3])?),
            w2: Plane::Bf16(self.plane(&[&b.w2])?),
            norm_q: self.vec(b.norm_q)?,
            norm_k: self.vec(b.norm_k)?,
            k8_scale: k8_scale(b.norm_k, b.norm_k.len()),
            n1: self.vec(b.attention_norm1)?,
            n2: self.vec(b.attention_norm2)?,
            f1: self.vec(b.ffn_norm1)?,
            f2: self.vec(b.ffn_norm2)?,
        })
    }

    /// Each of `b`'s GEMM planes whose shape cuBLASLt runs in 8 bits, made 8-bit on the device;
    /// the bf16 plane is freed in stream order right after (so a load peaks at the bf16 planes
    /// plus one block's 8-bit ones, and keeps the 8-bit ones only).
    fn to_q8(&self, g: &Gemm8, b: &mut Block) -> DResult<()> {
        let planes = [&mut b.qkv, &mut b.out, &mut b.w13, &mut b.w2];
        for (p, (n, k)) in planes.into_iter().zip(self.shapes) {
            if let (Plane::Bf16(w), true) = (&*p, q8_fits(n, k)) {
                *p = Plane::Q8(Plane8::of(self.dev, g, w, n, k)?);
            }
        }
        Ok(())
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
