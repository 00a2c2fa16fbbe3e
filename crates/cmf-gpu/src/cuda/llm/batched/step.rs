//! One batched step, as launches on the model's stream. Per layer, over the T rows of every
//! sequence in pf.h [T, H]:
//!   rmsnorm → GEMM q,k,v → rope_rows_paged (+biases, q/k norm, RoPE at each row's position, k
//!   and v into each row's pool slot) → attn_paged (each row over its sequence's blocks; or
//!   attn_paged_split, its keys split into runs on few-row steps: `BatchKernels`) →
//!   GEMM o (+= residual) → rmsnorm → GEMM gate,up → swiglu → GEMM down (+= residual)
//! (the prefill stages, `prefill_stage`, except the two in the middle); then the last row of each
//! sequence that wants output is gathered, normed and multiplied by lm_head, and each one's
//! logits, arg-max or drawn ids (`sample.rs`) come back. Steps of a few rows (decode of a few sequences) run the linear
//! layers and the head as the decode matvecs, row by row (`MATVEC_ROWS`).

use super::super::moe::DevFfn;
use super::super::CudaLlm;
use crate::cuda::runtime::device::{bytes_of, Arg, DResult, DevError};
use crate::cuda::runtime::matvec::{self, MvMode, MvSeg};
use crate::llm::batch::{self, BatchOut, BatchSeq};
use crate::llm::BatchKernels;

/// Steps of at most this many rows run each linear layer as one matvec per row (the decode
/// kernels, reading the weights in their codec) instead of one GEMM, which dequantises every
/// quantised matrix into a bf16 scratch first (about five times the matvec's weight traffic for
/// q8). At one row this is the single-sequence decode's arithmetic. The crossover is not measured.
const MATVEC_ROWS: usize = 4;

/// Where each section of a step's i32 inputs starts (in elements).
struct Inputs {
    tokens: usize,
    pos: usize,
    slot: usize,
    seq: usize,
    tab_off: usize,
    last: usize,
    tables: usize,
}

/// What one step launches: its rows, the rows whose logits are wanted, how the layers run, and
/// the buffers it reads and writes.
struct StepPlan {
    t: usize,
    wanted: Vec<usize>,
    by_rows: bool,
    /// MoE layers run the decode block row by row instead of the grouped GEMMs of prefill.
    moe_by_rows: bool,
    greedy: bool,
    io: u64,
    at: Inputs,
    logits: u64,
    ids: u64,
}

/// A captured decode step: its row count, whether it ends in arg-max, and the buffers the graph
/// points at (inputs, logits, ids, quantised rows).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct GraphKey {
    rows: usize,
    greedy: bool,
    buffers: [u64; 4],
}

/// Rows up to which a step runs MoE layers as the decode block row by row (each row reads its k
/// experts; no host round trip, so such decode steps can be captured); larger steps group the
/// rows by expert (`moe_prefill`: each chosen expert read once, but about six launches per
/// chosen expert and a readback of the routing a layer). Not measured yet, an estimate from
/// Qwen3-30B-A3B's bytes on an H100: at 64 rows a layer re-reads ~2.4 GB of experts row by row
/// (~0.8 ms) where the grouped path's ~770 launches take ~3 ms.
const MOE_ROWS: usize = 128;

/// Captured decode steps kept at most (one per batch size a server sees; each a few hundred
/// nodes).
const MAX_STEP_GRAPHS: usize = 128;

/// A step's i32 inputs, one upload: tokens, row positions, row slots, row sequences, each
/// sequence's table offset, the rows whose output is wanted, the block tables.
fn pack(seqs: &[BatchSeq], block_size: usize) -> (Vec<i32>, Inputs) {
    let t = batch::rows(seqs);
    let (slots, pos) = batch::row_slots(seqs, block_size);
    let mut v: Vec<i32> = Vec::with_capacity(4 * t + 2 * seqs.len());
    let tokens = 0;
    v.extend(seqs.iter().flat_map(|s| s.tokens.iter().map(|&x| x as i32)));
    let pos_at = v.len();
    v.extend(pos);
    let slot_at = v.len();
    v.extend(slots);
    let seq_at = v.len();
    for (i, s) in seqs.iter().enumerate() {
        v.extend(std::iter::repeat_n(i as i32, s.tokens.len()));
    }
    let tab_off = v.len();
    let mut off = 0;
    for s in seqs {
        v.push(off);
        off += s.blocks.len() as i32;
    }
    let last = v.len();
    let mut row = 0;
    for s in seqs {
        row += s.tokens.len();
        if s.want {
            v.push(row as i32 - 1);
        }
    }
    let tables = v.len();
    v.extend(seqs.iter().flat_map(|s| s.blocks.iter().map(|&b| b as i32)));
    (
        v,
        Inputs {
            tokens,
            pos: pos_at,
            slot: slot_at,
            seq: seq_at,
            tab_off,
            last,
            tables,
        },
    )
}

