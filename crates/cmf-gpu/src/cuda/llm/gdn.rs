//! Qwen3-Next's hybrid layers on the device (kernels/gdn.cu): GatedDeltaNet mixers with their
//! recurrent state (conv ring and delta state) resident, and the output gate of the attention
//! layers. `(1 + w)` norms need no kernel of their own: their weights are uploaded as `1 + w`.
//!
//! Decode (inside the whole-token graph), a GatedDeltaNet layer replaces the attention stages:
//! matvec(qkvz, RMSNorm fused) → matvec(ba, RMSNorm fused) → gdn_prep (split, conv ring, SiLU,
//! gates) → gdn_delta (l2 norms, delta rule on the resident state, gated norm) → matvec(out,
//! += residual). An output-gated attention layer runs matvec(q|gate) → matvec(k|v) → gate_split
//! → the usual decode attention → gate_mul → matvec(o).
//!
//! Prefill runs the same kernels over a chunk's rows (GEMMs for the projections); gdn_delta walks
//! the rows in order inside one launch per layer, so the state after a prefill is the state
//! after decoding the same tokens one by one.
//!
//! A recurrent state cannot be rewound: the device tracks how many tokens it folded in, restarts
//! at position 0, and refuses to go on from any other position (the caller falls back).

use super::{CudaLlm, DevLayer};
use crate::cuda::runtime::device::{grid1, Arg, DBuf, DResult, Dev};
use crate::cuda::runtime::kernels::{Func, Job, Module};
use crate::cuda::runtime::matvec::{self, MvMode, MvSeg};
use crate::cuda::runtime::weights::{self, DevCodec, DevWeight};
use crate::facade::refusal::{Refusal, RefusalReason};
use crate::llm::{GdnGeometry, GdnWeights, LlmModel, LlmSpec, NormStyle};
use std::borrow::Cow;

/// The module's source.
pub const GDN: &str = include_str!("kernels/gdn.cu");

/// Most conv taps the kernel keeps in registers (`GDN_MAX_W` in gdn.cu).
pub const GDN_MAX_W: usize = 8;

/// State rows one gdn_delta thread keeps in registers (`GDN_ROWS` in gdn.cu).
const GDN_ROWS: usize = 32;

/// Most threads of a gdn_delta block (its `__launch_bounds__`).
const GDN_DELTA_THREADS: usize = 512;

/// The hybrid layers' kernels, loaded when a model has any.
pub struct GdnKernels {
    prep: Func,
    delta: Func,
    gate_split: Func,
    gate_mul: Func,
    _module: Module,
}

impl GdnKernels {
    pub fn job(dev: &Dev) -> Job {
        Job::new("gdn", GDN, &[], &dev.arch())
    }

    pub fn load(dev: &Dev) -> DResult<GdnKernels> {
        let m = Module::load_all(dev, &[Self::job(dev)])?
            .pop()
            .expect("one job");
        Ok(GdnKernels {
            prep: m.func("gdn_prep")?,
            delta: m.func("gdn_delta")?,
            gate_split: m.func("gate_split")?,
            gate_mul: m.func("gate_mul")?,
            _module: m,
        })
    }
}

/// Whether `model` has any part these kernels run (GatedDeltaNet layers or output gates).
pub fn is_hybrid(model: &LlmModel) -> bool {
    model.is_recurrent()
        || model
            .layers
            .iter()
            .any(|l| l.attention().is_some_and(|a| a.output_gate))
}

/// Refuses geometries the kernels do not take, naming the layer.
pub fn check(model: &LlmModel) -> Result<(), Refusal> {
    let shape = |m: String| Refusal::new("llm.load", RefusalReason::UnsupportedShape(m));
    for (l, w) in model.layers.iter().enumerate() {
        let Some(g) = w.gated_delta() else { continue };
        let geo = &g.geometry;
        if geo.conv_kernel == 0 || geo.conv_kernel > GDN_MAX_W {
            return Err(shape(format!(
                "layer {l}: a conv of {} taps (the kernel takes 1 to {GDN_MAX_W})",
                geo.conv_kernel
            )));
        }
        let (x, y) = delta_block(geo);
        if (x * y) as usize > GDN_DELTA_THREADS || delta_smem(geo) > 48 * 1024 {
            return Err(shape(format!(
                "layer {l}: GatedDeltaNet heads of dk {} / dv {} (the recurrence takes \
                 ⌈dv / 32⌉·32 · ⌈dk / {GDN_ROWS}⌉ ≤ {GDN_DELTA_THREADS} threads a head)",
                geo.k_head_dim, geo.v_head_dim
            )));
        }
        for (name, m) in [
            ("in_proj_qkvz", g.qkvz),
            ("in_proj_ba", g.ba),
            ("out_proj", g.out),
        ] {
            weights::check(&m, &format!("layer {l} {name}"))?;
        }
    }
    Ok(())
}

