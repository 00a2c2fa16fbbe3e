//! The forward pass, as sequences of launches on the model's stream.
//!
//! Decode (one token, everything read from device memory, so the same launches replay as a
//! graph at any position), per layer — 5 launches:
//!   matvec(q|k|v, RMSNorm fused, biases) → attn_decode (q/k norm, RoPE, KV write, split-K
//!   attention, fused merge) → matvec(o, += residual) → matvec(gate|up, RMSNorm fused, SwiGLU)
//!   → matvec(down, += residual)
//! then matvec(lm_head, final norm fused) → the sampler (sampler.rs; token, position += 1).
//!
//! Prefill (T tokens), per layer: rmsnorm → GEMM q,k,v → rope_qk_kv (+biases) → flash
//! attention → GEMM o (+= residual, beta 1) → rmsnorm → GEMM gate,up → swiglu → GEMM down
//! (+= residual).
//!
//! Mixture-of-experts layers replace the feed-forward launches (moe.rs): decode runs the router,
//! the routing and the chosen experts' matvecs inside the same graph; prefill groups the rows
//! by expert.

use super::moe::DevFfn;
use super::workspace::{PrefillWs, HIST_SLOTS, SAMPLE_BLOCKS};
use super::{AttnKernel, CudaLlm, DevLayer};
use crate::cuda::runtime::device::{bytes_of, Arg, DResult, DevError, Graph};
use crate::cuda::runtime::kernels::{self, Func};
use crate::cuda::runtime::matvec::{self, MvMode, MvSeg};
use crate::cuda::runtime::weights::{DevCodec, DevWeight};
use crate::llm::sample::SampleSpec;
use crate::llm::{Logits, Sampler};
use std::ops::Range;

use crate::cuda::runtime::device::grid1;
use crate::cuda::runtime::weights::DequantTo;

impl CudaLlm {
    /// Launches a kernel of the decode chain (each calls pdl_wait before reading its
    /// inputs), with programmatic dependent launch.
    pub(super) fn go(
        &self,
        f: &Func,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        args: &[Arg],
    ) -> DResult<()> {
        self.dev.launch_ex(f, grid, block, smem, args, true)
    }

    pub(super) fn layer(&self, l: usize) -> &DevLayer {
        self.layers[l].as_ref().expect("resident layer")
    }

    pub(super) fn eps(&self) -> f32 {
        self.spec.rms_eps
    }

    // ---- decode -------------------------------------------------------------------------

    /// Embedding of the token in `ws.tok` into `ws.h`.
    fn enqueue_embed_decode(&self) -> DResult<()> {
        let e = self.embed.as_ref().expect("head resident");
        self.embed_rows(e, self.ws.tok(), 1, self.ws.h.ptr())
    }

    pub(super) fn embed_rows(&self, e: &DevWeight, tokens: u64, t: usize, out: u64) -> DResult<()> {
        self.go(
            &self.mk.embed_rows,
            (t as u32, 1, 1),
            (256, 1, 1),
            0,
            &[
                Arg::I32(e.codec as i32),
                Arg::Ptr(e.w()),
                Arg::Ptr(e.rs()),
                Arg::Ptr(e.colp()),
                Arg::I32(e.cols as i32),
                Arg::I32(e.rows as i32),
                Arg::Ptr(tokens),
                Arg::Ptr(out),
            ],
        )
    }

    /// RMSNorm + q/k norm + RoPE + KV write for `t` tokens at positions `*pos_ptr + i`.
    #[allow(clippy::too_many_arguments)]
    fn rope(
        &self,
        l: usize,
        qkv: u64,
        t: usize,
        pos_ptr: u64,
        q_out: u64,
        with_bias: bool,
    ) -> DResult<()> {
        let s = &self.spec;
        let d = self.layer(l);
        let opt = |b: &Option<super::DBuf>| b.as_ref().map_or(0, |b| b.ptr());
        let heads = s.num_heads + 2 * s.num_kv_heads;
        let mut args = vec![
            Arg::Ptr(qkv),
            Arg::I32((s.q_dim() + 2 * s.kv_dim()) as i32),
            Arg::Ptr(if with_bias { opt(&d.q_bias) } else { 0 }),
            Arg::Ptr(if with_bias { opt(&d.k_bias) } else { 0 }),
            Arg::Ptr(if with_bias { opt(&d.v_bias) } else { 0 }),
        ];
        args.extend(self.norm_rope_args(d, pos_ptr));
        args.extend([
            Arg::Ptr(q_out),
            Arg::Ptr(d.k_cache.ptr()),
            Arg::Ptr(d.v_cache.ptr()),
            Arg::I32(self.opts.max_context as i32),
        ]);
        self.go(
            &self.mk.rope_qk_kv,
            (heads.div_ceil(4) as u32, t as u32, 1),
            (128, 1, 1),
            0,
            &args,
        )
    }