impl CudaLlm {
    /// Runs a validated step and writes `out`.
    pub(in super::super) fn run_batch_step(
        &mut self,
        seqs: &[BatchSeq],
        out: BatchOut,
    ) -> DResult<()> {
        self.settle()?;
        self.ensure_prefill_ws()?;
        self.dev_inputs = None;
        let (kind, max_rows) = super::q8::q8_gemm_choice(self.opts.batch_kernels);
        if kind == super::q8::Q8Gemm::Blocks32 {
            // The int8 GEMM's quantised inputs (the W8A16 one reads the bf16 rows).
            let q8_bytes = super::q8::scratch_bytes(batch::rows(seqs), self.widest_input());
            let dev = self.dev.clone();
            self.pool
                .as_mut()
                .expect("validated")
                .q8_x
                .at_least(&dev, q8_bytes)?;
        }
        self.q8_step
            .set(!self.opts.precise && batch::rows(seqs) <= max_rows);
        let r = self.enqueue_batch_step(seqs, out);
        self.q8_step.set(false);
        r
    }

    /// [`Self::run_batch_step`] once the workspaces are sized: the inputs go up, the launches
    /// run (a decode step of a row count seen before replays its captured graph), the outputs
    /// come back.
    fn enqueue_batch_step(&mut self, seqs: &[BatchSeq], out: BatchOut) -> DResult<()> {
        let vocab = self.spec.vocab;
        let t = batch::rows(seqs);
        let m = seqs.iter().filter(|s| s.want).count();
        let bs = self.pool.as_ref().expect("validated").shape.block_size;
        let (inputs, at) = pack(seqs, bs);
        let dev = self.dev.clone();
        let pool = self.pool.as_mut().expect("validated");
        let io = pool.io.at_least(&dev, 4 * inputs.len())?;
        let logits = pool.logits.at_least(&dev, 4 * m.max(1) * vocab)?;
        let ids = pool.ids.at_least(&dev, 4 * m.max(1))?;
        dev.upload(io, bytes_of(&inputs))?;
        // One row runs the decode matvecs (the single-sequence arithmetic); a few rows too
        // unless every matrix takes the int8 GEMM, which reads each weight once for all rows.
        // MoE layers always run the grouped GEMMs of prefill (`moe_prefill`), which read the
        // routing back once a layer: such steps are neither row by row nor captured.
        let all_q8 = self.layers.iter().flatten().all(|d| self.batched_q8(&d.q));
        let moe = self
            .layers
            .iter()
            .flatten()
            .any(|d| matches!(d.ffn, DevFfn::Moe(_)));
        let by_rows = !self.opts.precise && !moe && (t == 1 || (t <= MATVEC_ROWS && !all_q8));
        let moe_by_rows = moe && t <= MOE_ROWS;
        let mut wanted = Vec::with_capacity(m);
        let mut row = 0;
        for s in seqs {
            row += s.tokens.len();
            if s.want {
                wanted.push(row - 1);
            }
        }
        let plan = StepPlan {
            t,
            wanted,
            by_rows,
            moe_by_rows,
            greedy: matches!(out, BatchOut::Greedy(_)),
            io,
            at,
            logits,
            ids,
        };
        // Decode steps (one row per sequence, every row wanted) have the same launches for the
        // same row count: captured once, replayed after. Only our own kernels are captured (no
        // cuBLAS call: the rows run as matvecs or int8 GEMMs; no host readback: MoE layers run
        // row by row).
        let decode = seqs.iter().all(|s| s.tokens.len() == 1 && s.want);
        if decode && (!moe || moe_by_rows) && (by_rows || all_q8) {
            self.replay_step(&plan)?;
        } else {
            self.enqueue_step(&plan)?;
        }
        if m == 0 {
            return self.dev.sync();
        }
        if let BatchOut::Sampled { rows, ids } = out {
            // After the step (its graph ends in logits): the rows' samplers, then the ids.
            let pool = self.pool.as_mut().expect("validated");
            return super::sample::sample_rows(
                &self.dev,
                &self.ck.rows,
                &mut pool.sampling,
                logits,
                vocab,
                rows,
                ids,
            );
        }
        self.read_outputs(out, logits, ids, m)
    }

