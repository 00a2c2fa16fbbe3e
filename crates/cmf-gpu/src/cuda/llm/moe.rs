//! Mixture-of-experts layers on the device (kernels/moe.cu): the experts resident in their
//! codecs with a table of their plane pointers (uploaded once at load, so the captured decode
//! graph reads the chosen ids from device memory and finds their weights itself), the decode
//! launches, and the prefill grouped by expert.
//!
//! Prefill reads back the chunk's T·k expert ids once per layer (one synchronisation) to order
//! the rows by expert; then per expert with rows: gather, gate|up GEMMs, SwiGLU, down GEMM,
//! weighted scatter-add into the residual stream.

use super::CudaLlm;
use crate::cuda::runtime::device::{bytes_of, grid1, Arg, DBuf, DResult, Dev};
use crate::cuda::runtime::kernels::{Func, Job, Module};
use crate::cuda::runtime::matvec::{self, MatvecConfig, MvMode, MvSeg};
use crate::cuda::runtime::weights::{DevCodec, DevWeight};
use crate::facade::refusal::{Refusal, RefusalReason};
use crate::llm::{Mlp, MoeWeights, Routing};

/// The module: matvec.cu (whose `matvec_body` the indexed expert matvec runs) and moe.cu.
pub const MOE: &str = concat!(
    include_str!("../runtime/kernels/matvec.cu"),
    include_str!("kernels/moe.cu")
);

/// Most experts a token may use (`MOE_MAX_K` in moe.cu).
pub const MOE_MAX_K: usize = 32;

/// The mixture-of-experts kernels, loaded when a model has MoE layers.
pub struct MoeKernels {
    pub route: Func,
    /// The indexed expert matvec per codec (indexed by `DevCodec as usize`).
    pub mv: [Func; 5],
    pub combine: Func,
    pub gather: Func,
    pub scatter_add: Func,
    _module: Module,
}

impl MoeKernels {
    pub fn job(dev: &Dev) -> Job {
        Job::new("moe", MOE, &MatvecConfig::DEFAULT.defines(), &dev.arch())
    }

    /// Loads the module; the matvecs may use up to `max_block_smem` bytes of shared memory.
    pub fn load(dev: &Dev, max_block_smem: usize) -> DResult<MoeKernels> {
        let m = Module::load_all(dev, &[Self::job(dev)])?
            .pop()
            .expect("one job");
        let mv = [
            m.func("moe_mv_q8")?,
            m.func("moe_mv_q4")?,
            m.func("moe_mv_bf16")?,
            m.func("moe_mv_f16")?,
            m.func("moe_mv_f32")?,
        ];
        for f in &mv {
            f.allow_smem(max_block_smem.saturating_sub(f.static_smem()))?;
        }
        Ok(MoeKernels {
            route: m.func("moe_route")?,
            mv,
            combine: m.func("moe_combine")?,
            gather: m.func("moe_gather")?,
            scatter_add: m.func("moe_scatter_add")?,
            _module: m,
        })
    }
}

/// Routes `rows` router outputs (`logits` [rows, ld], the first `e` of each): the `k` chosen
/// expert ids (i32 [rows, k]) and weights (f32 [rows, k]), best first.
#[allow(clippy::too_many_arguments)]
pub fn launch_route(
    dev: &Dev,
    mk: &MoeKernels,
    logits: u64,
    ld: usize,
    e: usize,
    k: usize,
    rows: usize,
    norm_topk_prob: bool,
    ids: u64,
    weights: u64,
    pdl: bool,
) -> DResult<()> {
    dev.launch_ex(
        &mk.route,
        (rows as u32, 1, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(logits),
            Arg::I32(ld as i32),
            Arg::I32(e as i32),
            Arg::I32(k as i32),
            Arg::I32(norm_topk_prob as i32),
            Arg::Ptr(ids),
            Arg::Ptr(weights),
        ],
        pdl,
    )
}

/// Which matrices of the chosen experts an indexed matvec runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertPart {
    /// y = silu(gate·x̂) ⊙ up·x̂ (x̂: x under the fused RMSNorm, when given).
    GateUp = 0,
    /// y = down·x
    Down = 2,
}

/// `struct MoeMvArgs` in moe.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct MoeMvArgsC {
    table: u64,
    ids: u64,
    e: i32,
    first: i32,
    rows: i32,
    k: i32,
    x: u64,
    x_stride: i64,
    norm: u64,
    eps: f32,
    _pad: i32,
    y: u64,
    y_stride: i64,
}

