//! The DiT's attention: the kernels (`attn_full_ws`: warp-specialised wgmma on Hopper;
//! `attn_full_ws8`: its FP8 form; `base`: mma.sync on every device), which one runs, their
//! launch shapes, the tail split of a launch's last round, and the test hook.

use super::*;

/// Threads, query rows and dynamic shared memory of one attention block.
#[derive(Clone, Copy)]
pub(super) struct AttnShape {
    pub(super) threads: u32,
    pub(super) rows: usize,
    pub(super) smem: usize,
}

/// A loaded attention kernel (its module kept alive with it).
pub(super) struct AttnKernel {
    pub(super) f: Func,
    pub(super) shape: AttnShape,
    /// K and V reach the kernel as TMA tensor maps of boxes of this many keys (attn_full_ws)
    /// rather than as pointers; such a kernel splits its last round (`split`).
    pub(super) tma_keys: Option<u32>,
    pub(super) split: Option<Arc<TailSplit>>,
    _m: Module,
}

/// The tail split of attn_full_ws and attn_full_ws8 (kernels/attention_wg.cu, `ws_work`): their
/// tiles (128 query rows of one head) run in rounds of one block per SM, and where a launch's last
/// round would be at most half full (1024²: 990 tiles on 132 SMs, 7 rounds and 66), its tiles
/// run as two halves of the key tiles each, the second to finish merging the first's state, so
/// the round takes about half as long. One serves
/// both kernels: their launches queue on one stream, and each leaves the counters zero.
pub(super) struct TailSplit {
    /// Per split tile and half, each consumer thread's state (`WS_PART` floats).
    pub(super) part: DBuf,
    /// A u32 counter per split tile (zero between launches: the second half resets it).
    pub(super) pairs: DBuf,
    pub(super) max_pairs: usize,
    pub(super) sms: usize,
}

/// The first split tile of a launch of `tiles` tiles over `key_tiles` key tiles on `sms` SMs
/// (`tiles`: none split): the last round's, where it holds at most half as many tiles as SMs.
pub(super) fn tail_split_from(tiles: usize, key_tiles: usize, sms: usize) -> usize {
    let tail = tiles % sms;
    if key_tiles >= 2 && tail > 0 && tail <= sms / 2 {
        tiles - tail
    } else {
        tiles
    }
}

/// Floats of a consumer thread's state in [`TailSplit::part`]: `WS_PART(N)` for the larger N of
/// the two kernels (attn_full_ws8's 64 accumulators and 4 ones columns).
pub(super) const WS_PART_FLOATS: usize = 68 + 4;