/// Dynamic shared memory of gdn_delta: q and k of one key head, the reduction scratch and the
/// row groups' partial sums.
fn delta_smem(geo: &GdnGeometry) -> usize {
    let (x, y) = delta_block(geo);
    4 * (2 * geo.k_head_dim + 32 + (x * y) as usize)
}

/// gdn_delta's block: the value head's columns rounded up to whole warps, times the row groups
/// that hold its state rows in registers.
fn delta_block(geo: &GdnGeometry) -> (u32, u32) {
    (
        (geo.v_head_dim.div_ceil(32) * 32) as u32,
        geo.k_head_dim.div_ceil(GDN_ROWS).max(1) as u32,
    )
}

/// A norm weight as the device applies it (`x̂·w` everywhere): `1 + w` for zero-centred norms.
pub fn norm_weight<'a>(spec: &LlmSpec, w: &'a [f32]) -> Cow<'a, [f32]> {
    match spec.norm_style {
        NormStyle::Plain => Cow::Borrowed(w),
        NormStyle::OnePlus => Cow::Owned(w.iter().map(|v| 1.0 + v).collect()),
    }
}

/// Bytes of one GatedDeltaNet layer's recurrent state (f32 conv ring and delta state).
pub fn state_bytes(g: &GdnWeights) -> u64 {
    let (conv, delta) = g.geometry.state_floats();
    4 * (conv + delta) as u64
}

/// Bytes of a GatedDeltaNet layer's f32 vectors on the device (conv taps, gates, norm).
pub fn vector_bytes(g: &GdnWeights) -> u64 {
    4 * (g.conv.len() + g.a_log.len() + g.dt_bias.len() + g.norm.len()) as u64
}

/// A GatedDeltaNet layer on the device: its weights and its recurrent state.
pub struct DevGdn {
    pub geo: GdnGeometry,
    pub qkvz: DevWeight,
    pub ba: DevWeight,
    pub out: DevWeight,
    conv: DBuf,
    a_log: DBuf,
    dt_bias: DBuf,
    norm: DBuf,
    /// `[C, W − 1]` newest inputs, oldest first.
    ring: DBuf,
    /// `[v_heads, dk, dv]`.
    state: DBuf,
}

impl DevGdn {
    pub fn upload(dev: &Dev, g: &GdnWeights) -> DResult<DevGdn> {
        let up = |v: &[f32]| dev.upload_new(crate::cuda::runtime::device::bytes_of(v));
        let (conv, delta) = g.geometry.state_floats();
        Ok(DevGdn {
            geo: g.geometry,
            qkvz: DevWeight::upload(dev, &g.qkvz)?,
            ba: DevWeight::upload(dev, &g.ba)?,
            out: DevWeight::upload(dev, &g.out)?,
            conv: up(g.conv)?,
            a_log: up(g.a_log)?,
            dt_bias: up(g.dt_bias)?,
            norm: up(g.norm)?,
            ring: dev.alloc_zeroed(4 * conv)?,
            state: dev.alloc_zeroed(4 * delta)?,
        })
    }

    /// The state before any token.
    fn reset(&self, dev: &Dev) -> DResult<()> {
        dev.memset0(self.ring.ptr(), self.ring.len())?;
        dev.memset0(self.state.ptr(), self.state.len())
    }

    pub fn weights(&self) -> [&DevWeight; 3] {
        [&self.qkvz, &self.ba, &self.out]
    }

    /// Device pointers of the conv ring `[C, W − 1]` and the delta state `[NV, dk, dv]`.
    pub fn state(&self) -> (u64, u64) {
        (self.ring.ptr(), self.state.ptr())
    }
}