/// An expert table (i64 [E, 9] of plane pointers, [`expert_table`]) and what its planes share.
pub struct ExpertSet {
    pub table: u64,
    pub experts: usize,
    /// The codec of every expert's gate and up, and of every down.
    pub gate_up_codec: DevCodec,
    pub down_codec: DevCodec,
    /// Whether any q8 plane has a column field (q8_2f: the prologue keeps a copy of x per segment).
    pub col_field: bool,
    /// Expert width F and hidden size H.
    pub width: usize,
    pub hidden: usize,
}

/// For each of `slots` slots s, the matvec of expert `ids[s]`: `GateUp` writes
/// `y[s·F .. (s+1)·F]` from x[H] (the same for every slot; RMSNorm `norm` fused when non-zero);
/// `Down` writes `y[s·H ..]` from `x[s·F ..]`.
#[allow(clippy::too_many_arguments)]
pub fn launch_expert_matvec(
    dev: &Dev,
    mk: &MoeKernels,
    set: &ExpertSet,
    part: ExpertPart,
    ids: u64,
    slots: usize,
    x: u64,
    norm: u64,
    eps: f32,
    y: u64,
    pdl: bool,
) -> DResult<()> {
    let (f, h) = (set.width, set.hidden);
    let (codec, rows, k, x_stride, y_stride, jobs, nseg) = match part {
        ExpertPart::GateUp => (set.gate_up_codec, f, h, 0, f, f, 2),
        ExpertPart::Down => (set.down_codec, h, f, f, h, h.div_ceil(2), 1),
    };
    let a = MoeMvArgsC {
        table: set.table,
        ids,
        e: set.experts as i32,
        first: part as i32,
        rows: rows as i32,
        k: k as i32,
        x,
        x_stride: x_stride as i64,
        norm,
        eps,
        _pad: 0,
        y,
        y_stride: y_stride as i64,
    };
    let nq = if codec == DevCodec::Q8 && set.col_field {
        nseg
    } else {
        1
    };
    // About `blocks_per_sm` resident blocks per SM over all slots together (the slots' blocks
    // run side by side), no more than a slot's jobs fill.
    let warps = 8;
    let budget = MatvecConfig::DEFAULT.blocks_per_sm * dev.sm_count as usize;
    let blocks = jobs
        .div_ceil(warps)
        .min(budget.div_ceil(slots.max(1)))
        .max(1);
    // SAFETY: MoeMvArgsC is repr(C) plain data mirroring `struct MoeMvArgs` in moe.cu.
    let bytes = unsafe {
        std::slice::from_raw_parts(
            &a as *const MoeMvArgsC as *const u8,
            std::mem::size_of::<MoeMvArgsC>(),
        )
    };
    dev.launch_ex(
        &mk.mv[codec as usize],
        (blocks as u32, slots as u32, 1),
        (256, 1, 1),
        matvec::smem_bytes(codec, k, nq) as u32,
        &[Arg::Bytes(bytes.to_vec())],
        pdl,
    )
}

/// Uploads the table of the experts' plane pointers (`struct MoeExpert` in moe.cu: gate, up,
/// down planes, then their scales, then their column fields; 0 where a codec has none).
pub fn expert_table(dev: &Dev, experts: &[DevMlp]) -> DResult<DBuf> {
    let mut t: Vec<u64> = Vec::with_capacity(9 * experts.len());
    for e in experts {
        let m = [&e.gate, &e.up, &e.down];
        t.extend(m.iter().map(|w| w.w()));
        t.extend(m.iter().map(|w| w.rs()));
        t.extend(m.iter().map(|w| w.colp()));
    }
    dev.upload_new(bytes_of(&t))
}

/// A SwiGLU MLP resident on the device.
pub struct DevMlp {
    pub gate: DevWeight,
    pub up: DevWeight,
    pub down: DevWeight,
}

impl DevMlp {
    pub fn upload(dev: &Dev, m: &Mlp) -> DResult<DevMlp> {
        Ok(DevMlp {
            gate: DevWeight::upload(dev, &m.gate)?,
            up: DevWeight::upload(dev, &m.up)?,
            down: DevWeight::upload(dev, &m.down)?,
        })
    }