    /// Launches `plan`'s step through its captured graph, capturing it first if needed.
    fn replay_step(&mut self, plan: &StepPlan) -> DResult<()> {
        let pool = self.pool.as_ref().expect("validated");
        let key = GraphKey {
            rows: plan.t,
            greedy: plan.greedy,
            buffers: [plan.io, plan.logits, plan.ids, pool.q8_x.ptr()],
        };
        if pool.graphs_failed {
            return self.enqueue_step(plan);
        }
        if !pool.graphs.contains_key(&key) {
            let g = match self.dev.capture(|| self.enqueue_step(plan)) {
                Ok(g) => g,
                Err(e) => {
                    // Launched one by one from now on: slower, same results.
                    crate::facade::log::warn(&format!(
                        "batched decode steps run without CUDA graphs: {e}"
                    ));
                    self.pool.as_mut().expect("validated").graphs_failed = true;
                    return self.enqueue_step(plan);
                }
            };
            let pool = self.pool.as_mut().expect("validated");
            // A buffer that grew leaves graphs that point at the old one: drop them all then.
            if pool.graphs.len() >= MAX_STEP_GRAPHS
                || pool.graphs.keys().any(|k| k.buffers != key.buffers)
            {
                pool.graphs.clear();
            }
            pool.graphs.insert(key, g);
        }
        self.pool.as_ref().expect("validated").graphs[&key].launch()
    }

    /// Every launch of a step: embedding, layers, the wanted rows' logits (and their arg-max
    /// for greedy steps). Nothing here reads or writes host memory, so it can be captured.
    fn enqueue_step(&self, p: &StepPlan) -> DResult<()> {
        let (h, vocab) = (self.spec.hidden, self.spec.vocab);
        let (t, m, at) = (p.t, p.wanted.len(), &p.at);
        let i32_at = |i: usize| p.io + 4 * i as u64;
        let pf = self.pf.as_ref().expect("ensured");
        let embed = self.embed.as_ref().expect("whole model resident");
        self.embed_rows(embed, i32_at(at.tokens), t, pf.h.ptr())?;
        for l in 0..self.layers.len() {
            if p.by_rows {
                self.layer_by_rows(l, t, &i32_at, at)?;
                continue;
            }
            for stage in 0..Self::PREFILL_STAGES.len() {
                match (stage, &self.layer(l).ffn) {
                    (2, _) => self.rope_paged(l, t, i32_at(at.pos), i32_at(at.slot))?,
                    (3, _) => self.attention_paged(l, t, &i32_at, at)?,
                    (5..=7, DevFfn::Moe(m)) if p.moe_by_rows => {
                        if stage == 5 {
                            // The decode MoE block on each row in turn (routing stays on the
                            // device; each row reads only its chosen experts).
                            let norm = self.layer(l).ffn_norm.ptr();
                            for r in 0..t {
                                let x = pf.h.ptr() + 4 * (r * h) as u64;
                                self.moe_decode_up(x, norm, m)?;
                                self.moe_decode_down(x, m)?;
                            }
                        }
                    }
                    _ => self.prefill_stage(l, t, stage)?,
                }
            }
        }
        if m == 0 {
            return Ok(());
        }
        let pk = &self.pool.as_ref().expect("validated").kernels;
        if p.by_rows {
            // Each wanted row through the decode head (final norm fused).
            for (j, &row) in p.wanted.iter().enumerate() {
                let x = pf.h.ptr() + 4 * (row * h) as u64;
                self.enqueue_head_decode(x, p.logits + 4 * (j * vocab) as u64)?;
            }
        } else {
            // The wanted rows, gathered into pf.xn, normed into pf.h (free once the layers
            // ran).
            self.dev.launch(
                &pk.gather_rows,
                (m as u32, 1, 1),
                (256, 1, 1),
                0,
                &[
                    Arg::Ptr(pf.h.ptr()),
                    Arg::Ptr(i32_at(at.last)),
                    Arg::I32(h as i32),
                    Arg::Ptr(pf.xn.ptr()),
                ],
            )?;
            let head = self.head_weight().expect("whole model resident");
            let norm = self
                .final_norm
                .as_ref()
                .expect("whole model resident")
                .ptr();
            self.rmsnorm_rows(pf.xn.ptr(), norm, m, h, pf.h.ptr())?;
            self.to_bf16(pf.h.ptr(), m * h, pf.xb.ptr())?;
            self.gemm(head, pf.h.ptr(), pf.xb.ptr(), m, p.logits, vocab, 0, false)?;
        }
        if p.greedy {
            self.dev.launch(
                &pk.argmax_rows,
                (m as u32, 1, 1),
                (1024, 1, 1),
                0,
                &[Arg::Ptr(p.logits), Arg::I32(vocab as i32), Arg::Ptr(p.ids)],
            )?;
        }
        Ok(())
    }