    /// The q/k norm and RoPE arguments that `rope_qk_kv` (rowops.cu) and the decode-attention
    /// kernels (`DECODE_ARGS`) share, in their order: q_norm, k_norm, eps, inv_freq, R,
    /// attn_factor, pos_ptr, NH, NKV.
    fn norm_rope_args(&self, d: &DevLayer, pos_ptr: u64) -> [Arg; 9] {
        let s = &self.spec;
        let opt = |b: &Option<super::DBuf>| b.as_ref().map_or(0, |b| b.ptr());
        [
            Arg::Ptr(opt(&d.q_norm)),
            Arg::Ptr(opt(&d.k_norm)),
            Arg::F32(self.eps()),
            Arg::Ptr(self.inv_freq.ptr()),
            Arg::I32(s.rope.inv_freq.len() as i32),
            Arg::F32(s.rope.attention_factor),
            Arg::Ptr(pos_ptr),
            Arg::I32(s.num_heads as i32),
            Arg::I32(s.num_kv_heads as i32),
        ]
    }

    /// The arguments of the decode-attention kernels (`DECODE_ARGS` in attention_decode.cu)
    /// for layer `l`.
    fn decode_attention_args(&self, l: usize) -> Vec<Arg> {
        let (ws, s) = (&self.ws, &self.spec);
        let d = self.layer(l);
        let mut args = vec![Arg::Ptr(ws.qkv.ptr())];
        args.extend(self.norm_rope_args(d, ws.pos()));
        args.extend([
            Arg::I32(d.window),
            Arg::I32(self.opts.max_context as i32),
            Arg::F32(s.attn_scale),
            Arg::I32(self.splits as i32),
            Arg::I32(self.chunk_max as i32),
            Arg::Ptr(d.k_cache.ptr()),
            Arg::Ptr(d.v_cache.ptr()),
            Arg::Ptr(ws.part.ptr()),
            Arg::Ptr(ws.count.ptr()),
            Arg::Ptr(ws.attn.ptr()),
        ]);
        args
    }

    /// Decode attention for layer `l` with the q/k norm, RoPE and the KV write of the new
    /// token fused in (attention_decode.cu): reads the q|k|v matvec output, writes `ws.attn`.
    /// In the short-context chain (`enqueue_short`) one block per kv head, staged or not.
    pub(super) fn attention_decode(&self, l: usize) -> DResult<()> {
        let s = &self.spec;
        let (func, grid_y, smem) = match (self.enqueue_short.get(), self.short) {
            (true, super::ShortDecode::Staged) => {
                (&self.mk.attn_decode_short, 1, self.smem.decode_short)
            }
            (true, super::ShortDecode::Grid) => (&self.mk.attn_decode, 1, self.smem.decode),
            _ => (&self.mk.attn_decode, self.splits as u32, self.smem.decode),
        };
        self.go(
            func,
            (s.num_kv_heads as u32, grid_y, 1),
            ((super::DEC_WARPS * 32) as u32, 1, 1),
            smem as u32,
            &self.decode_attention_args(l),
        )
    }

    /// Stages of one decode layer (the profile times them one by one).
    pub(super) const DECODE_STAGES: [&'static str; 5] = [
        "qkv matvec (+norm)",
        "attention (+q/k norm, rope, kv write; split-K)",
        "o matvec (+res)",
        "gate|up matvec (+norm, swiglu; MoE: router, top-k, chosen experts' gate|up)",
        "down matvec (+res; MoE: chosen experts' down, weighted sum)",
    ];