    pub fn weights(&self) -> [&DevWeight; 3] {
        [&self.gate, &self.up, &self.down]
    }
}

/// A layer's feed-forward block on the device.
// One per layer: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
pub enum DevFfn {
    Dense(DevMlp),
    Moe(DevMoe),
}

impl DevFfn {
    pub fn upload(dev: &Dev, ffn: &crate::llm::Ffn) -> DResult<DevFfn> {
        Ok(match ffn {
            crate::llm::Ffn::Dense(m) => DevFfn::Dense(DevMlp::upload(dev, m)?),
            crate::llm::Ffn::Moe(m) => DevFfn::Moe(DevMoe::upload(dev, m)?),
        })
    }

    /// Every weight of the block.
    pub fn weights(&self) -> Vec<&DevWeight> {
        match self {
            DevFfn::Dense(m) => m.weights().to_vec(),
            DevFfn::Moe(m) => {
                let mut v = vec![&m.router];
                v.extend(m.experts.iter().flat_map(|e| e.weights()));
                v.extend(m.shared.iter().flat_map(|e| e.weights()));
                v.extend(m.shared_gate.iter());
                v
            }
        }
    }
}

/// A mixture-of-experts block on the device.
pub struct DevMoe {
    /// [E, H]
    pub router: DevWeight,
    pub experts: Vec<DevMlp>,
    /// `MoeExpert` [E] (moe.cu).
    pub table: DBuf,
    pub top_k: usize,
    pub norm_topk_prob: bool,
    pub shared: Option<DevMlp>,
    /// [1, H]
    pub shared_gate: Option<DevWeight>,
}

impl DevMoe {
    fn upload(dev: &Dev, m: &MoeWeights) -> DResult<DevMoe> {
        let experts = m
            .experts
            .iter()
            .map(|e| DevMlp::upload(dev, e))
            .collect::<DResult<Vec<_>>>()?;
        let table = expert_table(dev, &experts)?;
        Ok(DevMoe {
            router: DevWeight::upload(dev, &m.router)?,
            table,
            experts,
            top_k: m.top_k,
            norm_topk_prob: m.norm_topk_prob,
            shared: m
                .shared
                .as_ref()
                .map(|s| DevMlp::upload(dev, &s.mlp))
                .transpose()?,
            shared_gate: m
                .shared
                .as_ref()
                .and_then(|s| s.gate.as_ref())
                .map(|g| DevWeight::upload(dev, g))
                .transpose()?,
        })
    }

    pub fn experts(&self) -> ExpertSet {
        let e0 = &self.experts[0];
        ExpertSet {
            table: self.table.ptr(),
            experts: self.experts.len(),
            gate_up_codec: e0.gate.codec,
            down_codec: e0.down.codec,
            col_field: self
                .experts
                .iter()
                .any(|e| e.gate.col.is_some() || e.up.col.is_some() || e.down.col.is_some()),
            width: e0.gate.rows,
            hidden: e0.gate.cols,
        }
    }

    fn width(&self) -> usize {
        self.experts[0].gate.rows
    }
}

/// Checks a MoE block can run on the device: softmax routing, at most [`MOE_MAX_K`] experts a
/// token, every expert's gate and up in one codec and every down in one (the indexed matvec is
/// compiled per codec), the shared expert's gate and up in one codec.
pub(super) fn check(m: &MoeWeights, l: usize) -> Result<(), Refusal> {
    // Expert widths need not be multiples of 32 in float codecs (Qwen2-MoE's shared expert).
    use crate::cuda::runtime::weights::check_narrow as codec;
    let shape = |what: String| {
        Err(Refusal::new(
            "llm.load",
            RefusalReason::UnsupportedShape(format!("layer {l}: {what}")),
        ))
    };
    if let Routing::SigmoidGroup { .. } = m.routing {
        return shape("sigmoid group routing (noaux_tc) has no device kernel".into());
    }
    if m.top_k > MOE_MAX_K {
        return shape(format!(
            "{} experts a token (the device takes at most {MOE_MAX_K})",
            m.top_k
        ));
    }
    codec(&m.router, &format!("layer {l} router"))?;
    let mut first: Option<(DevCodec, DevCodec)> = None;
    for (x, e) in m.experts.iter().enumerate() {
        let n = |t: &str| format!("layer {l} expert {x} {t}");
        let (g, u, d) = (
            codec(&e.gate, &n("gate"))?,
            codec(&e.up, &n("up"))?,
            codec(&e.down, &n("down"))?,
        );
        if g != u || first.is_some_and(|f| f != (g, d)) {
            return shape(format!(
                "expert {x}'s gate/up/down codecs differ from the others' ({:?}/{:?}/{:?})",
                e.gate.dtype, e.up.dtype, e.down.dtype
            ));
        }
        first = Some((g, d));
    }
    if let Some(sh) = &m.shared {
        let n = |t: &str| format!("layer {l} shared_expert {t}");
        let (g, u) = (
            codec(&sh.mlp.gate, &n("gate"))?,
            codec(&sh.mlp.up, &n("up"))?,
        );
        codec(&sh.mlp.down, &n("down"))?;
        if g != u {
            return shape("shared expert gate/up in different codecs".into());
        }
        if let Some(gw) = &sh.gate {
            codec(gw, &n("gate vector"))?;
        }
    }
    Ok(())
}