impl TailSplit {
    pub(super) fn new(dev: &Dev) -> DResult<TailSplit> {
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
    pub(super) fn split_from(&self, tiles: usize, key_tiles: usize, force: bool) -> usize {
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
    pub(super) fn launch_parts(
        &self,
        tiles: usize,
        key_tiles: usize,
        force: bool,
    ) -> ([Arg; 3], u32) {
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
    pub(super) fn q_f16(&self) -> bool {
        self.tma_keys.is_some()
    }

    /// Whether the kernel reads V as bf16 (attn_full_ws: from the q|k|v rows where it can, see
    /// [`AttnCall::v_ld`]) rather than f16.
    pub(super) fn v_bf16(&self) -> bool {
        self.tma_keys.is_some()
    }

    /// Bytes of one Q value as the kernel reads it.
    pub(super) fn q_bytes(&self) -> usize {
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
pub(super) struct AttnCall {
    pub(super) q: u64,
    pub(super) k: u64,
    pub(super) v: u64,
    /// `Some(ld)`: v is instead the item's first V value in the q|k|v GEMM's rows (bf16, `ld`
    /// values a row, the keys' rows consecutive: see [`Seg::keys_contiguous`]); attn_full_ws only.
    pub(super) v_ld: Option<usize>,
    pub(super) len: usize,
    pub(super) n_heads: usize,
    pub(super) scale: f32,
    pub(super) img_row0: usize,
    pub(super) np: usize,
    pub(super) cap_row0: usize,
    pub(super) out: u64,
    /// The test hook's: split half of the tiles whatever the round (see [`TailSplit`]).
    pub(super) force_split: bool,
    /// attn_full_ws only: `q` is instead the q|k|v GEMM's rows, which the kernel normalises and
    /// rotates itself as it loads Q (qk_norm_rope then skips Q).
    pub(super) q_rows: Option<QRows>,
}

/// What attn_full_ws needs to make Q from the q|k|v rows (its `WsQRows`): the rows' stride in
/// values, the q norm weight and eps, the RoPE tables and the row map (each X row's table row
/// is its map entry's last field).
#[derive(Clone, Copy)]
pub(super) struct QRows {
    pub(super) ld: usize,
    pub(super) norm: u64,
    pub(super) eps: f32,
    pub(super) cos: u64,
    pub(super) sin: u64,
    pub(super) map: u64,
}

impl QRows {
    /// The kernels' trailing arguments (`q_ld` .. `q_rope_stride`); zeros (q_norm null) for none.
    pub(super) fn args(qr: Option<QRows>) -> [Arg; 7] {
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
    pub(super) fn launch(&self, dev: &Dev, c: &AttnCall) -> DResult<()> {
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
pub(super) struct Attn8 {
    pub(super) prep: Func,
    pub(super) attn: Func,
    pub(super) smem: usize,
    /// A pass runs it only when every item has at least this many keys ([`attn8_request`]).
    pub(super) min_keys: usize,
    /// Q rows to e4m3 as qk_norm_rope writes them (the test hook's).
    pub(super) quant_q: Func,
    pub(super) split: Arc<TailSplit>,
    _m: Module,
}

/// Rows per qk_norm_rope block (`QKR_ROWS` in dit.cu); its warps take 256 / HD heads of a row
/// each (`QKR_HPW`), 4 a block.
pub(super) const QKR_ROWS: usize = 16;

/// k_norm_rope's head pairs a warp (`KR_G` in dit.cu) and rows a block (`KR_ROWS`: `KR_WARPS`
/// warps of one row).
pub(super) const KR_G: usize = 5;
pub(super) const KR_ROWS: usize = 8;

/// Keys per attn_full_ws8 tile (`W8_KEYS`): Vᵀ rows are padded to a multiple of it.
pub(super) const W8_KEYS: usize = 128;

/// Where one item's FP8 attention operands live (f16 V, and the test hook's f16 K: the
/// [`AttnCall`]'s `v` and `k`).
pub(super) struct Attn8Call {
    /// `[l, NH, 128]` e4m3 Q and `[l, NH]` f32 scales (qk_norm_rope writes them).
    pub(super) q8: u64,
    pub(super) qsc: u64,
    /// `[NH, l, 128]` e4m3 K (qk_norm_rope writes it; attn8_prep from the f16 K when
    /// `k_from_f16`) and its scale.
    pub(super) k8: u64,
    pub(super) k_scale: f32,
    pub(super) k_from_f16: bool,
    /// `[NH, 128, lp]` e4m3 Vᵀ (attn8_prep writes it).
    pub(super) vt8: u64,
    pub(super) lp: usize,
    /// The item's `[NH]` V maxima (u32 bits).
    pub(super) amax: u64,
    /// Where the output goes as e4m3 rows and per-row scales (the O GEMM's FP8 input), or
    /// `None`: bf16 rows at the [`AttnCall`]'s `out`.
    pub(super) out_e4m3: Option<(u64, u64)>,
    /// V as the q|k|v GEMM wrote it: the first V value of X row 0 (bf16) and the row stride in
    /// values; the [`AttnCall`]'s rows map keys to X rows. `None`: the f16 V at its `v`.
    pub(super) v_rows: Option<(u64, usize)>,
}

impl Attn8 {
    /// Loads the module [`Attn8::job`] made (with its slot count).
    /// `split`: the bf16 attention's tail-split scratch where it has one, else a new one.
    pub(super) fn load(
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
    pub(super) fn job(
        dev: &Dev,
        hd: usize,
        defs: &[(&'static str, String)],
    ) -> Option<(Job, usize)> {
        let arch = dev.arch_specific().filter(|_| hd == 128)?;
        let mut defs = defs.to_vec();
        defs.push(("WS_KEYS", WS_KEYS.to_string()));
        Some((
            Job::new("attention_wg", ATTENTION_WG, &defs, &arch),
            WS8_SLOTS,
        ))
    }

    pub(super) fn launch(&self, dev: &Dev, c: &AttnCall, e: &Attn8Call) -> DResult<()> {
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
pub(super) fn k8_scale(norm_k: &[f32], hd: usize) -> f32 {
    let wmax = norm_k.iter().fold(0f32, |m, w| m.max(w.abs()));
    let bound = (hd as f32).sqrt() * wmax;
    if bound > 0.0 && bound.is_finite() {
        bound / 448.0
    } else {
        1.0
    }
}

/// Whether the DiT attention may run in FP8 (attn_full_ws8), and from how many keys per item
/// on: the model's [`Fp8Attention`]; by default with the FP8 GEMMs (the model's precision) from
/// [`ATTN8_MIN_KEYS`].
pub(super) fn attn8_request(precision: DitPrecision, choice: Fp8Attention) -> Option<usize> {
    match choice {
        Fp8Attention::Always => Some(0),
        Fp8Attention::Never => None,
        Fp8Attention::Auto => {
            let fp8 = matches!(gemm8_request(precision), Some(Gemm8Kind::Fp8 { .. }));
            (ATTN8_WITH_FP8 && fp8).then_some(ATTN8_MIN_KEYS)
        }
    }
}

/// Shorter sequences keep the bf16 attention by default. Measured on the H200 (2026-12-01):
/// at 512² (1056 keys) the FP8 attention is now faster too (fp8-fast step 15.86 → 15.58 ms; image
/// 38.3 dB from the bf16 path's, 38.5 with the bf16 attention); before its O output and K scale
/// changed it was slower there (16.1 → 16.7). Below 1024 keys it was not measured.
pub(super) const ATTN8_MIN_KEYS: usize = 1024;

/// Whether `--dit-precision fp8` / `fp8-fast` include the FP8 attention by default. Measured on
/// the H200 (2026-12-01, side by side): fp8-fast 1024² step 61.1–61.4 ms with the bf16 attention,
/// 58.9 with the FP8 one; the 1024² image 37.8 dB from the bf16 path's (38.1 dB without it).
pub(super) const ATTN8_WITH_FP8: bool = true;

#[derive(Clone, PartialEq, Debug)]
pub(super) enum AttnVariant {
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
pub(super) fn attention_variant(dev: &Dev, hd: usize, choice: &str) -> AttnVariant {
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
pub(super) fn default_attention(dev: &Dev, hd: usize) -> AttnVariant {
    attention_variant(dev, hd, "")
}

/// The module one attention variant lives in.
pub(super) fn attention_job(
    dev: &Dev,
    variant: &AttnVariant,
    defs: &[(&'static str, String)],
) -> Job {
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
pub(super) fn load_attention(
    dev: &Dev,
    hd: usize,
    variant: AttnVariant,
    job: &Job,
) -> DResult<AttnKernel> {
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
