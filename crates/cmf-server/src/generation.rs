//! One request's work on the inference thread: its choices generated one after the other over
//! the same cached prompt (`n` > 1 re-runs only the prompt's last token), with the request's
//! logit bias, grammar constraint and log-probabilities, reported as [`Event`]s.

use cmf_llm::chat::Tokenizer;
use cmf_llm::constraint::Constrained;
use cmf_llm::engine::Engine as LlmEngine;
use cmf_llm::generate::{FinishReason, GenerationConfig, GenerationStats};
use cmf_llm::guided::{generate_guided, Hooks, Step};
use cmf_llm::logits::{LogitBias, LogitProcessor, TokenLogprob};
use tokio::sync::mpsc;

pub struct Job {
    pub ids: Vec<u32>,
    pub gen: GenerationConfig,
    pub options: JobOptions,
    pub events: mpsc::UnboundedSender<Event>,
}

/// What a job asks for beyond plain sampling.
#[derive(Default)]
pub struct JobOptions {
    /// Choices to generate (at least 1); choice `i` samples with seed `seed + i`.
    pub n: usize,
    /// `Some(k)`: each answer token's log-probability and its `k` best alternatives.
    pub logprobs: Option<usize>,
    /// `Some(k)`: the prompt's log-probabilities too (completions' `echo`).
    pub prompt_logprobs: Option<usize>,
    pub logit_bias: LogitBias,
    /// The grammar every choice must match, unused (each choice gets a fork).
    pub constraint: Option<Constrained>,
}

#[derive(Debug)]
pub enum Event {
    /// The prompt's log-probabilities (from its second token on), before any answer text.
    Prompt(Vec<TokenLogprob>),
    /// A piece of choice `choice`'s text (never part of a stop string) and the log-probabilities
    /// of the tokens it completes.
    Text {
        choice: usize,
        text: String,
        logprobs: Vec<TokenLogprob>,
    },
    /// Choice `choice` ended; `logprobs` are its tokens whose text was never shown (cut by a
    /// stop string).
    ChoiceDone {
        choice: usize,
        finish: FinishReason,
        logprobs: Vec<TokenLogprob>,
    },
    /// Every choice ended; the stats count the prompt once and the answers' tokens together.
    Done(GenerationStats),
    /// Generation failed after the request was accepted.
    Failed(String),
}

/// Runs `job`'s choices on `engine` (whose cache is empty), sending events as they come.
pub fn run_job(
    engine: &mut dyn LlmEngine,
    tokenizer: &Tokenizer,
    job: &Job,
    cancelled: &dyn Fn() -> bool,
    on_text: &dyn Fn(),
) -> cmf_llm::Result<GenerationStats> {
    let o = &job.options;
    let events = &job.events;
    let ids = &job.ids;
    let mut total: Option<GenerationStats> = None;
    for choice in 0..o.n.max(1) {
        let mut cfg = job.gen.clone();
        cfg.sampling.seed = cfg.sampling.seed.wrapping_add(choice as u64);
        // Later choices keep the prompt's cache but its last token, which gives the logits.
        let (prompt, mut history) = if choice == 0 {
            (&ids[..], Vec::new())
        } else {
            engine.truncate(ids.len() - 1);
            (&ids[ids.len() - 1..], ids[..ids.len() - 1].to_vec())
        };
        let mut bias = o.logit_bias.clone();
        let mut constraint = o.constraint.as_ref().map(Constrained::fork);
        let mut processors: Vec<&mut dyn LogitProcessor> = Vec::new();
        if !bias.0.is_empty() {
            processors.push(&mut bias);
        }
        if let Some(c) = constraint.as_mut() {
            processors.push(c);
        }
        let mut hooks = Hooks {
            processors,
            logprobs: o.logprobs,
            prompt_logprobs: if choice == 0 { o.prompt_logprobs } else { None },
        };
        let mut pending = Vec::new();
        let mut on_step = |step: Step| match step {
            Step::Prompt(lp) => {
                let _ = events.send(Event::Prompt(lp));
            }
            Step::Token(_, lp) => pending.extend(lp),
            Step::Text(t) => {
                on_text();
                let _ = events.send(Event::Text {
                    choice,
                    text: t.to_string(),
                    logprobs: std::mem::take(&mut pending),
                });
            }
        };
        let stats = generate_guided(
            engine,
            tokenizer,
            prompt,
            &mut history,
            &cfg,
            &mut hooks,
            &mut on_step,
            cancelled,
        )?;
        let finish = stats.finish;
        total = Some(match total {
            None => stats,
            Some(mut t) => {
                t.generated_tokens += stats.generated_tokens;
                t.decode_steps += stats.decode_steps;
                t.decode_time += stats.decode_time;
                t.prefill_time += stats.prefill_time;
                t.finish = stats.finish;
                t
            }
        });
        if finish == FinishReason::Cancelled {
            break;
        }
        let _ = events.send(Event::ChoiceDone {
            choice,
            finish,
            logprobs: pending,
        });
    }
    Ok(total.expect("at least one choice ran"))
}