/// Decode activations of the MoE layers (allocated at load: the graph bakes their addresses).
pub struct MoeDecodeWs {
    /// [E + 1] router logits, then the shared-expert gate's logit.
    pub logits: DBuf,
    /// i32 [k], f32 [k]: the chosen experts and their weights.
    pub ids: DBuf,
    pub weights: DBuf,
    /// [k·F + F_shared] SwiGLU outputs.
    pub act: DBuf,
    /// [(k + 1)·H] expert outputs (slot k: the shared expert's).
    pub y: DBuf,
}

/// The largest MoE geometry over the layers: (E, k, k·F + F_shared, H).
fn geometry<'a>(blocks: impl Iterator<Item = &'a MoeWeights<'a>>, h: usize) -> [usize; 4] {
    let mut g = [0, 0, 0, h];
    for m in blocks {
        let f = m.experts.first().map_or(0, |e| e.width());
        let fs = m.shared.as_ref().map_or(0, |s| s.mlp.width());
        g[0] = g[0].max(m.experts.len());
        g[1] = g[1].max(m.top_k);
        g[2] = g[2].max(m.top_k * f + fs);
    }
    g
}

impl MoeDecodeWs {
    fn sizes(g: [usize; 4]) -> [usize; 5] {
        let [e, k, act, h] = g;
        [4 * (e + 1), 4 * k, 4 * k, 4 * act, 4 * (k + 1) * h]
    }

    /// Bytes for the MoE blocks of a model (0 without any).
    pub fn bytes<'a>(blocks: impl Iterator<Item = &'a MoeWeights<'a>>, h: usize) -> u64 {
        let g = geometry(blocks, h);
        if g[0] == 0 {
            return 0;
        }
        Self::sizes(g).iter().sum::<usize>() as u64
    }

    pub fn new<'a>(
        dev: &Dev,
        blocks: impl Iterator<Item = &'a MoeWeights<'a>>,
        h: usize,
    ) -> DResult<Option<MoeDecodeWs>> {
        let g = geometry(blocks, h);
        if g[0] == 0 {
            return Ok(None);
        }
        let z = Self::sizes(g);
        Ok(Some(MoeDecodeWs {
            logits: dev.alloc_zeroed(z[0])?,
            ids: dev.alloc_zeroed(z[1])?,
            weights: dev.alloc_zeroed(z[2])?,
            act: dev.alloc_zeroed(z[3])?,
            y: dev.alloc_zeroed(z[4])?,
        }))
    }
}

/// Prefill activations of the MoE layers, for `cap` tokens (allocated on the first prefill).
pub struct MoePrefillWs {
    /// [cap, E] router logits; [cap] shared-expert gate logits.
    pub logits: DBuf,
    pub shared_logits: DBuf,
    /// i32 [cap·k], f32 [cap·k]: each row's experts and weights.
    pub ids: DBuf,
    pub weights: DBuf,
    /// i32 [cap·k] rows ordered by expert, and f32 [cap·k] their weights.
    pub rows: DBuf,
    pub row_weights: DBuf,
    /// [cap, H] one expert's gathered rows (f32 and bf16) and its output.
    pub x: DBuf,
    pub xb: DBuf,
    pub y: DBuf,
}

