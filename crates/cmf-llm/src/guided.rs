//! The generation loop of [`crate::generate`] with the hooks an API needs: logit processors
//! (bias, grammar constraints) between the engine and the sampler, per-token log-probabilities,
//! the prompt's own log-probabilities (OpenAI's `echo`), and an answer that never ends in half a
//! character when the token budget cuts one.
//!
//! It is the one generation loop: [`crate::generate::generate_cancellable`] is this loop without
//! hooks. Without hooks a step's token may be drawn by the engine's own sampler (the device's,
//! `Engine::decode_sampled`); so may it when the only hooks are masks (a grammar): the engine
//! takes the mask as a bitset, computed here while the device runs the step
//! (`Engine::decode_masked`). With any other hook active the logits come to the host.

use crate::chat::Tokenizer;
use crate::engine::Engine;
use crate::error::Result;
use crate::generate::{FinishReason, GenerationConfig, GenerationStats, StopMatcher};
use crate::logits::{token_logprob, LogitProcessor, TokenLogprob};
use crate::sampling::{argmax, Sampler};
use std::time::{Duration, Instant};

/// What the loop does besides sampling.
#[derive(Default)]
pub struct Hooks<'h> {
    /// Applied in order to every step's logits.
    pub processors: Vec<&'h mut dyn LogitProcessor>,
    /// `Some(k)`: report each generated token's log-probability with the `k` most likely
    /// alternatives (`Some(0)`: the token's alone).
    pub logprobs: Option<usize>,
    /// `Some(k)`: also score the prompt (its first token has no log-probability).
    pub prompt_logprobs: Option<usize>,
}

/// What the loop reports as it goes.
pub enum Step<'a> {
    /// Log-probabilities of the prompt tokens from the second on, before generation starts.
    Prompt(Vec<TokenLogprob>),
    /// A generated token entered the answer (its text follows in `Text` once complete).
    Token(u32, Option<TokenLogprob>),
    /// A piece of answer text (never part of a stop string nor half a character).
    Text(&'a str),
}

