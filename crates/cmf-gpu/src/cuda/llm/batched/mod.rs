//! The batched step on the device: the KV block pool (allocated from a byte budget by
//! `kv_pool`) and one forward pass over the rows of many sequences (`step.rs`).
//!
//! Every linear layer runs as one GEMM over all rows through the prefill path (`gemm`, any
//! codec); the per-row kernels (attention_paged.cu) put each row's keys and values in its pool
//! slot and attend each row to its sequence's positions through its block table. Greedy steps
//! pick each sequence's arg-max on the device (one id comes back per sequence); otherwise its
//! last-row logits come back and the caller samples, unless each sequence hands its sampler
//! over: then the device draws every sequence's token (`sample.rs`) and the ids come back.

mod q8;
pub use q8::q8_gemm_probe;
mod sample;
mod step;

use super::kernels::{PagedKernels, Q8GemmKernels};
use super::CudaLlm;
use crate::cuda::runtime::device::{DBuf, DResult, Dev};
use crate::facade::refusal::{Refusal, RefusalReason};
use crate::llm::batch::PoolShape;

/// The pool and the buffers of its steps.
pub(super) struct KvPool {
    pub shape: PoolShape,
    /// Per layer `[NKV, blocks · B, D]` keys and values (f16, or f32 as the single cache).
    k: Vec<DBuf>,
    v: Vec<DBuf>,
    kernels: PagedKernels,
    q8_kernels: Q8GemmKernels,
    /// The q8_row GEMMs' quantised input rows (`q8.rs`), grown on demand.
    q8_x: Grow,
    /// Captured decode steps (step.rs `replay_step`).
    graphs: std::collections::HashMap<step::GraphKey, crate::cuda::runtime::device::Graph>,
    /// A capture failed: steps launch one by one.
    graphs_failed: bool,
    /// Step inputs (i32) and outputs, grown on demand.
    io: Grow,
    logits: Grow,
    ids: Grow,
    /// The sampled rows' buffers (`sample.rs`).
    sampling: sample::RowSampleBufs,
    /// The split attention's partial outputs, sized for the largest step that splits.
    attn_parts: DBuf,
    /// The W8A16 GEMM's split partial sums (`q8.rs`).
    w8_parts: DBuf,
}

/// A device buffer that grows to the largest size asked for.
#[derive(Default)]
struct Grow(Option<DBuf>);

impl Grow {
    fn at_least(&mut self, dev: &Dev, bytes: usize) -> DResult<u64> {
        if self.0.as_ref().is_none_or(|b| b.len() < bytes) {
            self.0 = None;
            self.0 = Some(dev.alloc(bytes.max(4))?);
        }
        Ok(self.ptr())
    }

    /// The buffer's address (0 before the first `at_least`).
    fn ptr(&self) -> u64 {
        self.0.as_ref().map_or(0, |b| b.ptr())
    }
}

impl CudaLlm {
    /// Bytes one block of `block_size` positions takes over every layer.
    pub(super) fn pool_block_bytes(&self, block_size: usize) -> u64 {
        let elem = if self.kv_f32 { 4 } else { 2 };
        (2 * self.spec.num_layers * block_size * self.spec.kv_dim() * elem) as u64
    }