/// gdn_prep then gdn_delta over `t` rows of `hw`'s projection inputs for layer `g`, into
/// `hw`'s core rows, advancing `g`'s state; `pdl` inside the decode chain.
pub fn launch_mix(
    dev: &Dev,
    k: &GdnKernels,
    g: &DevGdn,
    t: usize,
    hw: &GdnWs,
    eps: f32,
    pdl: bool,
) -> DResult<()> {
    let geo = &g.geo;
    let dims = [
        Arg::I32(geo.num_k_heads as i32),
        Arg::I32(geo.num_v_heads as i32),
        Arg::I32(geo.k_head_dim as i32),
        Arg::I32(geo.v_head_dim as i32),
    ];
    let lanes = geo.conv_dim().max(geo.value_dim()).max(geo.num_v_heads);
    let mut args = vec![
        Arg::Ptr(hw.qkvz.ptr()),
        Arg::I32(geo.qkvz_dim() as i32),
        Arg::Ptr(hw.ba.ptr()),
        Arg::I32(2 * geo.num_v_heads as i32),
        Arg::I32(t as i32),
        Arg::Ptr(g.conv.ptr()),
        Arg::Ptr(g.ring.ptr()),
        Arg::Ptr(g.a_log.ptr()),
        Arg::Ptr(g.dt_bias.ptr()),
    ];
    args.extend(dims.iter().cloned());
    args.extend([
        Arg::I32(geo.conv_kernel as i32),
        Arg::Ptr(hw.mixed.ptr()),
        Arg::Ptr(hw.z.ptr()),
        Arg::Ptr(hw.beta.ptr()),
        Arg::Ptr(hw.decay.ptr()),
    ]);
    dev.launch_ex(&k.prep, grid1(lanes, 256), (256, 1, 1), 0, &args, pdl)?;
    let mut args = vec![
        Arg::Ptr(hw.mixed.ptr()),
        Arg::Ptr(hw.beta.ptr()),
        Arg::Ptr(hw.decay.ptr()),
        Arg::Ptr(hw.z.ptr()),
        Arg::Ptr(g.state.ptr()),
        Arg::Ptr(g.norm.ptr()),
        Arg::F32(eps),
        Arg::I32(t as i32),
    ];
    args.extend(dims);
    args.push(Arg::Ptr(hw.core.ptr()));
    dev.launch_ex(
        &k.delta,
        (geo.num_v_heads as u32, 1, 1),
        {
            let (x, y) = delta_block(geo);
            (x, y, 1)
        },
        delta_smem(geo) as u32,
        &args,
        pdl,
    )
}

/// The attention weights a GatedDeltaNet layer does not have: zero-row stand-ins, so that
/// [`DevLayer`] keeps one shape (nothing reads them: the decode and prefill stages branch on
/// the layer's `gdn`, and the batched step refuses recurrent models).
pub fn no_weight(dev: &Dev) -> DResult<DevWeight> {
    Ok(DevWeight {
        codec: DevCodec::F32,
        dtype: cmf_format::Dtype::F32,
        rows: 0,
        cols: 0,
        main: dev.alloc(0)?,
        scales: None,
        col: None,
    })
}

/// Scratch of the hybrid layers for up to `rows` rows at once, sized for the widest layer.
pub struct GdnWs {
    qkvz: DBuf,
    ba: DBuf,
    mixed: DBuf,
    z: DBuf,
    beta: DBuf,
    decay: DBuf,
    core: DBuf,
    /// bf16 copy of `core` (the out GEMM's input in prefill).
    core_bf16: DBuf,
    /// Output-gated attention: the q|gate projection and the gates.
    qg: DBuf,
    gate: DBuf,
}

impl GdnWs {
    fn sizes(model: &LlmModel, rows: usize) -> [usize; 10] {
        let geos: Vec<GdnGeometry> = model
            .layers
            .iter()
            .filter_map(|l| l.gated_delta().map(|g| g.geometry))
            .collect();
        let gated = model
            .layers
            .iter()
            .any(|l| l.attention().is_some_and(|a| a.output_gate));
        Self::sizes_of(&geos, if gated { model.spec.q_dim() } else { 0 }, rows)
    }