/// Runs `prompt` (ids not yet in the engine's cache) and generates, as
/// [`crate::generate::generate_cancellable`] does, with `hooks`.
#[allow(clippy::too_many_arguments)]
pub fn generate_guided(
    engine: &mut dyn Engine,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    history: &mut Vec<u32>,
    cfg: &GenerationConfig,
    hooks: &mut Hooks,
    on_step: &mut dyn FnMut(Step),
    cancelled: &dyn Fn() -> bool,
) -> Result<GenerationStats> {
    let mut sampler = Sampler::new(cfg.sampling);
    let mut stops = StopMatcher::new(&cfg.stop_strings);
    let context = &prompt[prompt.len().saturating_sub(4)..];
    let mut decoder = tokenizer.text_decoder(context, true);
    let mut stats = GenerationStats {
        prompt_tokens: prompt.len(),
        generated_tokens: 0,
        prefill_time: Duration::ZERO,
        decode_steps: 0,
        decode_time: Duration::ZERO,
        time_to_first_token: Duration::ZERO,
        finish: FinishReason::Length,
    };
    if cancelled() {
        stats.finish = FinishReason::Cancelled;
        return Ok(stats);
    }
    let t0 = Instant::now();
    let mut logits = match hooks.prompt_logprobs {
        Some(k) => {
            let (scores, last) = score_prompt(engine, prompt, k)?;
            on_step(Step::Prompt(scores));
            history.extend_from_slice(prompt);
            last
        }
        None => {
            // The prompt goes in pieces the engine would run as one pass anyway (so the logits
            // are the same), with a cancellation check between them: a long prompt whose client
            // left stops within one piece instead of after the whole prefill.
            let piece = engine.prefill_piece().max(1);
            let parts: Vec<&[u32]> = match prompt.is_empty() {
                true => vec![prompt], // the engine's own error for an empty prefill
                false => prompt.chunks(piece).collect(),
            };
            let last = parts.len() - 1;
            let mut logits = Vec::new();
            for (i, part) in parts.into_iter().enumerate() {
                if i > 0 && cancelled() {
                    stats.prefill_time = t0.elapsed();
                    stats.finish = FinishReason::Cancelled;
                    return Ok(stats);
                }
                let out = engine.prefill(part)?;
                history.extend_from_slice(part);
                if i == last {
                    logits = out.to_vec();
                }
            }
            logits
        }
    };
    stats.prefill_time = t0.elapsed();
    // Without hooks the engine may sample on its own (the device: only token ids come back).
    let plain = hooks.processors.is_empty() && hooks.logprobs.is_none();
    // Only masks: the engine may apply them and draw on its own too.
    let masked = !hooks.processors.is_empty()
        && hooks.processors.iter().all(|p| p.masks_only())
        && hooks.logprobs.is_none();
    let spec = cfg.sampling;
    // The token the engine drew on its own sampler, when it did (then `logits` is stale).
    let mut drawn: Option<u32> = None;

    let emit = |text: &str, stops: &mut StopMatcher, on_step: &mut dyn FnMut(Step)| {
        let (out, hit) = stops.push(text);
        if !out.is_empty() {
            on_step(Step::Text(&out));
        }
        hit
    };
    let mut raw = Vec::new();
    while stats.generated_tokens < cfg.max_tokens {
        if hooks.processors.iter().any(|p| p.finished()) {
            stats.finish = FinishReason::Eos;
            break;
        }
        if hooks.logprobs.is_some() {
            raw.clone_from(&logits);
        }
        let token = match drawn.take() {
            // Drawn by the engine, after the masks (`mask_bits`) where there are any.
            Some(t) => {
                if !hooks.processors.iter().all(|p| p.allowed(t)) {
                    return Err(crate::error::LlmError::Other(format!(
                        "the device drew token {t}, which the grammar forbids"
                    )));
                }
                t
            }
            None => {
                for p in hooks.processors.iter_mut() {
                    p.process(&mut logits)?;
                }
                let mut token = sampler.sample(&mut logits, history);
                if !hooks.processors.iter().all(|p| p.allowed(token)) {
                    // The draw fell on a masked token through rounding: the best allowed one.
                    token = argmax(&logits);
                }
                token
            }
        };
        if stats.generated_tokens == 0 {
            stats.time_to_first_token = t0.elapsed();
        }
        for p in hooks.processors.iter_mut() {
            p.accept(token)?;
        }
        if cfg.eos_ids.contains(&token) {
            stats.finish = FinishReason::Eos;
            break;
        }
        stats.generated_tokens += 1;
        let lp = hooks.logprobs.map(|k| token_logprob(&raw, token, k));
        on_step(Step::Token(token, lp));
        if emit(&decoder.push(token)?, &mut stops, on_step) {
            stats.finish = FinishReason::Stop;
            return Ok(stats);
        }
        if stats.generated_tokens == cfg.max_tokens {
            break;
        }
        if engine.len() >= engine.limit() {
            stats.finish = FinishReason::ContextFull;
            break;
        }
        if cancelled() {
            stats.finish = FinishReason::Cancelled;
            return Ok(stats);
        }
        let t = Instant::now();
        if plain {
            drawn = engine.decode_sampled(token, &spec)?;
        } else if masked {
            let procs = &mut hooks.processors;
            let mut failed = None;
            drawn = engine.decode_masked(token, &spec, &mut |words: &mut [u32]| {
                for p in procs.iter_mut() {
                    if let Err(e) = p.mask_bits(words) {
                        failed.get_or_insert(e);
                    }
                }
            })?;
            // (When the engine declined, `process` computes the mask again next step.)
            if let (Some(e), Some(_)) = (failed, drawn) {
                return Err(e);
            }
        }
        if drawn.is_none() {
            logits.copy_from_slice(engine.decode(token)?);
        }
        stats.decode_time += t.elapsed();
        stats.decode_steps += 1;
        history.push(token);
    }
    // When the budget or the context cut the answer, a character it cut in half decodes to
    // one trailing U+FFFD (a lossy decode replaces an incomplete sequence by one): drop it.
    let mut tail = decoder.flush()?;
    if matches!(
        stats.finish,
        FinishReason::Length | FinishReason::ContextFull
    ) {
        if let Some(cut) = tail.strip_suffix('\u{FFFD}') {
            tail.truncate(cut.len());
        }
    }
    emit(&tail, &mut stops, on_step);
    let rest = stops.flush();
    if !rest.is_empty() {
        on_step(Step::Text(&rest));
    }
    Ok(stats)
}

/// Runs the prompt keeping every position's logits: the log-probability of each token from the
/// second on, and the last position's logits (where generation starts).
fn score_prompt(
    engine: &mut dyn Engine,
    prompt: &[u32],
    top: usize,
) -> Result<(Vec<TokenLogprob>, Vec<f32>)> {
    let mut scores = Vec::with_capacity(prompt.len().saturating_sub(1));
    let mut last = Vec::new();
    let n = prompt.len();
    engine.prefill_scored(prompt, &mut |i, logits| {
        if i + 1 < n {
            scores.push(token_logprob(logits, prompt[i + 1], top));
        } else {
            last = logits.to_vec();
        }
    })?;
    Ok((scores, last))
}