    pub(super) fn decode_stage(&self, l: usize, stage: usize) -> DResult<()> {
        if let Some(r) = self.hybrid_decode_stage(l, stage) {
            return r;
        }
        let (dev, ck, ws) = (&*self.dev, &*self.ck, &self.ws);
        let d = self.layer(l);
        let opt = |b: &Option<super::DBuf>| b.as_ref().map_or(0, |b| b.ptr());
        let mv = |segs: &[MvSeg], x: u64, norm: u64, y: u64, mode: MvMode| {
            matvec::launch(dev, &ck.matvec, segs, x, norm, self.eps(), y, mode, true)
        };
        match stage {
            0 => {
                let segs = [
                    MvSeg {
                        w: &d.q,
                        bias: opt(&d.q_bias),
                    },
                    MvSeg {
                        w: &d.k,
                        bias: opt(&d.k_bias),
                    },
                    MvSeg {
                        w: &d.v,
                        bias: opt(&d.v_bias),
                    },
                ];
                mv(
                    &segs,
                    ws.h.ptr(),
                    d.attn_norm.ptr(),
                    ws.qkv.ptr(),
                    MvMode::Store,
                )
            }
            1 => self.attention_decode(l),
            2 => mv(
                &[MvSeg { w: &d.o, bias: 0 }],
                ws.attn.ptr(),
                0,
                ws.h.ptr(),
                MvMode::Accumulate,
            ),
            3 => match &d.ffn {
                DevFfn::Dense(m) => {
                    let gu = [
                        MvSeg {
                            w: &m.gate,
                            bias: 0,
                        },
                        MvSeg { w: &m.up, bias: 0 },
                    ];
                    mv(
                        &gu,
                        ws.h.ptr(),
                        d.ffn_norm.ptr(),
                        ws.act.ptr(),
                        MvMode::SwiGlu,
                    )
                }
                DevFfn::Moe(m) => self.moe_decode_up(self.ws.h.ptr(), d.ffn_norm.ptr(), m),
            },
            _ => match &d.ffn {
                DevFfn::Dense(m) => mv(
                    &[MvSeg {
                        w: &m.down,
                        bias: 0,
                    }],
                    ws.act.ptr(),
                    0,
                    ws.h.ptr(),
                    MvMode::Accumulate,
                ),
                DevFfn::Moe(m) => self.moe_decode_down(self.ws.h.ptr(), m),
            },
        }
    }

    fn enqueue_layer_decode(&self, l: usize) -> DResult<()> {
        (0..Self::DECODE_STAGES.len()).try_for_each(|st| self.decode_stage(l, st))
    }

    pub(super) fn enqueue_head_decode(&self, x: u64, out: u64) -> DResult<()> {
        let head = self.head_weight().expect("head resident");
        let norm = self.final_norm.as_ref().expect("head resident").ptr();
        matvec::launch(
            &self.dev,
            &self.ck.matvec,
            &[MvSeg { w: head, bias: 0 }],
            x,
            norm,
            self.eps(),
            out,
            MvMode::Store,
            true,
        )
    }

    /// The sampler's launches (sample.cu): penalties when the spec has them, then for greedy
    /// and top-k specs the per-block candidates and their merge and draw, for other sampled
    /// specs the vocabulary passes (sampler.rs).
    pub(super) fn enqueue_sample(&self, sampler: &Sampler) -> DResult<()> {
        let ws = &self.ws;
        let v = self.spec.vocab;
        let spec = match *sampler {
            Sampler::Greedy => SampleSpec::default(),
            Sampler::Sample(s) => s,
        };
        if spec.has_penalties() {
            self.go(
                &self.ck.penalize,
                (1, 1, 1),
                (1024, 1, 1),
                0,
                &[
                    Arg::Ptr(ws.logits.ptr()),
                    Arg::I32(v as i32),
                    Arg::Ptr(ws.hist.ptr()),
                    Arg::I32(HIST_SLOTS as i32 - 1),
                    Arg::Ptr(ws.tok()),
                    Arg::Ptr(ws.pos()),
                    Arg::I32(spec.penalty_last_n as i32),
                    Arg::F32(spec.repeat_penalty),
                    Arg::F32(spec.presence_penalty),
                    Arg::F32(spec.frequency_penalty),
                ],
            )?;
        }
        if super::sampler::takes_vocab_passes(&spec, v) {
            return self.enqueue_vocab_sample(&spec);
        }
        // Candidates to merge: one for greedy, else top-k's k.
        let (k, temp) = if spec.is_greedy() {
            (1, 0.0)
        } else {
            (spec.top_k, spec.temperature)
        };
        self.go(
            &self.ck.topk_partial,
            (SAMPLE_BLOCKS as u32, 1, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(ws.logits.ptr()),
                Arg::I32(self.spec.vocab as i32),
                Arg::I32(k as i32),
                Arg::Ptr(ws.cand_v.ptr()),
                Arg::Ptr(ws.cand_i.ptr()),
            ],
        )?;
        self.go(
            &self.ck.sample_final,
            (1, 1, 1),
            (1024, 1, 1),
            0,
            &[
                Arg::Ptr(ws.cand_v.ptr()),
                Arg::Ptr(ws.cand_i.ptr()),
                Arg::I32(k as i32),
                Arg::F32(temp),
                Arg::I32(spec.top_k.min(i32::MAX as usize) as i32),
                Arg::F32(spec.top_p),
                Arg::F32(spec.min_p),
                Arg::U64(spec.seed),
                Arg::I32(v as i32),
                Arg::Ptr(ws.tok()),
                Arg::Ptr(ws.pos()),
                Arg::Ptr(self.ahead.ring.dev_ptr()),
                Arg::I32(super::ahead::RING_SLOTS as i32 - 1),
                Arg::Ptr(ws.hist.ptr()),
                Arg::I32(HIST_SLOTS as i32 - 1),
            ],
        )
    }