impl MoePrefillWs {
    /// Sizes for `cap` tokens, or None without MoE layers.
    pub fn sizes<'a>(
        blocks: impl Iterator<Item = &'a MoeWeights<'a>>,
        h: usize,
        cap: usize,
    ) -> Option<[usize; 9]> {
        let [e, k, _, h] = geometry(blocks, h);
        (e > 0).then(|| {
            [
                4 * cap * e,
                4 * cap,
                4 * cap * k,
                4 * cap * k,
                4 * cap * k,
                4 * cap * k,
                4 * cap * h,
                2 * cap * h,
                4 * cap * h,
            ]
        })
    }

    pub fn new(dev: &Dev, z: [usize; 9]) -> DResult<MoePrefillWs> {
        Ok(MoePrefillWs {
            logits: dev.alloc(z[0])?,
            shared_logits: dev.alloc(z[1])?,
            ids: dev.alloc(z[2])?,
            weights: dev.alloc(z[3])?,
            rows: dev.alloc(z[4])?,
            row_weights: dev.alloc(z[5])?,
            x: dev.alloc(z[6])?,
            xb: dev.alloc(z[7])?,
            y: dev.alloc(z[8])?,
        })
    }
}

/// A chunk's rows grouped by expert, for the per-expert GEMMs.
#[derive(Debug, Default, PartialEq)]
pub struct GroupedRows {
    /// Row indices (positions in the chunk), expert after expert, ascending within one.
    pub rows: Vec<i32>,
    /// Each entry's routing weight.
    pub weights: Vec<f32>,
    /// (expert, offset, count) into `rows` for each expert with rows, by expert id.
    pub groups: Vec<(usize, usize, usize)>,
}

/// Groups the routing of a chunk (`ids` / `weights` [T, k] row-major) by expert; a row picks an
/// expert at most once, so one expert's rows are distinct.
pub fn group_by_expert(ids: &[i32], weights: &[f32], k: usize, experts: usize) -> GroupedRows {
    let mut per: Vec<Vec<(i32, f32)>> = vec![Vec::new(); experts];
    for (i, (&x, &w)) in ids.iter().zip(weights).enumerate() {
        let x = (x.max(0) as usize).min(experts - 1);
        per[x].push(((i / k) as i32, w));
    }
    let mut g = GroupedRows::default();
    for (x, rows) in per.into_iter().enumerate() {
        if rows.is_empty() {
            continue;
        }
        g.groups.push((x, g.rows.len(), rows.len()));
        for (r, w) in rows {
            g.rows.push(r);
            g.weights.push(w);
        }
    }
    g
}

impl CudaLlm {
    fn moe_kernels(&self) -> &MoeKernels {
        self.moe
            .as_ref()
            .expect("MoE kernels loaded with MoE layers")
    }

    fn moe_decode_ws(&self) -> &MoeDecodeWs {
        self.moe_ws
            .as_ref()
            .expect("MoE decode buffers allocated with MoE layers")
    }

    /// Decode stage 3 of a MoE layer over the hidden row at `h` (the decode graph's, or one row
    /// of a batched step): router (RMSNorm fused; the shared-expert gate's logit beside it),
    /// routing, the chosen experts' gate|up with SwiGLU (and the shared expert's).
    pub(super) fn moe_decode_up(&self, h: u64, norm: u64, m: &DevMoe) -> DResult<()> {
        let (dev, ck, mw, mk) = (
            &*self.dev,
            &*self.ck,
            self.moe_decode_ws(),
            self.moe_kernels(),
        );
        let (e, k, f) = (m.experts.len(), m.top_k, m.width());
        let mv = |w: &[MvSeg], x: u64, norm: u64, y: u64, mode: MvMode| {
            matvec::launch(dev, &ck.matvec, w, x, norm, self.eps(), y, mode, true)
        };
        mv(
            &[MvSeg {
                w: &m.router,
                bias: 0,
            }],
            h,
            norm,
            mw.logits.ptr(),
            MvMode::Store,
        )?;
        if let Some(g) = &m.shared_gate {
            mv(
                &[MvSeg { w: g, bias: 0 }],
                h,
                norm,
                mw.logits.at(4 * e),
                MvMode::Store,
            )?;
        }
        launch_route(
            dev,
            mk,
            mw.logits.ptr(),
            e,
            e,
            k,
            1,
            m.norm_topk_prob,
            mw.ids.ptr(),
            mw.weights.ptr(),
            true,
        )?;
        launch_expert_matvec(
            dev,
            mk,
            &m.experts(),
            ExpertPart::GateUp,
            mw.ids.ptr(),
            k,
            h,
            norm,
            self.eps(),
            mw.act.ptr(),
            true,
        )?;
        if let Some(sh) = &m.shared {
            mv(
                &[
                    MvSeg {
                        w: &sh.gate,
                        bias: 0,
                    },
                    MvSeg { w: &sh.up, bias: 0 },
                ],
                h,
                norm,
                mw.act.at(4 * k * f),
                MvMode::SwiGlu,
            )?;
        }
        Ok(())
    }