    /// Reads the step's logits `[m, V]` at `logits` back, or their arg-max from `ids`.
    fn read_outputs(&self, out: BatchOut, logits: u64, ids: u64, m: usize) -> DResult<()> {
        let vocab = self.spec.vocab;
        match out {
            BatchOut::Logits(dst) => self.dev.download_f32(dst, logits),
            BatchOut::Sampled { .. } => Err(DevError(
                "sampled outputs are drawn by the rows' samplers, not read back".into(),
            )),
            BatchOut::Greedy(dst) => {
                let mut raw = vec![0i32; m];
                // SAFETY: i32 has no invalid bit patterns; the view covers exactly `raw`.
                let bytes =
                    unsafe { std::slice::from_raw_parts_mut(raw.as_mut_ptr() as *mut u8, 4 * m) };
                self.dev.download(bytes, ids)?;
                if let Some(r) = raw.iter().find(|&&r| r < 0 || r as usize >= vocab) {
                    return Err(DevError(format!(
                        "device arg-max {r} outside the vocabulary"
                    )));
                }
                for (d, &r) in dst.iter_mut().zip(&raw) {
                    *d = r as u32;
                }
                Ok(())
            }
        }
    }

    /// Layer `l` over the `t` rows of pf.h with the decode matvecs, row by row, around the
    /// paged kernels (which add the q/k/v biases, as in the GEMM path).
    fn layer_by_rows(
        &self,
        l: usize,
        t: usize,
        i32_at: &dyn Fn(usize) -> u64,
        at: &Inputs,
    ) -> DResult<()> {
        let (s, pf) = (&self.spec, self.pf.as_ref().expect("prefill workspace"));
        let d = self.layers[l].as_ref().expect("whole model resident");
        // MoE models never run row by row (`enqueue_batch_step`).
        let DevFfn::Dense(mlp) = &d.ffn else {
            return Err(DevError(format!(
                "layer {l}: row-by-row steps run dense FFNs only"
            )));
        };
        let (h, q, i) = (s.hidden, s.q_dim(), s.intermediate);
        let ld = q + 2 * s.kv_dim();
        let mv = |segs: &[MvSeg], x: u64, norm: u64, y: u64, mode: MvMode| {
            matvec::launch(
                &self.dev,
                &self.ck.matvec,
                segs,
                x,
                norm,
                s.rms_eps,
                y,
                mode,
                false,
            )
        };
        let seg = |w| MvSeg { w, bias: 0 };
        let row = |buf: u64, r: usize, width: usize| buf + 4 * (r * width) as u64;
        for r in 0..t {
            mv(
                &[seg(&d.q), seg(&d.k), seg(&d.v)],
                row(pf.h.ptr(), r, h),
                d.attn_norm.ptr(),
                row(pf.qkv.ptr(), r, ld),
                MvMode::Store,
            )?;
        }
        self.rope_paged(l, t, i32_at(at.pos), i32_at(at.slot))?;
        self.attention_paged(l, t, i32_at, at)?;
        // pf.gu holds each row's SwiGLU output [I] (f32).
        for r in 0..t {
            let x = row(pf.h.ptr(), r, h);
            mv(
                &[seg(&d.o)],
                row(pf.attn.ptr(), r, q),
                0,
                x,
                MvMode::Accumulate,
            )?;
            let act = row(pf.gu.ptr(), r, i);
            mv(
                &[seg(&mlp.gate), seg(&mlp.up)],
                x,
                d.ffn_norm.ptr(),
                act,
                MvMode::SwiGlu,
            )?;
            mv(&[seg(&mlp.down)], act, 0, x, MvMode::Accumulate)?;
        }
        Ok(())
    }

