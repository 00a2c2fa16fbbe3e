//! The inference thread with `--parallel N` (N > 1): many requests generated at once on the
//! batched engine (`cmf_llm::batch`: paged KV pool, prefix reuse, continuous batching), its steps
//! and pool on the device when `build_batch_device` places them there, else on the CPU.
//!
//! The thread takes jobs from the bounded queue only while fewer than N requests are running
//! or waiting for KV memory, so the queue (and its 503 beyond `--queue`) keeps its meaning.
//! Between steps it drops the requests whose client went away (their blocks go back at once,
//! also in the middle of a prompt), then runs one step over all running requests, and turns
//! each sampled token into text (stop strings held back as in `cmf_llm::generate`).
//!
//! Every request kind joins the batch: log-probabilities, logit bias and grammars are applied to
//! each sequence's own logits after the step (`cmf_llm::batch::scheduler`), and `n` choices are
//! forks of one prompt computed once; a completions request that echoes its prompt with
//! log-probabilities gets every prompt row's logits from the steps that compute its prompt. Only
//! on a device batch, whose step returns last rows only, does such a request run alone on a
//! single-sequence CPU engine between steps, as the one-at-a-time worker runs it; the batch waits
//! meanwhile.

use crate::generation::{Event, Job};
use crate::observe::RequestRecord;
use crate::worker::{panic_message, Queued, StartError, Worker};
use cmf_llm::batch::{
    self, BatchConfig, BatchEngine, PoolSize, Processors, Request, RequestId, Scheduler,
};
use cmf_llm::chat::TextDecoder;
use cmf_llm::engine::CpuEngine;
use cmf_llm::generate::{FinishReason, GenerationStats, StopMatcher};
use cmf_llm::logits::{LogitProcessor, TokenLogprob};
use cmf_llm::Model;
use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// One request on the batched engine.
struct Active<'t> {
    job: Job,
    record: Arc<RequestRecord>,
    choices: Vec<Choice<'t>>,
    /// The prompt counted once, the choices' tokens together (as the one-at-a-time path).
    stats: GenerationStats,
    admitted: Instant,
    last_text: Option<Instant>,
}

/// One choice's text on its way out.
struct Choice<'t> {
    decoder: TextDecoder<'t>,
    stops: StopMatcher,
    /// Log-probabilities of tokens whose text is not out yet.
    logprobs: Vec<TokenLogprob>,
    done: bool,
}

impl Active<'_> {
    fn done(&self) -> bool {
        self.choices.iter().all(|c| c.done)
    }
}

/// Recurrent-state checkpoints a hybrid model keeps per stream unless `--state-cache` says
/// otherwise: a prompt takes up to five (its last block boundaries), a finished answer one.
pub(crate) const STATE_CACHE_PER_STREAM: usize = 8;

/// Bytes of the KV pool: `--kv-pool`, else `parallel` full contexts.
pub(crate) fn pool_bytes(
    c: &cmf_llm::ModelConfig,
    parallel: usize,
    ctx: usize,
    kv_pool_bytes: Option<usize>,
    kv_dtype: cmf_kernels::KvDtype,
) -> usize {
    let block = BatchConfig::block_bytes(c, BatchConfig::BLOCK_SIZE, kv_dtype);
    kv_pool_bytes.unwrap_or(parallel * ctx.div_ceil(BatchConfig::BLOCK_SIZE) * block)
}

/// Positions a pool of `bytes` holds.
pub(crate) fn pool_positions(
    c: &cmf_llm::ModelConfig,
    bytes: usize,
    kv_dtype: cmf_kernels::KvDtype,
) -> usize {
    let block = BatchConfig::block_bytes(c, BatchConfig::BLOCK_SIZE, kv_dtype).max(1);
    bytes / block * BatchConfig::BLOCK_SIZE
}

/// Whether a job needs the single-sequence path: the prompt's own log-probabilities need every
/// prompt row's logits, which a device step does not return.
fn needs_alone(job: &Job, sched: &Scheduler) -> bool {
    job.options.prompt_logprobs.is_some() && sched.engine().is_device()
}

