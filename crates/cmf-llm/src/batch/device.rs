//! The batched engine's device side: the whole model resident on the GPU with its KV block pool,
//! each step one `batch_step` through the facade. The engine keeps every piece of bookkeeping
//! (tables, prefix cache, scheduling); the device holds the keys and values.
//!
//! What runs where: the forward pass of every row on the device; greedy arg-max steps
//! (`BatchEngine::step_greedy`) and steps whose rows need nothing but their samplers
//! (`BatchEngine::step_sampled`: penalties, temperature, top-k/top-p/min-p and the seeded draw)
//! bring back one id per sequence; any other step brings back the last-row logits and the host
//! samples.

use crate::gpu::{cpu_only, describe};
use crate::model::Model;
use cmf_gpu::facade::{Gpu, GpuLlm, Refusal};
use cmf_gpu::llm::batch::{BatchOut, BatchSeq, PoolShape};
use cmf_gpu::llm::{KvPrecision, LlmOptions};

/// How large the device pool is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolSize {
    /// As many blocks as these device bytes hold.
    Bytes(u64),
    /// This many blocks.
    Blocks(usize),
}

/// The model on the device with its pool.
pub struct DeviceBatch {
    llm: GpuLlm,
    shape: PoolShape,
    max_rows: usize,
}

impl std::fmt::Debug for DeviceBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBatch")
            .field("shape", &self.shape)
            .field("max_rows", &self.max_rows)
            .finish()
    }
}

impl DeviceBatch {
    /// Uploads `model` whole for sequences of up to `max_seq_len` tokens and steps of up to
    /// `max_rows` rows, and allocates its pool of `block_size`-position blocks, in the precision
    /// `kv` says (`crate::gpu::device_kv` of the CPU pool's). Err says why the device cannot
    /// (the caller runs the CPU engine then).
    pub fn load(
        gpu: &Gpu,
        model: &Model,
        max_seq_len: usize,
        max_rows: usize,
        block_size: usize,
        pool: PoolSize,
        kv: KvPrecision,
    ) -> Result<DeviceBatch, String> {
        if let Some(why) = cpu_only(model) {
            return Err(why.into());
        }
        if max_rows == 0 {
            return Err("a step needs at least one row".into());
        }
        let max_seq_len = max_seq_len.clamp(1, model.config.max_position_embeddings.max(1));
        let desc = describe(model, max_seq_len)?;
        // The single-sequence cache goes unused here: one block's worth keeps it small.
        let opts = LlmOptions {
            max_context: block_size.max(1),
            prefill_chunk: max_rows,
            kv,
            ..LlmOptions::default()
        };
        let mut llm = gpu
            .load_llm(&desc, &opts, None)
            .map_err(|r| r.to_string())?;
        if !llm.placement().is_whole_model() {
            return Err("only part of the model fits on the device".into());
        }
        let per = llm.kv_block_bytes(block_size);
        if per == 0 {
            return Err("the backend has no batched step".into());
        }
        let bytes = match pool {
            PoolSize::Bytes(b) => b,
            PoolSize::Blocks(n) => per.saturating_mul(n as u64),
        };
        let shape = llm.kv_pool(bytes, block_size).map_err(|r| r.to_string())?;
        Ok(DeviceBatch {
            llm,
            shape,
            max_rows,
        })
    }

    pub fn blocks(&self) -> usize {
        self.shape.blocks
    }

    pub fn block_size(&self) -> usize {
        self.shape.block_size
    }

    /// Most rows one step takes.
    pub fn max_rows(&self) -> usize {
        self.max_rows
    }

    /// One step; see `cmf_gpu::facade::GpuLlm::batch_step`.
    pub fn step(&mut self, seqs: &[BatchSeq], out: BatchOut) -> Result<(), Refusal> {
        self.llm.batch_step(seqs, out)
    }
}