    /// Sizes for layers of geometries `geos` and output gates of `q` query values (0: none).
    fn sizes_of(geos: &[GdnGeometry], q: usize, rows: usize) -> [usize; 10] {
        let max = |f: &dyn Fn(&GdnGeometry) -> usize| geos.iter().map(f).max().unwrap_or(0);
        let n = rows;
        [
            4 * n * max(&|g| g.qkvz_dim()),
            4 * n * max(&|g| 2 * g.num_v_heads),
            4 * n * max(&|g| g.conv_dim()),
            4 * n * max(&|g| g.value_dim()),
            4 * n * max(&|g| g.num_v_heads),
            4 * n * max(&|g| g.num_v_heads),
            4 * n * max(&|g| g.value_dim()),
            2 * n * max(&|g| g.value_dim()),
            4 * n * 2 * q,
            4 * n * q,
        ]
    }

    pub fn bytes(model: &LlmModel, rows: usize) -> u64 {
        if !is_hybrid(model) {
            return 0;
        }
        Self::sizes(model, rows).iter().sum::<usize>() as u64
    }

    /// Scratch for `rows` rows of one GatedDeltaNet layer (kernel tests drive it directly).
    pub fn for_layer(dev: &Dev, geo: &GdnGeometry, rows: usize) -> DResult<GdnWs> {
        Self::new(dev, Self::sizes_of(std::slice::from_ref(geo), 0, rows))
    }

    /// Device pointers of the projection inputs: qkvz `[rows, 2·Kd + 2·Vd]`, ba `[rows, 2·NV]`.
    pub fn inputs(&self) -> (u64, u64) {
        (self.qkvz.ptr(), self.ba.ptr())
    }

    /// Device pointer of the mixer output `[rows, Vd]` (before out_proj).
    pub fn core(&self) -> u64 {
        self.core.ptr()
    }

    fn new(dev: &Dev, z: [usize; 10]) -> DResult<GdnWs> {
        Ok(GdnWs {
            qkvz: dev.alloc_zeroed(z[0])?,
            ba: dev.alloc_zeroed(z[1])?,
            mixed: dev.alloc_zeroed(z[2])?,
            z: dev.alloc_zeroed(z[3])?,
            beta: dev.alloc_zeroed(z[4])?,
            decay: dev.alloc_zeroed(z[5])?,
            core: dev.alloc_zeroed(z[6])?,
            core_bf16: dev.alloc_zeroed(z[7])?,
            qg: dev.alloc_zeroed(z[8])?,
            gate: dev.alloc_zeroed(z[9])?,
        })
    }
}

/// What a hybrid model keeps on the device beside the layers: kernels, scratch, and how far
/// the recurrent states have gone.
pub struct Hybrid {
    k: GdnKernels,
    dec: GdnWs,
    /// Prefill scratch, allocated on the first prefill.
    pf: Option<GdnWs>,
    pf_sizes: [usize; 10],
    /// Tokens folded into every recurrent state; None once a failed launch left them unknown.
    pos: Option<usize>,
}

impl Hybrid {
    pub fn load(dev: &Dev, model: &LlmModel, prefill_rows: usize) -> DResult<Hybrid> {
        Ok(Hybrid {
            k: GdnKernels::load(dev)?,
            dec: GdnWs::new(dev, GdnWs::sizes(model, 1))?,
            pf: None,
            pf_sizes: GdnWs::sizes(model, prefill_rows),
            pos: Some(0),
        })
    }
}

impl CudaLlm {
    /// Before a pass over positions `start..`: a recurrent model restarts its states at 0 and
    /// goes on only from where they are; a refusal leaves everything as it was.
    pub(super) fn hybrid_begin(&mut self, op: &'static str, start: usize) -> Result<(), Refusal> {
        let Some(h) = &mut self.hybrid else {
            return Ok(());
        };
        if start != 0 && h.pos != Some(start) {
            let at = h.pos.map_or("unknown".into(), |p| p.to_string());
            return Err(Refusal::new(
                op,
                RefusalReason::NotResident(format!(
                    "the recurrent state is at position {at}, not {start}, and cannot rewind"
                )),
            ));
        }
        // Unknown until the pass ends well.
        h.pos = None;
        if start == 0 {
            let dev = &self.dev;
            self.layers
                .iter()
                .flatten()
                .filter_map(|d| d.gdn.as_ref())
                .try_for_each(|g| g.reset(dev))
                .map_err(|e| e.refusal(op))?;
        }
        Ok(())
    }