/// Each choice's logit processors: the bias, then a fresh fork of the grammar.
fn processors(job: &Job) -> Vec<Processors> {
    let o = &job.options;
    if o.logit_bias.0.is_empty() && o.constraint.is_none() {
        return Vec::new();
    }
    (0..o.n.max(1))
        .map(|_| {
            let mut p: Processors = Vec::new();
            if !o.logit_bias.0.is_empty() {
                p.push(Box::new(o.logit_bias.clone()) as Box<dyn LogitProcessor>);
            }
            if let Some(c) = &o.constraint {
                p.push(Box::new(c.fork()));
            }
            p
        })
        .collect()
}

pub(crate) fn run(
    w: &Worker,
    model: &Model,
    ready: std::sync::mpsc::Sender<Result<(), StartError>>,
    mut rx: mpsc::Receiver<Queued>,
) {
    let budget = pool_bytes(
        &model.config,
        w.parallel,
        w.ctx,
        w.kv_pool_bytes,
        w.kv_dtype,
    );
    let cfg = BatchConfig::from_budget(model, budget, w.kv_dtype, w.ctx);
    let sched_cfg = batch::SchedulerConfig {
        max_running: w.parallel,
        ..Default::default()
    };
    // On the device when the builder places it there (its pool: `--kv-pool` device bytes, else
    // as many blocks as the CPU pool would have).
    let new_scheduler = || -> Result<Scheduler, String> {
        let device = match &w.batch_device {
            Some(b) => {
                let pool = match w.kv_pool_bytes {
                    Some(bytes) => PoolSize::Bytes(bytes as u64),
                    None => PoolSize::Blocks(cfg.kv_blocks),
                };
                b.build(model, w.ctx, sched_cfg.step_tokens, pool)?
            }
            None => None,
        };
        match device {
            Some(d) => BatchEngine::on_device(model, cfg, d),
            None => BatchEngine::new(model, cfg),
        }
        .and_then(|mut e| {
            let per_stream = STATE_CACHE_PER_STREAM * e.checkpoint_bytes(w.ctx);
            e.set_state_cache(w.state_cache_bytes.unwrap_or(w.parallel * per_stream));
            Scheduler::new(e, sched_cfg)
        })
        .map_err(|e| e.to_string())
    };
    let mut sched = match new_scheduler() {
        Ok(s) => s,
        Err(e) => {
            let _ = ready.send(Err(StartError::Other(format!("{}: {e}", w.path))));
            return;
        }
    };
    w.stats
        .kv_blocks_total
        .store(sched.engine().config().kv_blocks as u64, Ordering::Relaxed);
    // For the jobs that run alone (made on the first such job).
    let mut single: Option<CpuEngine> = None;
    let _ = ready.send(Ok(()));
    drop(ready);

    let tokenizer = &w.assets.tokenizer;
    let mut active: HashMap<RequestId, Active> = HashMap::new();
    let mut counted = 0;
    let mut closed = false;
    loop {
        // Take jobs while there is a slot (a choice takes one).
        while !closed && active.values().map(|a| a.choices.len()).sum::<usize>() < w.parallel {
            let next = if sched.is_idle() {
                rx.blocking_recv()
            } else {
                match rx.try_recv() {
                    Ok(q) => Some(q),
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => None,
                }
            };
            let Some(Queued { job, record }) = next else {
                closed = true;
                break;
            };
            if job.events.is_closed() {
                w.stats.cancelled.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            if needs_alone(&job, &sched) {
                w.stats.running.fetch_add(1, Ordering::Relaxed);
                if single.is_none() {
                    match CpuEngine::new(model, w.ctx, w.kv_dtype) {
                        Ok(e) => single = Some(e),
                        Err(e) => {
                            let _ = job.events.send(Event::Failed(e.to_string()));
                            w.stats.running.fetch_sub(1, Ordering::Relaxed);
                            continue;
                        }
                    }
                }
                let engine = single.as_mut().expect("built just above");
                if w.serve_one(engine, job, record) {
                    single = None; // it panicked: a fresh one next time
                }
                w.stats.running.fetch_sub(1, Ordering::Relaxed);
                continue;
            }
            let record = record.unwrap_or_default();
            record
                .prompt_tokens
                .store(job.ids.len() as u64, Ordering::Relaxed);
            let req = Request {
                prompt: job.ids.clone(),
                max_tokens: job.gen.max_tokens,
                sampling: job.gen.sampling,
                eos_ids: job.gen.eos_ids.clone(),
                n: job.options.n.max(1),
                logprobs: job.options.logprobs,
                prompt_logprobs: job.options.prompt_logprobs,
            };
            match sched.submit_with(req, processors(&job)) {
                Ok(id) => {
                    let context = &job.ids[job.ids.len().saturating_sub(4)..];
                    let choices = (0..job.options.n.max(1))
                        .map(|_| Choice {
                            decoder: tokenizer.text_decoder(context, true),
                            stops: StopMatcher::new(&job.gen.stop_strings),
                            logprobs: Vec::new(),
                            done: false,
                        })
                        .collect();
                    active.insert(
                        id,
                        Active {
                            choices,
                            stats: GenerationStats {
                                prompt_tokens: job.ids.len(),
                                generated_tokens: 0,
                                prefill_time: Duration::ZERO,
                                decode_steps: 0,
                                decode_time: Duration::ZERO,
                                time_to_first_token: Duration::ZERO,
                                finish: FinishReason::Length,
                            },
                            job,
                            record,
                            admitted: Instant::now(),
                            last_text: None,
                        },
                    );
                }
                Err(e) => {
                    w.stats.finished.fetch_add(1, Ordering::Relaxed);
                    let _ = job
                        .events
                        .send(Event::Failed(format!("generation failed: {e}")));
                }
            }
        }
        // Clients that went away: their blocks go back now.
        active.retain(|&id, a| {
            if a.job.events.is_closed() {
                sched.cancel(id);
                w.stats.cancelled.fetch_add(1, Ordering::Relaxed);
                false
            } else {
                true
            }
        });
        if sched.is_idle() {
            publish(w, &sched, &mut counted);
            if closed {
                return;
            }
            continue;
        }
        if let Some(d) = w.pacing {
            std::thread::sleep(d);
        }
        let events = match std::panic::catch_unwind(AssertUnwindSafe(|| sched.step())) {
            Ok(Ok(events)) => events,
            failed => {
                let msg = match failed {
                    Ok(Err(e)) => format!("generation failed: {e}"),
                    Err(p) => format!(
                        "internal error: the inference worker panicked: {}",
                        panic_message(&p)
                    ),
                    Ok(Ok(_)) => unreachable!(),
                };
                // Every running request fails; the next ones start on a fresh pool.
                for (_, a) in active.drain() {
                    w.stats.finished.fetch_add(1, Ordering::Relaxed);
                    let _ = a.job.events.send(Event::Failed(msg.clone()));
                }
                drop(sched);
                counted = 0;
                sched = match new_scheduler() {
                    Ok(s) => s,
                    Err(e) => {
                        eprintln!("cmf serve: {e}; the inference thread stops");
                        return;
                    }
                };
                continue;
            }
        };
        for e in events {
            let id = match e {
                batch::Event::Prompt { id, logprobs } => {
                    if let Some(a) = active.get(&id) {
                        let _ = a.job.events.send(Event::Prompt(logprobs));
                    }
                    continue;
                }
                batch::Event::Token {
                    id,
                    choice,
                    token,
                    logprob,
                } => {
                    let Some(a) = active.get_mut(&id) else {
                        continue;
                    };
                    match on_token(w, a, choice, token, logprob) {
                        Ok(false) => {}
                        Ok(true) => {
                            sched.cancel_choice(id, choice);
                            finish_choice(w, a, choice, FinishReason::Stop);
                        }
                        Err(msg) => {
                            sched.cancel(id);
                            fail(w, active.remove(&id).expect("present"), msg);
                            continue;
                        }
                    }
                    id
                }
                batch::Event::Finished { id, choice, reason } => {
                    let Some(a) = active.get_mut(&id) else {
                        continue;
                    };
                    finish_choice(w, a, choice, reason);
                    id
                }
                batch::Event::Failed { id, error } => {
                    if let Some(a) = active.remove(&id) {
                        fail(w, a, format!("generation failed: {error}"));
                    }
                    continue;
                }
            };
            if active.get(&id).is_some_and(Active::done) {
                let a = active.remove(&id).expect("present");
                w.stats.finished.fetch_add(1, Ordering::Relaxed);
                let _ = a.job.events.send(Event::Done(a.stats));
            }
        }
        publish(w, &sched, &mut counted);
    }
}

/// A choice's next token: its text (if complete) to the client. True when a stop string
/// appeared (the choice ends).
fn on_token(
    w: &Worker,
    a: &mut Active,
    choice: usize,
    token: u32,
    logprob: Option<TokenLogprob>,
) -> Result<bool, String> {
    let now = Instant::now();
    if a.stats.generated_tokens == 0 {
        a.stats.time_to_first_token = now - a.admitted;
        a.stats.prefill_time = a.stats.time_to_first_token;
    } else {
        a.stats.decode_steps += 1;
        a.stats.decode_time = now - a.admitted - a.stats.prefill_time;
    }
    a.stats.generated_tokens += 1;
    a.record
        .generated_tokens
        .store(a.stats.generated_tokens as u64, Ordering::Relaxed);
    w.stats.generated_tokens.fetch_add(1, Ordering::Relaxed);
    let c = &mut a.choices[choice];
    c.logprobs.extend(logprob);
    let text = c
        .decoder
        .push(token)
        .map_err(|e| format!("generation failed: {e}"))?;
    let (out, hit) = c.stops.push(&text);
    send_text(w, a, choice, out);
    Ok(hit)
}

/// Sends a piece of choice `choice`'s text with the log-probabilities of the tokens it
/// completes.
fn send_text(w: &Worker, a: &mut Active, choice: usize, text: String) {
    if text.is_empty() {
        return;
    }
    let now = Instant::now();
    a.record.first_text.get_or_init(|| now);
    if let Some(t) = a.last_text.replace(now) {
        w.stats.inter_token_latency.observe(now - t);
    }
    let logprobs = std::mem::take(&mut a.choices[choice].logprobs);
    let _ = a.job.events.send(Event::Text {
        choice,
        text,
        logprobs,
    });
}

/// Sends a choice's held-back text and its end.
fn finish_choice(w: &Worker, a: &mut Active, choice: usize, reason: FinishReason) {
    if a.choices[choice].done {
        return;
    }
    if reason != FinishReason::Stop {
        let c = &mut a.choices[choice];
        // As `cmf_llm::guided`: a cut character at the length limit is not shown.
        let mut tail = c.decoder.flush().unwrap_or_default();
        if matches!(reason, FinishReason::Length | FinishReason::ContextFull) {
            if let Some(cut) = tail.strip_suffix('\u{FFFD}') {
                tail.truncate(cut.len());
            }
        }
        let (out, _) = c.stops.push(&tail);
        let rest = c.stops.flush();
        send_text(w, a, choice, out + &rest);
    }
    let c = &mut a.choices[choice];
    c.done = true;
    a.stats.finish = reason;
    let _ = a.job.events.send(Event::ChoiceDone {
        choice,
        finish: reason,
        logprobs: std::mem::take(&mut c.logprobs),
    });
}

fn fail(w: &Worker, a: Active, msg: String) {
    w.stats.finished.fetch_add(1, Ordering::Relaxed);
    let _ = a.job.events.send(Event::Failed(msg));
}

/// The engine's gauges for `/metrics` and `/health`. `counted`: the engine's prompt rows
/// already added to the counter (0 for a fresh engine).
fn publish(w: &Worker, sched: &Scheduler, counted: &mut u64) {
    let rows = sched.engine().rows_computed().prompt;
    w.stats
        .prompt_tokens_computed
        .fetch_add(rows - *counted, Ordering::Relaxed);
    *counted = rows;
    let s = sched.stats();
    let p = sched.engine().pool_stats();
    let st = &w.stats;
    st.running.store(s.running as u64, Ordering::Relaxed);
    st.busy.store(s.running > 0, Ordering::Relaxed);
    st.waiting_for_memory
        .store(s.waiting as u64, Ordering::Relaxed);
    st.kv_blocks_in_use.store(p.held as u64, Ordering::Relaxed);
    st.prefix_queries.store(s.prefix_queries, Ordering::Relaxed);
    st.prefix_hits.store(s.prefix_hits, Ordering::Relaxed);
}
