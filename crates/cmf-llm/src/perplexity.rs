//! `cmf ppl`: teacher-forced perplexity over non-overlapping windows, as llama.cpp's
//! `llama-perplexity` computes it (`tools/perplexity/perplexity.cpp`, `perplexity()`), so the
//! numbers are comparable:
//! - the whole text is tokenized once (with the tokenizer's own BOS if it adds one);
//! - n_chunks = ⌊n_tokens / ctx⌋; chunk c is tokens `[c·ctx, (c+1)·ctx)`, evaluated from an
//!   empty cache at positions 0..ctx−1; if the tokenizer adds a BOS, the chunk's first token is
//!   replaced by it (llama.cpp: `tokens[batch_start] = bos` when `add_bos`);
//! - only the second half is scored: logits at positions ctx/2 .. ctx−2 predict tokens
//!   ctx/2+1 .. ctx−1 (ctx − 1 − ctx/2 tokens per chunk);
//! - NLL = −log_softmax(logits)[next] (max-subtracted, sum of exp in f64);
//!   PPL = exp(mean NLL); ± = PPL · sqrt(var(NLL) / (count − 1)), llama.cpp's estimate.

use crate::error::{LlmError, Result};
use crate::gpu::GpuModel;
use crate::model::Model;
use cmf_gpu::llm::Logits;
use cmf_kernels::KvDtype;

#[derive(Debug, Clone)]
pub struct PerplexityResult {
    pub n_tokens: usize,
    pub ctx: usize,
    pub chunks: usize,
    pub scored: usize,
    pub ppl: f64,
    pub ppl_stderr: f64,
    /// Mean NLL of each chunk's scored tokens.
    pub chunk_mean_nll: Vec<f64>,
}

/// Scores `tokens` in windows of `ctx`. `bos`: replace each chunk's first token by this id.
/// `max_chunks` limits the work (None = all); `progress(chunk, running_ppl)` after each chunk.
pub fn perplexity(
    model: &Model,
    tokens: &[u32],
    ctx: usize,
    bos: Option<u32>,
    max_chunks: Option<usize>,
    progress: &mut dyn FnMut(usize, f64),
) -> Result<PerplexityResult> {
    perplexity_on(model, None, tokens, ctx, bos, max_chunks, progress)
}

/// [`perplexity`] with each window run on the device when `gpu` holds the model (one prefill
/// returning every row's logits); after a refusal the remaining windows run on the CPU.
pub fn perplexity_on(
    model: &Model,
    mut gpu: Option<&mut GpuModel>,
    tokens: &[u32],
    ctx: usize,
    bos: Option<u32>,
    max_chunks: Option<usize>,
    progress: &mut dyn FnMut(usize, f64),
) -> Result<PerplexityResult> {
    if ctx < 4 {
        return Err(LlmError::Other(format!(
            "--ctx {ctx} is too small (at least 4)"
        )));
    }
    if tokens.len() < 2 * ctx {
        // llama-perplexity refuses the same way: it needs two windows' worth of tokens.
        return Err(LlmError::Other(format!(
            "the text has {} tokens; at least 2·ctx = {} are needed",
            tokens.len(),
            2 * ctx
        )));
    }
    let mut chunks = tokens.len() / ctx;
    if let Some(m) = max_chunks {
        chunks = chunks.min(m.max(1));
    }
    let first = ctx / 2;
    let mut st = model.new_state_with(ctx, KvDtype::F32)?;
    if st.kv.limit() < ctx {
        return Err(LlmError::Other(format!(
            "--ctx {ctx} exceeds the model's maximum positions {}",
            model.config.max_position_embeddings
        )));
    }
    let (mut sum, mut sum2, mut count) = (0f64, 0f64, 0usize);
    let mut chunk_mean_nll = Vec::with_capacity(chunks);
    let mut window = vec![0u32; ctx];
    for c in 0..chunks {
        window.copy_from_slice(&tokens[c * ctx..(c + 1) * ctx]);
        if let Some(b) = bos {
            window[0] = b;
        }
        st.clear();
        let (mut csum, mut ccount) = (0f64, 0usize);
        let mut score = |i: usize, logits: &[f32]| {
            if i + 1 < ctx {
                let nll = nll(logits, window[i + 1] as usize);
                csum += nll;
                sum2 += nll * nll;
                ccount += 1;
            }
        };
        let vocab = model.config.vocab_size;
        let on_device = match gpu
            .as_deref_mut()
            .map(|g| g.prefill(&window, 0, Logits::All, vocab))
        {
            Some(Ok(all)) => {
                for i in first..ctx {
                    score(i, &all[i * vocab..(i + 1) * vocab]);
                }
                true
            }
            Some(Err(_)) => {
                gpu = None; // refused (logged by the facade): the CPU runs the rest
                false
            }
            None => false,
        };
        if !on_device {
            model.forward_scored(&mut st, &window, first, score)?;
        }
        sum += csum;
        count += ccount;
        chunk_mean_nll.push(csum / ccount as f64);
        progress(c + 1, (sum / count as f64).exp());
    }
    let mean = sum / count as f64;
    let ppl = mean.exp();
    let var = sum2 / count as f64 - mean * mean;
    let ppl_stderr = if var > 0.0 && count > 1 {
        ppl * (var / (count - 1) as f64).sqrt()
    } else {
        0.0
    };
    Ok(PerplexityResult {
        n_tokens: tokens.len(),
        ctx,
        chunks,
        scored: count,
        ppl,
        ppl_stderr,
        chunk_mean_nll,
    })
}

/// −log softmax(logits)[target] (llama.cpp `log_softmax`: f32 max, f64 sum of exp).
fn nll(logits: &[f32], target: usize) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    -((logits[target] - max) as f64 - sum.ln())
}

#[cfg(test)]
mod tests {
    #[test]
    fn nll_of_uniform_logits_is_log_vocab() {
        let l = vec![0.5f32; 8];
        assert!((super::nll(&l, 3) - (8f64).ln()).abs() < 1e-12);
    }
}