    /// After a pass: the states hold `end` tokens when it succeeded, else are unknown.
    pub(super) fn hybrid_end(&mut self, end: Option<usize>) {
        if let Some(h) = &mut self.hybrid {
            h.pos = end;
        }
    }

    fn hybrid(&self) -> &Hybrid {
        self.hybrid.as_ref().expect("hybrid kernels loaded")
    }

    /// The decode stages of a GatedDeltaNet or output-gated attention layer (see
    /// `DECODE_STAGES`); None where the layer runs the plain stage.
    pub(super) fn hybrid_decode_stage(&self, l: usize, stage: usize) -> Option<DResult<()>> {
        let d = self.layer(l);
        if let Some(g) = &d.gdn {
            return Some(match stage {
                0 => self.gdn_in_proj_decode(d, g),
                1 => self.gdn_mix(g, 1, &self.hybrid().dec, true),
                2 => self.mv(
                    &g.out,
                    self.hybrid().dec.core.ptr(),
                    0,
                    self.ws.h.ptr(),
                    MvMode::Accumulate,
                ),
                _ => return None,
            });
        }
        if !d.gated {
            return None;
        }
        let (s, ws, hw) = (&self.spec, &self.ws, &self.hybrid().dec);
        Some(match stage {
            0 => (|| {
                self.mv(
                    &d.q,
                    ws.h.ptr(),
                    d.attn_norm.ptr(),
                    hw.qg.ptr(),
                    MvMode::Store,
                )?;
                let opt = |b: &Option<DBuf>| b.as_ref().map_or(0, |b| b.ptr());
                let kv = [
                    MvSeg {
                        w: &d.k,
                        bias: opt(&d.k_bias),
                    },
                    MvSeg {
                        w: &d.v,
                        bias: opt(&d.v_bias),
                    },
                ];
                let kv_out = ws.qkv.ptr() + 4 * s.q_dim() as u64;
                matvec::launch(
                    &self.dev,
                    &self.ck.matvec,
                    &kv,
                    ws.h.ptr(),
                    d.attn_norm.ptr(),
                    self.eps(),
                    kv_out,
                    MvMode::Store,
                    true,
                )?;
                self.gate_split(hw, 1, ws.qkv.ptr(), s.q_dim() + 2 * s.kv_dim(), true)
            })(),
            1 => (|| {
                self.attention_decode(l)?;
                self.gate_mul(ws.attn.ptr(), hw.gate.ptr(), s.q_dim(), true)
            })(),
            _ => return None,
        })
    }

    /// The prefill stages of a GatedDeltaNet or output-gated attention layer over pf.h[t, H]
    /// (see `PREFILL_STAGES`; stage 0, the norm, is the plain one); None where the layer runs
    /// the plain stage.
    pub(super) fn hybrid_prefill_stage(
        &self,
        l: usize,
        t: usize,
        stage: usize,
    ) -> Option<DResult<()>> {
        let d = self.layer(l);
        if d.gdn.is_none() && !d.gated {
            return None;
        }
        let pf = self.pf.as_ref().expect("prefill workspace");
        let hw = self.hybrid().pf.as_ref().expect("hybrid prefill workspace");
        let (s, h) = (&self.spec, self.spec.hidden);
        if let Some(g) = &d.gdn {
            let geo = &g.geo;
            return Some(match stage {
                1 => (|| {
                    self.gemm(
                        &g.qkvz,
                        pf.xn.ptr(),
                        pf.xb.ptr(),
                        t,
                        hw.qkvz.ptr(),
                        geo.qkvz_dim(),
                        0,
                        false,
                    )?;
                    self.gemm(
                        &g.ba,
                        pf.xn.ptr(),
                        pf.xb.ptr(),
                        t,
                        hw.ba.ptr(),
                        2 * geo.num_v_heads,
                        0,
                        false,
                    )
                })(),
                2 => self.gdn_mix(g, t, hw, false),
                3 => Ok(()),
                4 => (|| {
                    self.to_bf16(hw.core.ptr(), t * geo.value_dim(), hw.core_bf16.ptr())?;
                    self.gemm(
                        &g.out,
                        hw.core.ptr(),
                        hw.core_bf16.ptr(),
                        t,
                        pf.h.ptr(),
                        h,
                        0,
                        true,
                    )
                })(),
                _ => return None,
            });
        }
        if !d.gated {
            return None;
        }
        let (q, kv) = (s.q_dim(), s.kv_dim());
        let ld = q + 2 * kv;
        Some(match stage {
            1 => (|| {
                self.gemm(
                    &d.q,
                    pf.xn.ptr(),
                    pf.xb.ptr(),
                    t,
                    hw.qg.ptr(),
                    2 * q,
                    0,
                    false,
                )?;
                self.gemm(
                    &d.k,
                    pf.xn.ptr(),
                    pf.xb.ptr(),
                    t,
                    pf.qkv.ptr(),
                    ld,
                    q,
                    false,
                )?;
                self.gemm(
                    &d.v,
                    pf.xn.ptr(),
                    pf.xb.ptr(),
                    t,
                    pf.qkv.ptr(),
                    ld,
                    q + kv,
                    false,
                )?;
                self.gate_split(hw, t, pf.qkv.ptr(), ld, false)
            })(),
            3 => (|| {
                self.enqueue_attention_prefill(l, t)?;
                self.gate_mul(pf.attn.ptr(), hw.gate.ptr(), t * q, false)
            })(),
            _ => return None,
        })
    }

