//! `cmf bench`: prompt processing and generation throughput, following llama-bench's contract
//! (llama.cpp `tools/llama-bench/llama-bench.cpp`, `test_prompt` / `test_gen`):
//! - `pp<N>`: N prompt tokens in one batch (chunked internally as prefill always is) from an
//!   empty cache; logits only for the last token; speed = N / time.
//! - `tg<N>`: N tokens decoded one at a time from an empty cache, each step computing its
//!   logits (no sampling, as llama-bench); speed = N / time.
//! - Tokens are pseudo-random ids (llama-bench: `rand() % n_vocab`; here a fixed-seed
//!   xoshiro256**), after one untimed warm-up run of each test; each repetition starts from an
//!   empty cache. Reported: mean ± sample standard deviation of the per-repetition tok/s.
//! - On the GPU, tg feeds each step the token the device's arg-max drew, as generation does:
//!   the work of a step does not depend on the token's value, and a fed-back token lets the
//!   device run the next step's graph while the host reads this one's token (decode ahead).
//!   Fed random ids instead, every step launched ahead would be thrown away and run again.

use crate::error::Result;
use crate::gpu::{refused, GpuModel};
use crate::model::Model;
use crate::sampling::Xoshiro256;
use cmf_gpu::llm::{Logits, Sampler};
use cmf_kernels::KvDtype;
use std::time::Instant;

#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// Prompt tokens of the pp test (0 = skip).
    pub prompt_tokens: usize,
    /// Generated tokens of the tg test (0 = skip).
    pub gen_tokens: usize,
    pub repetitions: usize,
    pub kv_dtype: KvDtype,
}

#[derive(Debug, Clone)]
pub struct BenchResult {
    /// `pp512`, `tg128`.
    pub test: String,
    pub n_prompt: usize,
    pub n_gen: usize,
    /// tok/s of each repetition.
    pub samples: Vec<f64>,
}

impl BenchResult {
    pub fn mean(&self) -> f64 {
        self.samples.iter().sum::<f64>() / self.samples.len().max(1) as f64
    }

    /// Sample standard deviation (n − 1), 0 for a single sample (llama-bench's `stdev`).
    pub fn stddev(&self) -> f64 {
        let n = self.samples.len();
        if n < 2 {
            return 0.0;
        }
        let m = self.mean();
        (self.samples.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt()
    }
}

/// Runs the pp and tg tests; `progress` is told each finished repetition.
pub fn run(
    model: &Model,
    cfg: &BenchConfig,
    progress: &mut dyn FnMut(&str, usize),
) -> Result<Vec<BenchResult>> {
    run_on(model, None, cfg, progress)
}

/// [`run`] on the device when `gpu` holds the model: pp is one device prefill, each tg step
/// one whole-token graph replay with the device's arg-max read back (4 bytes). A refusal is an
/// error here: a benchmark does not switch backends halfway.
pub fn run_on(
    model: &Model,
    mut gpu: Option<&mut GpuModel>,
    cfg: &BenchConfig,
    progress: &mut dyn FnMut(&str, usize),
) -> Result<Vec<BenchResult>> {
    let v = model.config.vocab_size;
    let vocab = model.config.vocab_size as u64;
    let mut rng = Xoshiro256::seed(1234);
    let mut random_ids =
        |n: usize| -> Vec<u32> { (0..n).map(|_| (rng.next_u64() % vocab) as u32).collect() };
    let mut results = Vec::new();

    if cfg.prompt_tokens > 0 {
        let mut st = model.new_state_with(cfg.prompt_tokens, cfg.kv_dtype)?;
        let ids = random_ids(cfg.prompt_tokens);
        let warm = &ids[..ids.len().min(32)];
        match gpu.as_deref_mut() {
            Some(g) => {
                g.prefill(warm, 0, Logits::Last, v).map_err(refused)?;
            }
            None => {
                model.prefill(&mut st, warm)?;
            }
        }
        let mut samples = Vec::new();
        for rep in 0..cfg.repetitions {
            st.clear();
            let t = Instant::now();
            match gpu.as_deref_mut() {
                Some(g) => {
                    g.prefill(&ids, 0, Logits::Last, v).map_err(refused)?;
                }
                None => {
                    model.prefill(&mut st, &ids)?;
                }
            }
            samples.push(cfg.prompt_tokens as f64 / t.elapsed().as_secs_f64());
            progress(&format!("pp{}", cfg.prompt_tokens), rep + 1);
        }
        results.push(BenchResult {
            test: format!("pp{}", cfg.prompt_tokens),
            n_prompt: cfg.prompt_tokens,
            n_gen: 0,
            samples,
        });
    }

    if cfg.gen_tokens > 0 {
        let mut st = model.new_state_with(cfg.gen_tokens, cfg.kv_dtype)?;
        let ids = random_ids(cfg.gen_tokens);
        match gpu.as_deref_mut() {
            Some(g) => {
                // Captures the graphs; the step launched ahead is settled by the next call.
                g.decode_sampled(ids[0], 0, &Sampler::Greedy)
                    .map_err(refused)?;
            }
            None => {
                model.decode(&mut st, ids[0])?;
            } // warm-up
        }
        let mut samples = Vec::new();
        for rep in 0..cfg.repetitions {
            st.clear();
            let t = Instant::now();
            match gpu.as_deref_mut() {
                Some(g) => {
                    // The last step launches nothing ahead, so no work spills into the
                    // next repetition's time.
                    let mut tok = ids[0];
                    for i in 0..ids.len() - 1 {
                        tok = g
                            .decode_sampled(tok, i, &Sampler::Greedy)
                            .map_err(refused)?;
                    }
                    g.decode(tok, ids.len() - 1, true).map_err(refused)?;
                }
                None => {
                    for &id in &ids {
                        model.decode(&mut st, id)?;
                    }
                }
            }
            samples.push(cfg.gen_tokens as f64 / t.elapsed().as_secs_f64());
            progress(&format!("tg{}", cfg.gen_tokens), rep + 1);
        }
        results.push(BenchResult {
            test: format!("tg{}", cfg.gen_tokens),
            n_prompt: 0,
            n_gen: cfg.gen_tokens,
            samples,
        });
    }
    Ok(results)
}