    /// Every launch of one decode step, in order (what the graph captures).
    pub(super) fn enqueue_token(&self, sampler: &Sampler) -> DResult<()> {
        self.enqueue_embed_decode()?;
        for l in 0..self.layers.len() {
            self.enqueue_layer_decode(l)?;
        }
        self.enqueue_head_decode(self.ws.h.ptr(), self.ws.logits.ptr())?;
        self.enqueue_sample(sampler)
    }

    /// Captures the whole-token graph; `short`: the chain for contexts of at most
    /// `one_block` keys (one decode-attention block per kv head).
    pub(super) fn capture(&self, sampler: &Sampler, short: bool) -> DResult<Graph> {
        self.enqueue_short.set(short);
        let graph = self.dev.capture(|| self.enqueue_token(sampler));
        self.enqueue_short.set(false);
        graph
    }

    /// Runs one decode step; returns (sampled token, logits if asked). Unless logits are
    /// wanted, the next step's graph is launched before this one's token is read (ahead.rs):
    /// the next call finds it running when it asks for that step.
    pub(super) fn decode_step(
        &mut self,
        token: u32,
        pos: usize,
        sampler: &Sampler,
        want_logits: bool,
    ) -> DResult<(u32, Vec<f32>)> {
        // Positions below one_block see at most that many keys in every layer. Both graphs
        // are captured together, so crossing the switch mid-generation costs no capture.
        for slot in [false, true] {
            let stale = self.graphs[slot as usize]
                .as_ref()
                .map(|(s, _)| s != sampler)
                .unwrap_or(true);
            if stale {
                self.settle()?;
                self.graphs[slot as usize] = None;
                let g = self.capture(sampler, slot)?;
                self.graphs[slot as usize] = Some((*sampler, g));
            }
        }
        if !self.ahead.take_matching(pos, token, sampler) {
            // Nothing running, or a graph launched ahead for another step: wait for it (its
            // writes are rewritten by this step) and start this one.
            self.settle()?;
            if self.dev_inputs != Some((token, pos)) {
                self.dev
                    .upload(self.ws.io.ptr(), bytes_of(&[token as i32, pos as i32]))?;
            }
            self.launch_decode_graph(pos)?;
        }
        // From here the device inputs are unknown until the step completes.
        self.dev_inputs = None;
        let ahead = self.ahead.enabled && !want_logits && pos + 1 < self.opts.max_context;
        if ahead {
            self.launch_decode_graph(pos + 1)?;
        }
        let tok = match self.ahead.wait_token(pos) {
            Ok(t) => t,
            Err(e) => {
                let _ = self.dev.sync();
                return Err(e);
            }
        };
        if ahead {
            self.ahead.in_flight = Some(super::ahead::InFlight {
                pos: pos + 1,
                fed: tok,
                sampler: *sampler,
            });
            return Ok((tok, Vec::new()));
        }
        let logits = if want_logits {
            let mut v = vec![0f32; self.spec.vocab];
            self.dev.download_f32(&mut v, self.ws.logits.ptr())?;
            v
        } else {
            Vec::new()
        };
        self.dev_inputs = Some((tok, pos + 1));
        Ok((tok, logits))
    }

    /// Launches the captured graph for `pos` (the device inputs must hold it) and records its
    /// completion event.
    pub(super) fn launch_decode_graph(&self, pos: usize) -> DResult<()> {
        let (_, g) = self.graphs[self.short_graph_at(pos) as usize]
            .as_ref()
            .expect("captured before launching");
        g.launch()?;
        self.ahead.record(pos, self.dev.stream.cu_stream())
    }