    /// Decode stage 4 of a MoE layer: the chosen experts' down (and the shared expert's), then
    /// their weighted sum added to the hidden row at `h`.
    pub(super) fn moe_decode_down(&self, h: u64, m: &DevMoe) -> DResult<()> {
        let (dev, ck, mw, mk) = (
            &*self.dev,
            &*self.ck,
            self.moe_decode_ws(),
            self.moe_kernels(),
        );
        let (e, k, f, hd) = (m.experts.len(), m.top_k, m.width(), self.spec.hidden);
        launch_expert_matvec(
            dev,
            mk,
            &m.experts(),
            ExpertPart::Down,
            mw.ids.ptr(),
            k,
            mw.act.ptr(),
            0,
            self.eps(),
            mw.y.ptr(),
            true,
        )?;
        let y_shared = match &m.shared {
            Some(sh) => {
                let y = mw.y.at(4 * k * hd);
                matvec::launch(
                    dev,
                    &ck.matvec,
                    &[MvSeg {
                        w: &sh.down,
                        bias: 0,
                    }],
                    mw.act.at(4 * k * f),
                    0,
                    self.eps(),
                    y,
                    MvMode::Store,
                    true,
                )?;
                y
            }
            None => 0,
        };
        let gate = if m.shared_gate.is_some() {
            mw.logits.at(4 * e)
        } else {
            0
        };
        dev.launch_ex(
            &mk.combine,
            grid1(hd, 256),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(h),
                Arg::Ptr(mw.y.ptr()),
                Arg::Ptr(mw.weights.ptr()),
                Arg::I32(k as i32),
                Arg::Ptr(y_shared),
                Arg::Ptr(gate),
                Arg::I32(hd as i32),
            ],
            true,
        )
    }

    /// Prefill of a MoE block over pf.h[t, H] (its stages 5–7 in one): RMSNorm, router logits
    /// in f32 (routing decides on them), routing on the device, one readback of the ids, then
    /// the shared expert over every row and each routed expert over its rows, each added to
    /// the residual stream with its weight.
    pub(super) fn moe_prefill(&self, norm: u64, l: usize, t: usize) -> DResult<()> {
        let s = &self.spec;
        let hd = s.hidden;
        let pf = self.pf.as_ref().expect("prefill workspace");
        let mp = self.moe_pf.as_ref().expect("ensured");
        let dev = &*self.dev;
        let super::DevFfn::Moe(m) = &self.layer(l).ffn else {
            unreachable!("moe_prefill on a MoE layer")
        };
        let (e, k) = (m.experts.len(), m.top_k);
        self.rmsnorm_rows(pf.h.ptr(), norm, t, hd, pf.xn.ptr())?;
        self.to_bf16(pf.xn.ptr(), t * hd, pf.xb.ptr())?;
        self.gemm_as(
            &m.router,
            pf.xn.ptr(),
            pf.xb.ptr(),
            t,
            mp.logits.ptr(),
            e,
            0,
            false,
            false,
        )?;
        if let Some(g) = &m.shared_gate {
            self.gemm_as(
                g,
                pf.xn.ptr(),
                pf.xb.ptr(),
                t,
                mp.shared_logits.ptr(),
                1,
                0,
                false,
                false,
            )?;
        }
        launch_route(
            dev,
            self.moe_kernels(),
            mp.logits.ptr(),
            e,
            e,
            k,
            t,
            m.norm_topk_prob,
            mp.ids.ptr(),
            mp.weights.ptr(),
            false,
        )?;
        let mut ids = vec![0i32; t * k];
        let mut wts = vec![0f32; t * k];
        // SAFETY: i32 has no invalid bit patterns; the byte view covers exactly `ids`.
        let id_bytes =
            unsafe { std::slice::from_raw_parts_mut(ids.as_mut_ptr() as *mut u8, 4 * ids.len()) };
        dev.download(id_bytes, mp.ids.ptr())?;
        dev.download_f32(&mut wts, mp.weights.ptr())?;
        let g = group_by_expert(&ids, &wts, k, e);
        dev.upload(mp.rows.ptr(), bytes_of(&g.rows))?;
        dev.upload(mp.row_weights.ptr(), bytes_of(&g.weights))?;

        // The shared expert first: its GEMMs read pf.xb, which the SwiGLU then overwrites.
        if let Some(sh) = &m.shared {
            self.mlp_rows(sh, pf.xn.ptr(), pf.xb.ptr(), t, mp.y.ptr())?;
            let gate = if m.shared_gate.is_some() {
                mp.shared_logits.ptr()
            } else {
                0
            };
            self.scatter_add(mp.y.ptr(), 0, 0, gate, t)?;
        }
        for &(x, off, n) in &g.groups {
            let rows = mp.rows.at(4 * off);
            dev.launch(
                &self.moe_kernels().gather,
                (n as u32, 1, 1),
                (256, 1, 1),
                0,
                &[
                    Arg::Ptr(pf.xn.ptr()),
                    Arg::Ptr(rows),
                    Arg::I32(hd as i32),
                    Arg::Ptr(mp.x.ptr()),
                    Arg::Ptr(mp.xb.ptr()),
                ],
            )?;
            self.mlp_rows(&m.experts[x], mp.x.ptr(), mp.xb.ptr(), n, mp.y.ptr())?;
            self.scatter_add(mp.y.ptr(), rows, mp.row_weights.at(4 * off), 0, n)?;
        }
        Ok(())
    }

    /// y[t, H] = the SwiGLU MLP `m` of x[t, H] (given in f32 and bf16), through pf.gu and the
    /// activation buffers.
    fn mlp_rows(&self, m: &DevMlp, x: u64, xb: u64, t: usize, y: u64) -> DResult<()> {
        let pf = self.pf.as_ref().expect("prefill workspace");
        let f = m.gate.rows;
        self.gemm(&m.gate, x, xb, t, pf.gu.ptr(), 2 * f, 0, false)?;
        self.gemm(&m.up, x, xb, t, pf.gu.ptr(), 2 * f, f, false)?;
        self.swiglu(t, f, &m.down)?;
        self.gemm(
            &m.down,
            pf.act_f.ptr(),
            pf.xb.ptr(),
            t,
            y,
            self.spec.hidden,
            0,
            false,
        )
    }

    /// pf.h[rows[j]] += c_j · y[j] for j < n (`moe_scatter_add`).
    fn scatter_add(&self, y: u64, rows: u64, w: u64, gate: u64, n: usize) -> DResult<()> {
        let pf = self.pf.as_ref().expect("prefill workspace");
        self.dev.launch(
            &self.moe_kernels().scatter_add,
            (n as u32, 1, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(pf.h.ptr()),
                Arg::Ptr(y),
                Arg::Ptr(rows),
                Arg::Ptr(w),
                Arg::Ptr(gate),
                Arg::I32(self.spec.hidden as i32),
            ],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_layout_matches_the_kernel() {
        // struct MoeMvArgs in moe.cu: two pointers, four ints, pointer, i64, pointer, float
        // (+pad), pointer, i64.
        assert_eq!(std::mem::size_of::<MoeMvArgsC>(), 80);
        assert_eq!(std::mem::offset_of!(MoeMvArgsC, x), 32);
        assert_eq!(std::mem::offset_of!(MoeMvArgsC, eps), 56);
        assert_eq!(std::mem::offset_of!(MoeMvArgsC, y_stride), 72);
    }

    #[test]
    fn rows_are_grouped_by_expert_in_row_order() {
        // Three rows, k = 2: row 0 → (2, 1), row 1 → (1, 2), row 2 → (0, 2).
        let ids = [2, 1, 1, 2, 0, 2];
        let w = [0.6, 0.4, 0.7, 0.3, 0.9, 0.1];
        let g = group_by_expert(&ids, &w, 2, 4);
        assert_eq!(g.groups, vec![(0, 0, 1), (1, 1, 2), (2, 3, 3)]);
        assert_eq!(g.rows, vec![2, 0, 1, 0, 1, 2]);
        assert_eq!(g.weights, vec![0.9, 0.4, 0.7, 0.6, 0.3, 0.1]);
    }
}