    /// Bias, q/k norm, RoPE at each row's position; q into pf.qr, k and v into the pool.
    fn rope_paged(&self, l: usize, t: usize, row_pos: u64, row_slot: u64) -> DResult<()> {
        let (s, pf, d) = (
            &self.spec,
            self.pf.as_ref().expect("prefill workspace"),
            self.layers[l].as_ref().expect("whole model resident"),
        );
        let pool = self.pool.as_ref().expect("validated");
        let opt =
            |b: &Option<crate::cuda::runtime::device::DBuf>| b.as_ref().map_or(0, |b| b.ptr());
        let heads = s.num_heads + 2 * s.num_kv_heads;
        self.dev.launch(
            &pool.kernels.rope_rows_paged,
            (heads.div_ceil(4) as u32, t as u32, 1),
            (128, 1, 1),
            0,
            &[
                Arg::Ptr(pf.qkv.ptr()),
                Arg::I32((s.q_dim() + 2 * s.kv_dim()) as i32),
                Arg::Ptr(opt(&d.q_bias)),
                Arg::Ptr(opt(&d.k_bias)),
                Arg::Ptr(opt(&d.v_bias)),
                Arg::Ptr(opt(&d.q_norm)),
                Arg::Ptr(opt(&d.k_norm)),
                Arg::F32(s.rms_eps),
                Arg::Ptr(self.inv_freq.ptr()),
                Arg::I32(s.rope.inv_freq.len() as i32),
                Arg::F32(s.rope.attention_factor),
                Arg::Ptr(row_pos),
                Arg::Ptr(row_slot),
                Arg::I32(s.num_heads as i32),
                Arg::I32(s.num_kv_heads as i32),
                Arg::Ptr(pf.qr.ptr()),
                Arg::Ptr(pool.k[l].ptr()),
                Arg::Ptr(pool.v[l].ptr()),
                Arg::I32((pool.shape.blocks * pool.shape.block_size) as i32),
            ],
        )
    }

    /// Each row of pf.qr over its sequence's positions in the pool, into pf.attn.
    fn attention_paged(
        &self,
        l: usize,
        t: usize,
        i32_at: &dyn Fn(usize) -> u64,
        at: &Inputs,
    ) -> DResult<()> {
        let (s, pf, d) = (
            &self.spec,
            self.pf.as_ref().expect("prefill workspace"),
            self.layers[l].as_ref().expect("whole model resident"),
        );
        let pool = self.pool.as_ref().expect("validated");
        let a = super::PagedAttention {
            q: pf.qr.ptr(),
            k_pool: pool.k[l].ptr(),
            v_pool: pool.v[l].ptr(),
            pool_positions: pool.shape.blocks * pool.shape.block_size,
            row_pos: i32_at(at.pos),
            row_seq: i32_at(at.seq),
            tables: i32_at(at.tables),
            tab_off: i32_at(at.tab_off),
            block_size: pool.shape.block_size,
            window: d.window,
            scale: s.attn_scale,
            geometry: (s.num_heads, s.num_kv_heads, s.head_dim),
            out: pf.attn.ptr(),
        };
        let kernel = if self.opts.batch_kernels == BatchKernels::Next {
            super::PagedKernel::Split(super::attention_splits(&self.dev, t, s.num_kv_heads))
        } else {
            super::PagedKernel::Rounds
        };
        super::paged_attention(
            &self.dev,
            &pool.kernels,
            &a,
            t,
            kernel,
            pool.attn_parts.ptr(),
        )
    }
}