    /// Whether the decode step at `pos` runs the short-context graph (`ShortDecode`): below
    /// `one_block` keys.
    pub(super) fn short_graph_at(&self, pos: usize) -> bool {
        pos < self.one_block
    }

    /// Waits for a decode graph launched ahead, if any; called before any other use of the
    /// decode state (another step, prefill, capture, profiling, drop).
    pub(super) fn settle(&mut self) -> DResult<()> {
        if self.ahead.in_flight.take().is_some() {
            self.dev_inputs = None;
            self.dev.sync()?;
        }
        Ok(())
    }

    // ---- prefill ------------------------------------------------------------------------

    pub(super) fn ensure_prefill_ws(&mut self) -> DResult<()> {
        if self.pf.is_none() {
            self.pf = Some(PrefillWs::new(&self.dev, self.pf_sizes)?);
        }
        if let (None, Some(z)) = (&self.moe_pf, self.moe_pf_sizes) {
            self.moe_pf = Some(super::moe::MoePrefillWs::new(&self.dev, z)?);
        }
        Ok(())
    }

    /// out[t, col0 + r] (+)= x[t] · w[r] for every row of `w`, through cuBLAS. `x_f32` /
    /// `x_bf16` hold the same input in both precisions; the codec picks which is read.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemm(
        &self,
        w: &DevWeight,
        x_f32: u64,
        x_bf16: u64,
        t: usize,
        out: u64,
        ldc: usize,
        col0: usize,
        accumulate: bool,
    ) -> DResult<()> {
        let bf16 = w.codec.gemm_in_bf16() && !self.opts.precise;
        self.gemm_as(w, x_f32, x_bf16, t, out, ldc, col0, accumulate, bf16)
    }

    /// [`Self::gemm`] in the precision `bf16` says, whatever the codec would choose.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemm_as(
        &self,
        w: &DevWeight,
        x_f32: u64,
        x_bf16: u64,
        t: usize,
        out: u64,
        ldc: usize,
        col0: usize,
        accumulate: bool,
        bf16: bool,
    ) -> DResult<()> {
        if bf16 && self.batched_q8(w) {
            return self.gemm_q8(w, x_bf16, t, out, ldc, col0, accumulate);
        }
        let pf = self.pf.as_ref().expect("prefill workspace");
        let blas = self
            .blas
            .as_ref()
            .ok_or_else(|| DevError("cuBLAS is not available".into()))?;
        let x = if bf16 { x_bf16 } else { x_f32 };
        let k = w.cols;
        let out0 = out + 4 * col0 as u64;
        match w.codec {
            // Used in place when the stored precision is the GEMM's.
            DevCodec::Bf16 | DevCodec::F32 if bf16 == (w.codec == DevCodec::Bf16) => {
                blas.gemm(bf16, w.w(), x, out0, w.rows, t, k, ldc, accumulate)
            }
            _ => {
                let elem = if bf16 { 2 } else { 4 };
                let per = (pf.scratch.len() / (k * elem)).max(1).min(w.rows);
                let mut r0 = 0;
                while r0 < w.rows {
                    let rows = per.min(w.rows - r0);
                    let to = if bf16 {
                        DequantTo::Bf16(pf.scratch.ptr())
                    } else {
                        DequantTo::F32(pf.scratch.ptr())
                    };
                    w.dequant(&self.dev, &self.mk.dequant_rows, r0, rows, to)?;
                    blas.gemm(
                        bf16,
                        pf.scratch.ptr(),
                        x,
                        out0 + 4 * r0 as u64,
                        rows,
                        t,
                        k,
                        ldc,
                        accumulate,
                    )?;
                    r0 += rows;
                }
                Ok(())
            }
        }
    }

    pub(super) fn rmsnorm_rows(&self, x: u64, w: u64, t: usize, k: usize, out: u64) -> DResult<()> {
        self.dev.launch(
            &self.mk.rmsnorm_rows,
            (t as u32, 1, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(x),
                Arg::Ptr(w),
                Arg::F32(self.eps()),
                Arg::I32(k as i32),
                Arg::Ptr(out),
            ],
        )
    }

    pub(super) fn to_bf16(&self, x: u64, n: usize, out: u64) -> DResult<()> {
        self.dev.launch(
            &self.mk.to_bf16,
            grid1(n, 256 * 4),
            (256, 1, 1),
            0,
            &[Arg::Ptr(x), Arg::U64(n as u64), Arg::Ptr(out)],
        )
    }

    /// Stages of one prefill layer (the profile times them one by one).
    pub(super) const PREFILL_STAGES: [&'static str; 8] = [
        "rmsnorm + bf16",
        "q,k,v GEMMs",
        "rope + kv write",
        "attention",
        "bf16 + o GEMM (+res)",
        "rmsnorm + bf16 + gate,up GEMMs (MoE: the whole block)",
        "swiglu",
        "down GEMM (+res)",
    ];

    /// The normed rows pf.xn (and their bf16 copy pf.xb) times each weight, the products side
    /// by side in the rows of `out` (row stride `ld`), each from its column offset on.
    fn gemms_side_by_side(
        &self,
        parts: &[(&DevWeight, usize)],
        t: usize,
        out: u64,
        ld: usize,
    ) -> DResult<()> {
        let pf = self.pf.as_ref().expect("prefill workspace");
        if self.gemms_q8_one_input(parts, pf.xb.ptr(), t, out, ld)? {
            return Ok(());
        }
        parts.iter().try_for_each(|&(w, col0)| {
            self.gemm(w, pf.xn.ptr(), pf.xb.ptr(), t, out, ld, col0, false)
        })
    }

    /// One stage of layer `l` over pf.h[t, H] at positions *pf.start + i.
    pub(super) fn prefill_stage(&self, l: usize, t: usize, stage: usize) -> DResult<()> {
        if let Some(r) = self.hybrid_prefill_stage(l, t, stage) {
            return r;
        }
        let (s, pf, d) = (
            &self.spec,
            self.pf.as_ref().expect("prefill workspace"),
            self.layer(l),
        );
        let (h, q, kv) = (s.hidden, s.q_dim(), s.kv_dim());
        let ld = q + 2 * kv;
        match stage {
            0 => {
                self.rmsnorm_rows(pf.h.ptr(), d.attn_norm.ptr(), t, h, pf.xn.ptr())?;
                self.to_bf16(pf.xn.ptr(), t * h, pf.xb.ptr())
            }
            // q, k and v side by side in the rows of pf.qkv.
            1 => self.gemms_side_by_side(
                &[(&d.q, 0), (&d.k, q), (&d.v, q + kv)],
                t,
                pf.qkv.ptr(),
                ld,
            ),
            2 => self.rope(l, pf.qkv.ptr(), t, pf.start.ptr(), pf.qr.ptr(), true),
            3 => self.enqueue_attention_prefill(l, t),
            4 => {
                self.to_bf16(pf.attn.ptr(), t * q, pf.xb.ptr())?;
                self.gemm(&d.o, pf.attn.ptr(), pf.xb.ptr(), t, pf.h.ptr(), h, 0, true)
            }
            5..=7 => match &d.ffn {
                DevFfn::Dense(m) => self.dense_prefill_stage(d.ffn_norm.ptr(), m, t, stage),
                // The whole MoE block runs as stage 5.
                DevFfn::Moe(_) if stage == 5 => self.moe_prefill(d.ffn_norm.ptr(), l, t),
                DevFfn::Moe(_) => Ok(()),
            },
            _ => unreachable!("prefill stage {stage}"),
        }
    }

    /// Stages 5–7 of a dense layer: RMSNorm, gate|up GEMMs; SwiGLU; down GEMM (+= residual).
    fn dense_prefill_stage(
        &self,
        norm: u64,
        m: &super::moe::DevMlp,
        t: usize,
        stage: usize,
    ) -> DResult<()> {
        let (h, pf) = (
            self.spec.hidden,
            self.pf.as_ref().expect("prefill workspace"),
        );
        let i = m.gate.rows;
        match stage {
            5 => {
                self.rmsnorm_rows(pf.h.ptr(), norm, t, h, pf.xn.ptr())?;
                self.to_bf16(pf.xn.ptr(), t * h, pf.xb.ptr())?;
                // gate and up side by side in the rows of pf.gu, as swiglu_rows reads them.
                self.gemms_side_by_side(&[(&m.gate, 0), (&m.up, i)], t, pf.gu.ptr(), 2 * i)
            }
            6 => self.swiglu(t, i, &m.down),
            _ => self.gemm(
                &m.down,
                pf.act_f.ptr(),
                pf.xb.ptr(),
                t,
                pf.h.ptr(),
                h,
                0,
                true,
            ),
        }
    }

    /// SwiGLU over pf.gu [t, 2·i] (gate | up) into the input of `down`'s GEMM: pf.act_f (f32)
    /// where that GEMM runs in f32, else pf.xb (bf16).
    pub(super) fn swiglu(&self, t: usize, i: usize, down: &DevWeight) -> DResult<()> {
        let pf = self.pf.as_ref().expect("prefill workspace");
        let f32_act = self.opts.precise || !down.codec.gemm_in_bf16();
        self.dev.launch(
            &self.mk.swiglu_rows,
            grid1(t * i, 256 * 4),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(pf.gu.ptr()),
                Arg::I32(i as i32),
                Arg::U64(t as u64),
                Arg::Ptr(if f32_act { pf.act_f.ptr() } else { 0 }),
                Arg::Ptr(if f32_act { 0 } else { pf.xb.ptr() }),
            ],
        )
    }

    /// One layer over pf.h[t, H] at positions *pf.start + i.
    pub(super) fn enqueue_layer_prefill(&self, l: usize, t: usize) -> DResult<()> {
        (0..Self::PREFILL_STAGES.len()).try_for_each(|st| self.prefill_stage(l, t, st))
    }

    pub(super) fn enqueue_attention_prefill(&self, l: usize, t: usize) -> DResult<()> {
        let (s, pf, d) = (
            &self.spec,
            self.pf.as_ref().expect("prefill workspace"),
            self.layer(l),
        );
        let start = self.pf_start;
        let common = |args: &mut Vec<Arg>| {
            args.extend([
                Arg::I32(start as i32),
                Arg::I32(d.window),
                Arg::I32(self.opts.max_context as i32),
                Arg::F32(s.attn_scale),
                Arg::I32(s.num_heads as i32),
                Arg::Ptr(pf.attn.ptr()),
            ])
        };
        let tc = match self.attn {
            AttnKernel::Fa2 => self
                .mk
                .attn_prefill_fa2
                .as_ref()
                .map(|f| (f, kernels::fa2_smem(s.head_dim))),
            AttnKernel::Simple => None,
        };
        match tc {
            Some((f, smem)) => {
                let mut args = vec![
                    Arg::Ptr(pf.qr.ptr()),
                    Arg::Ptr(d.k_cache.ptr()),
                    Arg::Ptr(d.v_cache.ptr()),
                    Arg::I32(t as i32),
                ];
                common(&mut args);
                self.dev.launch(
                    f,
                    (t.div_ceil(64) as u32, s.num_heads as u32, 1),
                    (128, 1, 1),
                    smem as u32,
                    &args,
                )
            }
            None => {
                let mut args = vec![
                    Arg::Ptr(pf.qr.ptr()),
                    Arg::Ptr(d.k_cache.ptr()),
                    Arg::Ptr(d.v_cache.ptr()),
                ];
                common(&mut args);
                self.dev.launch(
                    &self.mk.attn_prefill_simple,
                    (t as u32, s.num_heads.div_ceil(4) as u32, 1),
                    (128, 1, 1),
                    0,
                    &args,
                )
            }
        }
    }

    /// Final norm + lm_head over pf.h[t, H] into logits [t, V] at `out`.
    pub(super) fn enqueue_head_prefill(&self, t: usize, out: u64) -> DResult<()> {
        let (s, pf) = (&self.spec, self.pf.as_ref().expect("prefill workspace"));
        let head = self.head_weight().expect("head resident");
        let norm = self.final_norm.as_ref().expect("head resident").ptr();
        self.rmsnorm_rows(pf.h.ptr(), norm, t, s.hidden, pf.xn.ptr())?;
        self.to_bf16(pf.xn.ptr(), t * s.hidden, pf.xb.ptr())?;
        self.gemm(head, pf.xn.ptr(), pf.xb.ptr(), t, out, s.vocab, 0, false)
    }

    pub(super) fn upload_prefill_inputs(
        &mut self,
        tokens: Option<&[u32]>,
        start: usize,
    ) -> DResult<()> {
        let pf = self.pf.as_ref().expect("prefill workspace");
        if let Some(tokens) = tokens {
            let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
            self.dev.upload(pf.tokens.ptr(), bytes_of(&ids))?;
        }
        self.dev.upload(pf.start.ptr(), bytes_of(&[start as i32]))?;
        self.pf_start = start;
        Ok(())
    }

    /// The whole prompt, chunk by chunk; returns the logits asked for.
    pub(super) fn prefill_all(
        &mut self,
        tokens: &[u32],
        start: usize,
        logits: Logits,
    ) -> DResult<Vec<f32>> {
        self.settle()?;
        self.ensure_prefill_ws()?;
        self.ensure_hybrid_prefill_ws()?;
        self.dev_inputs = None;
        let (v, cap) = (self.spec.vocab, self.opts.prefill_chunk);
        let mut out = vec![0f32; logits.len(tokens.len(), v)];
        let chunks: Vec<(usize, &[u32])> = tokens
            .chunks(cap)
            .enumerate()
            .map(|(i, c)| (start + i * cap, c))
            .collect();
        let n_chunks = chunks.len();
        for (ci, (pos, chunk)) in chunks.into_iter().enumerate() {
            let t = chunk.len();
            self.upload_prefill_inputs(Some(chunk), pos)?;
            let pf = self.pf.as_ref().expect("ensured");
            let embed = self.embed.as_ref().expect("head resident");
            self.embed_rows(embed, pf.tokens.ptr(), t, pf.h.ptr())?;
            for l in 0..self.layers.len() {
                self.enqueue_layer_prefill(l, t)?;
            }
            let pf = self.pf.as_ref().expect("ensured");
            match logits {
                Logits::None => {}
                Logits::Last if ci + 1 == n_chunks => {
                    let last = pf.h.ptr() + 4 * ((t - 1) * self.spec.hidden) as u64;
                    self.enqueue_head_decode(last, pf.logits_last.ptr())?;
                    self.dev.download_f32(&mut out, pf.logits_last.ptr())?;
                }
                Logits::Last => {}
                Logits::All => {
                    if self.pf.as_ref().expect("ensured").logits_all.is_none() {
                        let buf = self.dev.alloc(4 * cap * v)?;
                        self.pf.as_mut().expect("ensured").logits_all = Some(buf);
                    }
                    let dst = self
                        .pf
                        .as_ref()
                        .expect("ensured")
                        .logits_all
                        .as_ref()
                        .expect("allocated")
                        .ptr();
                    self.enqueue_head_prefill(t, dst)?;
                    let off = (pos - start) * v;
                    self.dev.download_f32(&mut out[off..off + t * v], dst)?;
                }
            }
        }
        self.dev.sync()?;
        Ok(out)
    }

    // ---- hybrid placement ---------------------------------------------------------------

    /// Resident `layers` over x[t, H]; returns the new hidden states.
    pub(super) fn run_layers(
        &mut self,
        layers: Range<usize>,
        x: &[f32],
        t: usize,
        start: usize,
    ) -> DResult<Vec<f32>> {
        self.settle()?;
        self.dev_inputs = None;
        let mut y = vec![0f32; x.len()];
        if t == 1 {
            self.dev
                .upload(self.ws.io.at(4), bytes_of(&[start as i32]))?;
            self.dev.upload_f32(self.ws.h.ptr(), x)?;
            for l in layers {
                self.enqueue_layer_decode(l)?;
            }
            self.dev.download_f32(&mut y, self.ws.h.ptr())?;
        } else {
            self.ensure_prefill_ws()?;
            self.upload_prefill_inputs(None, start)?;
            self.dev
                .upload_f32(self.pf.as_ref().expect("ensured").h.ptr(), x)?;
            for l in layers {
                self.enqueue_layer_prefill(l, t)?;
            }
            self.dev
                .download_f32(&mut y, self.pf.as_ref().expect("ensured").h.ptr())?;
        }
        Ok(y)
    }

    /// Final norm + lm_head of x[t, H]; returns logits [t, V].
    pub(super) fn run_head(&mut self, x: &[f32], t: usize) -> DResult<Vec<f32>> {
        self.settle()?;
        let (h, v) = (self.spec.hidden, self.spec.vocab);
        let mut out = vec![0f32; t * v];
        for i in 0..t {
            self.dev
                .upload_f32(self.ws.h.ptr(), &x[i * h..(i + 1) * h])?;
            self.enqueue_head_decode(self.ws.h.ptr(), self.ws.logits.ptr())?;
            self.dev
                .download_f32(&mut out[i * v..(i + 1) * v], self.ws.logits.ptr())?;
        }
        Ok(out)
    }
}
