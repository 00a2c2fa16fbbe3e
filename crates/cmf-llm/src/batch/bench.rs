//! `cmf bench --parallel`: llama-batched-bench's contract (llama.cpp
//! `tools/batched-bench/batched-bench.cpp`) on the batched engine. For each count B of parallel
//! sequences, from an empty pool:
//! - PP: B prompts of `prompt_tokens` pseudo-random ids (distinct, so no prefix is shared),
//!   computed in steps of at most [`PP_STEP_TOKENS`] rows; `S_PP = B·PP / T_PP`;
//! - TG: `gen_tokens` steps, each decoding one token of every sequence (fed its arg-max, the work
//!   does not depend on the value); `S_TG = B·TG / T_TG`;
//! - total: `S = B·(PP + TG) / (T_PP + T_TG)`.
//!
//! One untimed warm-up step runs first; each B is measured once, as llama-batched-bench does.
//!
//! With a device ([`run`]'s `gpu`), the model is uploaded once with a pool for the largest B and
//! every B runs on it (arg-max on the device: one id per sequence comes back per step).

use super::device::{DeviceBatch, PoolSize};
use super::engine::{BatchConfig, BatchEngine, Work};
use crate::error::{LlmError, Result};
use crate::model::Model;
use crate::sampling::Xoshiro256;
use cmf_kernels::KvDtype;
use std::time::Instant;

/// Rows per prompt step (llama-batched-bench's default `n_batch` is 2048; the CPU's GEMM gains
/// little past a few hundred rows and the activations stay small).
pub const PP_STEP_TOKENS: usize = 512;

#[derive(Debug, Clone)]
pub struct BatchedBenchConfig {
    pub prompt_tokens: usize,
    pub gen_tokens: usize,
    /// Parallel sequence counts, one row each.
    pub parallel: Vec<usize>,
    pub kv_dtype: KvDtype,
}

/// One row of the table.
#[derive(Debug, Clone)]
pub struct BatchedBenchRow {
    pub pp: usize,
    pub tg: usize,
    pub b: usize,
    /// Positions in the pool at the end (B·(PP + TG)).
    pub n_kv: usize,
    pub t_pp: f64,
    pub t_tg: f64,
}

impl BatchedBenchRow {
    pub fn s_pp(&self) -> f64 {
        (self.b * self.pp) as f64 / self.t_pp.max(1e-9)
    }

    pub fn s_tg(&self) -> f64 {
        (self.b * self.tg) as f64 / self.t_tg.max(1e-9)
    }

    pub fn t(&self) -> f64 {
        self.t_pp + self.t_tg
    }

    pub fn s(&self) -> f64 {
        self.n_kv as f64 / self.t().max(1e-9)
    }
}

/// Runs the table on the CPU, or on `gpu`'s device when given (an error says why the device
/// cannot run it).
pub fn run(
    model: &Model,
    cfg: &BatchedBenchConfig,
    gpu: Option<&cmf_gpu::facade::Gpu>,
    progress: &mut dyn FnMut(usize),
) -> Result<Vec<BatchedBenchRow>> {
    if cfg.prompt_tokens == 0 {
        return Err(LlmError::Other(
            "the batched benchmark needs a prompt of at least one token".into(),
        ));
    }
    let vocab = model.config.vocab_size as u64;
    let mut rng = Xoshiro256::seed(1234);
    let mut rows = Vec::new();
    let len = cfg.prompt_tokens + cfg.gen_tokens;
    let per_seq = len.div_ceil(BatchConfig::BLOCK_SIZE) + 1;
    let most = cfg.parallel.iter().copied().max().unwrap_or(1);
    let mut device = match gpu {
        Some(g) => Some(
            DeviceBatch::load(
                g,
                model,
                len + 1,
                PP_STEP_TOKENS.max(most),
                BatchConfig::BLOCK_SIZE,
                PoolSize::Blocks(most * per_seq),
                crate::gpu::device_kv(cfg.kv_dtype),
            )
            .map_err(|why| LlmError::Other(format!("GPU: {why}")))?,
        ),
        None => None,
    };
    for &b in &cfg.parallel {
        let bc = BatchConfig {
            block_size: BatchConfig::BLOCK_SIZE,
            kv_blocks: b * per_seq,
            kv_dtype: cfg.kv_dtype,
            max_seq_len: len + 1,
        };
        let mut engine = match device.take() {
            Some(d) => BatchEngine::on_device(model, bc, d)?,
            None => BatchEngine::new(model, bc)?,
        };
        // Warm-up: one short step, then the sequence is dropped.
        let w = engine.add(vec![1, 2, 3, 4])?;
        engine.reserve(w, 4);
        engine.step_greedy(&[Work { seq: w, tokens: 4 }])?;
        engine.remove(w);

        let mut seqs = Vec::with_capacity(b);
        for _ in 0..b {
            let ids = (0..cfg.prompt_tokens)
                .map(|_| (rng.next_u64() % vocab) as u32)
                .collect();
            seqs.push(engine.add(ids)?);
        }
        let t = Instant::now();
        let mut last = Vec::with_capacity(b);
        while seqs.iter().any(|&s| engine.pending(s) > 0) {
            let mut budget = PP_STEP_TOKENS;
            let mut work = Vec::new();
            for &s in &seqs {
                let n = engine.pending(s).min(budget);
                if n == 0 {
                    continue;
                }
                if !engine.reserve(s, n) {
                    return Err(LlmError::Other("bench: the KV pool is too small".into()));
                }
                work.push(Work { seq: s, tokens: n });
                budget -= n;
                if budget == 0 {
                    break;
                }
            }
            last.extend(engine.step_greedy(&work)?);
        }
        let t_pp = t.elapsed().as_secs_f64();

        let t = Instant::now();
        let mut next = last;
        let work: Vec<Work> = seqs.iter().map(|&s| Work { seq: s, tokens: 1 }).collect();
        for _ in 0..cfg.gen_tokens {
            for (&s, &tok) in seqs.iter().zip(&next) {
                engine.push(s, tok)?;
                if !engine.reserve(s, 1) {
                    return Err(LlmError::Other("bench: the KV pool is too small".into()));
                }
            }
            next = engine.step_greedy(&work)?;
        }
        let t_tg = t.elapsed().as_secs_f64();
        if gpu.is_some() && !engine.is_device() {
            return Err(LlmError::Other(
                "GPU: the device refused a step (CMF_LOG=debug says why)".into(),
            ));
        }
        device = engine.into_device();
        rows.push(BatchedBenchRow {
            pp: cfg.prompt_tokens,
            tg: cfg.gen_tokens,
            b,
            n_kv: b * len,
            t_pp,
            t_tg,
        });
        progress(b);
    }
    Ok(rows)
}