    /// The hybrid prefill scratch, allocated on first use.
    pub(super) fn ensure_hybrid_prefill_ws(&mut self) -> DResult<()> {
        if let Some(h) = &mut self.hybrid {
            if h.pf.is_none() {
                h.pf = Some(GdnWs::new(&self.dev, h.pf_sizes)?);
            }
        }
        Ok(())
    }

    fn mv(&self, w: &DevWeight, x: u64, norm: u64, y: u64, mode: MvMode) -> DResult<()> {
        matvec::launch(
            &self.dev,
            &self.ck.matvec,
            &[MvSeg { w, bias: 0 }],
            x,
            norm,
            self.eps(),
            y,
            mode,
            true,
        )
    }

    /// The fused projections of the token in ws.h (RMSNorm fused): separate launches, as the
    /// small b/a projection usually stays f32 beside a quantised qkvz.
    fn gdn_in_proj_decode(&self, d: &DevLayer, g: &DevGdn) -> DResult<()> {
        let hw = &self.hybrid().dec;
        let (x, norm) = (self.ws.h.ptr(), d.attn_norm.ptr());
        self.mv(&g.qkvz, x, norm, hw.qkvz.ptr(), MvMode::Store)?;
        self.mv(&g.ba, x, norm, hw.ba.ptr(), MvMode::Store)
    }

    /// gdn_prep and gdn_delta over `t` rows of `hw.qkvz` / `hw.ba`, into `hw.core`.
    fn gdn_mix(&self, g: &DevGdn, t: usize, hw: &GdnWs, pdl: bool) -> DResult<()> {
        launch_mix(&self.dev, &self.hybrid().k, g, t, hw, self.eps(), pdl)
    }

    /// Query values of hw.qg's `t` rows to `q_out` (row stride `ld`), gates to hw.gate.
    fn gate_split(&self, hw: &GdnWs, t: usize, q_out: u64, ld: usize, pdl: bool) -> DResult<()> {
        let s = &self.spec;
        self.dev.launch_ex(
            &self.hybrid().k.gate_split,
            grid1(t * s.q_dim(), 256 * 4),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(hw.qg.ptr()),
                Arg::I32(t as i32),
                Arg::I32(s.num_heads as i32),
                Arg::I32(s.head_dim as i32),
                Arg::Ptr(q_out),
                Arg::I32(ld as i32),
                Arg::Ptr(hw.gate.ptr()),
            ],
            pdl,
        )
    }

    /// attn[i] *= sigmoid(gate[i]) for `n` values.
    fn gate_mul(&self, attn: u64, gate: u64, n: usize, pdl: bool) -> DResult<()> {
        self.dev.launch_ex(
            &self.hybrid().k.gate_mul,
            grid1(n, 256 * 4),
            (256, 1, 1),
            0,
            &[Arg::Ptr(attn), Arg::Ptr(gate), Arg::U64(n as u64)],
            pdl,
        )
    }
}