    /// Allocates the pool (the earlier one freed first): as many blocks as `bytes` holds.
    pub(super) fn alloc_pool(
        &mut self,
        bytes: u64,
        block_size: usize,
    ) -> Result<PoolShape, Refusal> {
        const OP: &str = "llm.kv_pool";
        let s = self.spec.clone();
        let group = s.num_heads / s.num_kv_heads;
        let shape_refusal = |m: String| Refusal::new(OP, RefusalReason::UnsupportedShape(m));
        if group > 32 {
            return Err(shape_refusal(format!(
                "{group} query heads per kv head (paged attention takes at most 32)"
            )));
        }
        if block_size == 0 {
            return Err(shape_refusal("block size 0".into()));
        }
        let per = self.pool_block_bytes(block_size);
        let blocks = (bytes / per) as usize;
        // Slots are i32 in the kernels.
        let blocks = blocks.min(i32::MAX as usize / block_size);
        if blocks == 0 {
            return Err(Refusal::new(
                OP,
                RefusalReason::OutOfMemory {
                    need: per,
                    budget: bytes,
                },
            ));
        }
        self.settle().map_err(|e| e.refusal(OP))?;
        self.pool = None;
        let err = |e: crate::cuda::runtime::device::DevError| e.refusal(OP);
        let kernels = PagedKernels::load(&self.dev, s.head_dim, group, self.kv_f32).map_err(err)?;
        let q8_kernels = Q8GemmKernels::load(&self.dev).map_err(err)?;
        let layer_bytes = (per / s.num_layers as u64) as usize / 2 * blocks;
        let mut k = Vec::with_capacity(s.num_layers);
        let mut v = Vec::with_capacity(s.num_layers);
        for _ in 0..s.num_layers {
            // Zeroed: a garbage row could be NaN, and a NaN times a zero weight is NaN.
            k.push(self.dev.alloc_zeroed(layer_bytes).map_err(err)?);
            v.push(self.dev.alloc_zeroed(layer_bytes).map_err(err)?);
        }
        let parts = split_scratch_bytes(&self.dev, s.num_heads, s.num_kv_heads, s.head_dim);
        let attn_parts = self.dev.alloc(parts).map_err(err)?;
        let w8_parts = self.dev.alloc(q8::w8_parts_bytes(&self.dev)).map_err(err)?;
        let shape = PoolShape { block_size, blocks };
        self.pool = Some(KvPool {
            shape,
            k,
            v,
            kernels,
            q8_kernels,
            q8_x: Grow::default(),
            graphs: Default::default(),
            graphs_failed: false,
            io: Grow::default(),
            logits: Grow::default(),
            ids: Grow::default(),
            sampling: Default::default(),
            attn_parts,
            w8_parts,
        });
        Ok(shape)
    }
}

/// Which paged attention kernel runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PagedKernel {
    /// `attn_paged`: a block per (row, kv head), its warps walking the keys in rounds of 32.
    Rounds,
    /// `attn_paged_split`: the keys split into this many runs, merged by `attn_paged_combine`.
    Split(usize),
}

impl PagedKernel {
    /// Runs each row's keys are split into (one for the rounds kernel).
    fn runs(self) -> usize {
        match self {
            PagedKernel::Rounds => 1,
            PagedKernel::Split(n) => n,
        }
    }
}

/// Most runs one row's keys are split into (`attn_paged_split`).
const MAX_SPLITS: usize = 32;

/// Runs each row's keys are split into in a step of `rows` rows: enough (row, kv head, run)
/// blocks for two waves over the multiprocessors. A decode step of a few sequences has few
/// (row, kv head) pairs and splits; a prefill step has plenty and takes one run. A function of
/// the row count alone, so a captured decode step stays valid as its sequences grow.
fn attention_splits(dev: &Dev, rows: usize, kv_heads: usize) -> usize {
    (2 * dev.sm_count as usize)
        .div_ceil(rows * kv_heads)
        .clamp(1, MAX_SPLITS)
}

/// Bytes of partial outputs ([T, NH, splits] rows of HD f32, then as many (max, sum) pairs)
/// the largest splitting step needs.
fn split_scratch_bytes(dev: &Dev, nh: usize, nkv: usize, hd: usize) -> usize {
    let per = |rows: usize, splits: usize| rows * nh * splits * (4 * hd + 8);
    (1..=2 * dev.sm_count as usize)
        .map(|rows| (rows, attention_splits(dev, rows, nkv)))
        .filter(|&(_, splits)| splits > 1)
        .map(|(rows, splits)| per(rows, splits))
        .max()
        .unwrap_or(0)
        .max(16)
}

/// What one paged attention launch reads and writes (attention_paged.cu `attn_paged_split`).
struct PagedAttention {
    q: u64,
    k_pool: u64,
    v_pool: u64,
    pool_positions: usize,
    row_pos: u64,
    row_seq: u64,
    tables: u64,
    tab_off: u64,
    block_size: usize,
    window: i32,
    scale: f32,
    geometry: (usize, usize, usize),
    out: u64,
}

/// Each of `rows` rows over its sequence's positions with `kernel`; split runs merge through
/// `parts` ([`split_scratch_bytes`]).
fn paged_attention(
    dev: &Dev,
    k: &PagedKernels,
    a: &PagedAttention,
    rows: usize,
    kernel: PagedKernel,
    parts: u64,
) -> DResult<()> {
    use crate::cuda::runtime::device::Arg;
    let (nh, nkv, hd) = a.geometry;
    let args = [
        Arg::Ptr(a.q),
        Arg::Ptr(a.k_pool),
        Arg::Ptr(a.v_pool),
        Arg::I32(a.pool_positions as i32),
        Arg::Ptr(a.row_pos),
        Arg::Ptr(a.row_seq),
        Arg::Ptr(a.tables),
        Arg::Ptr(a.tab_off),
        Arg::I32(a.block_size as i32),
        Arg::I32(a.window),
        Arg::F32(a.scale),
        Arg::I32(nh as i32),
        Arg::Ptr(a.out),
    ];
    if kernel == PagedKernel::Rounds {
        return dev.launch(
            &k.attn_paged,
            (rows as u32, nkv as u32, 1),
            ((32 * (nh / nkv)) as u32, 1, 1),
            0,
            &args,
        );
    }
    let splits = kernel.runs();
    let part_ml = parts + (4 * rows * nh * splits * hd) as u64;
    let mut split_args = args.to_vec();
    split_args.extend([Arg::Ptr(parts), Arg::Ptr(part_ml)]);
    dev.launch(
        &k.attn_paged_split,
        (rows as u32, nkv as u32, splits as u32),
        (128, 1, 1),
        0,
        &split_args,
    )?;
    if splits == 1 {
        return Ok(());
    }
    dev.launch(
        &k.attn_paged_combine,
        ((rows * nh) as u32, 1, 1),
        (128, 1, 1),
        0,
        &[
            Arg::Ptr(parts),
            Arg::Ptr(part_ml),
            Arg::I32(splits as i32),
            Arg::Ptr(a.out),
        ],
    )
}

/// Test hook: the paged attention alone over host inputs with `kernel`, in the layouts of [`crate::llm::batch::paged_attention_reference`] (pools rounded to
/// f16 unless `kv_f32`); returns `out [T, NH, D]`.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_probe(
    dev: &Dev,
    geometry: (usize, usize, usize),
    kv_f32: bool,
    q: &[f32],
    k_pool: &[f32],
    v_pool: &[f32],
    scale: f32,
    window: usize,
    row_pos: &[usize],
    row_seq: &[usize],
    tables: &[&[u32]],
    block_size: usize,
    kernel: PagedKernel,
) -> DResult<Vec<f32>> {
    use crate::cuda::runtime::device::bytes_of;
    let (nh, nkv, d) = geometry;
    let k = PagedKernels::load(dev, d, nh / nkv, kv_f32)?;
    let pool = |p: &[f32]| -> DResult<DBuf> {
        if kv_f32 {
            dev.upload_new(bytes_of(p))
        } else {
            let h: Vec<u16> = p
                .iter()
                .map(|&x| half::f16::from_f32(x).to_bits())
                .collect();
            dev.upload_new(bytes_of(&h))
        }
    };
    let (kp, vp) = (pool(k_pool)?, pool(v_pool)?);
    let ints = |v: &mut dyn Iterator<Item = usize>| -> DResult<DBuf> {
        let v: Vec<i32> = v.map(|x| x as i32).collect();
        dev.upload_new(bytes_of(&v))
    };
    let pos = ints(&mut row_pos.iter().copied())?;
    let seq = ints(&mut row_seq.iter().copied())?;
    let flat = ints(&mut tables.iter().flat_map(|t| t.iter().map(|&b| b as usize)))?;
    let offs = ints(&mut tables.iter().scan(0, |o, t| {
        let at = *o;
        *o += t.len();
        Some(at)
    }))?;
    let qd = dev.upload_new(bytes_of(q))?;
    let t = row_pos.len();
    let out = dev.alloc(4 * t * nh * d)?;
    let parts = dev.alloc(t * nh * kernel.runs() * (4 * d + 8))?;
    let a = PagedAttention {
        q: qd.ptr(),
        k_pool: kp.ptr(),
        v_pool: vp.ptr(),
        pool_positions: k_pool.len() / (nkv * d),
        row_pos: pos.ptr(),
        row_seq: seq.ptr(),
        tables: flat.ptr(),
        tab_off: offs.ptr(),
        block_size,
        window: window as i32,
        scale,
        geometry,
        out: out.ptr(),
    };
    paged_attention(dev, &k, &a, t, kernel, parts.ptr())?;
    let mut o = vec![0f32; t * nh * d];
    dev.download_f32(&mut o, out.ptr())?;
    Ok(o)
}
