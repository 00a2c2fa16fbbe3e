//! Continuous batching over a [`BatchEngine`]: requests join and leave between steps, each step
//! spends at most a token budget, admission is first come, first served.
//!
//! One concept covers prefill and decode (as vLLM's scheduler): a sequence has tokens known and
//! tokens computed; a step gives every decoding sequence its one token first, then the rest of
//! the budget to prompt chunks in arrival order, so a long prompt never stalls the others.
//!
//! Memory: a request is admitted when the blocks for its whole uncomputed prompt are available.
//! When the pool runs out mid-generation the youngest running sequence is preempted: its blocks
//! go back (published ones stay cached), it returns to the head of the queue and is recomputed
//! later — its prefix blocks usually still cached — and its sampled tokens are kept, so its
//! output is what it would have been. Cancelling frees a request's blocks at once.

use super::engine::{BatchEngine, SeqId, Work};
use crate::error::{LlmError, Result};
use crate::generate::FinishReason;
use crate::sampling::{Sampler, SamplingParams};
use std::collections::{HashMap, VecDeque};

/// Identifies a request (its sequence in the engine).
pub type RequestId = SeqId;

#[derive(Clone, Copy, Debug)]
pub struct SchedulerConfig {
    /// Most sequences in one step.
    pub max_running: usize,
    /// Most tokens one step computes (decode rows plus prompt chunks).
    pub step_tokens: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            max_running: 8,
            step_tokens: crate::model::PREFILL_CHUNK,
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct Request {
    pub prompt: Vec<u32>,
    /// At least 1.
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Sampling one of these ends the request; it is not emitted.
    pub eos_ids: Vec<u32>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// The request's next generated token.
    Token { id: RequestId, token: u32 },
    /// The request is over; its blocks are back in the pool.
    Finished { id: RequestId, reason: FinishReason },
}

/// Counters for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    pub running: usize,
    pub waiting: usize,
    pub preemptions: u64,
    /// Prompt tokens taken from the prefix cache instead of computed.
    pub prefix_tokens_reused: u64,
    /// Full prompt blocks looked up in the prefix cache at admission, and found there.
    pub prefix_queries: u64,
    pub prefix_hits: u64,
}

struct Entry {
    sampler: Sampler,
    max_tokens: usize,
    eos_ids: Vec<u32>,
    generated: usize,
}

pub struct Scheduler<'m, 'a> {
    engine: BatchEngine<'m, 'a>,
    cfg: SchedulerConfig,
    waiting: VecDeque<RequestId>,
    /// Oldest admission first: preemption takes from the back.
    running: Vec<RequestId>,
    entries: HashMap<RequestId, Entry>,
    preemptions: u64,
    reused: u64,
    queries: u64,
    logits: Vec<f32>,
}

impl<'m, 'a> Scheduler<'m, 'a> {
    pub fn new(engine: BatchEngine<'m, 'a>, cfg: SchedulerConfig) -> Result<Self> {
        if cfg.max_running == 0 || cfg.step_tokens == 0 {
            return Err(LlmError::Other(
                "the scheduler needs at least one sequence and one token per step".into(),
            ));
        }
        Ok(Scheduler {
            engine,
            cfg,
            waiting: VecDeque::new(),
            running: Vec::new(),
            entries: HashMap::new(),
            preemptions: 0,
            reused: 0,
            queries: 0,
            logits: Vec::new(),
        })
    }

    pub fn engine(&self) -> &BatchEngine<'m, 'a> {
        &self.engine
    }

    pub fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            running: self.running.len(),
            waiting: self.waiting.len(),
            preemptions: self.preemptions,
            prefix_tokens_reused: self.reused,
            prefix_queries: self.queries,
            prefix_hits: self.reused / self.engine.config().block_size as u64,
        }
    }

    /// No request waiting or running.
    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    /// Queues a request. Refused (nothing queued) when its ids are outside the vocabulary, it
    /// asks for no tokens, or its prompt could never fit the context or the whole pool.
    pub fn submit(&mut self, req: Request) -> Result<RequestId> {
        if req.max_tokens == 0 {
            return Err(LlmError::Other("max_tokens must be at least 1".into()));
        }
        let c = *self.engine.config();
        // The prompt plus the first generated token must fit the pool on its own.
        let pool_tokens = c.kv_blocks * c.block_size;
        if req.prompt.len() + 1 > pool_tokens {
            return Err(LlmError::ContextFull {
                needed: req.prompt.len() + 1,
                limit: pool_tokens,
            });
        }
        let id = self.engine.add(req.prompt)?;
        self.entries.insert(
            id,
            Entry {
                sampler: Sampler::new(req.sampling),
                max_tokens: req.max_tokens,
                eos_ids: req.eos_ids,
                generated: 0,
            },
        );
        self.waiting.push_back(id);
        Ok(id)
    }

    /// Ends a request at once, waiting or running (also in the middle of its prompt), and frees
    /// its blocks. False when the id is unknown (already finished).
    pub fn cancel(&mut self, id: RequestId) -> bool {
        if self.entries.remove(&id).is_none() {
            return false;
        }
        self.waiting.retain(|&r| r != id);
        self.running.retain(|&r| r != id);
        self.engine.remove(id);
        true
    }

    /// Admits, plans and runs one step; returns what it produced. A step with nothing to run
    /// returns no events.
    pub fn step(&mut self) -> Result<Vec<Event>> {
        self.admit();
        let mut events = Vec::new();
        let plan = self.plan(&mut events);
        if plan.is_empty() {
            return Ok(events);
        }
        // Items that reach their last known token get logits, in plan order.
        let sampled: Vec<RequestId> = plan
            .iter()
            .filter(|w| w.tokens == self.engine.pending(w.seq))
            .map(|w| w.seq)
            .collect();
        let logits = self.engine.step(&plan)?;
        self.logits.clear();
        self.logits.extend_from_slice(logits);
        let vocab = self.engine.model().config.vocab_size;
        for (j, id) in sampled.into_iter().enumerate() {
            let row = &mut self.logits[j * vocab..(j + 1) * vocab];
            let e = self
                .entries
                .get_mut(&id)
                .expect("running requests have entries");
            let token = e.sampler.sample(row, self.engine.tokens(id));
            if e.eos_ids.contains(&token) {
                self.finish(id, FinishReason::Eos, &mut events);
                continue;
            }
            events.push(Event::Token { id, token });
            e.generated += 1;
            if e.generated >= e.max_tokens {
                self.finish(id, FinishReason::Length, &mut events);
            } else if self.engine.push(id, token).is_err() {
                self.finish(id, FinishReason::ContextFull, &mut events);
            }
        }
        Ok(events)
    }

    fn finish(&mut self, id: RequestId, reason: FinishReason, events: &mut Vec<Event>) {
        self.cancel(id);
        events.push(Event::Finished { id, reason });
    }

    /// FCFS: the head of the queue joins while there is room for its uncomputed prompt.
    fn admit(&mut self) {
        while self.running.len() < self.cfg.max_running {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            let reused = self.engine.reuse_prefix(id);
            let need = self.engine.blocks_needed(id, self.engine.pending(id));
            if need > self.engine.blocks_available() {
                // Wait; give the reused blocks back so they stay evictable meanwhile.
                self.engine.release(id);
                break;
            }
            // Counted once per admission (a head that waits looks up again next step); a model
            // that takes no prefix hits looks nothing up.
            let bs = self.engine.config().block_size;
            if self.engine.reuses_prefixes() {
                self.queries += ((self.engine.tokens(id).len() - 1) / bs) as u64;
            }
            self.reused += reused as u64;
            self.waiting.pop_front();
            self.running.push(id);
        }
    }

    /// This step's work: each decoding sequence's token, then prompt chunks, within the budget;
    /// blocks reserved, preempting the youngest when the pool is short.
    fn plan(&mut self, events: &mut Vec<Event>) -> Vec<Work> {
        let mut budget = self.cfg.step_tokens;
        let mut plan: Vec<Work> = Vec::new();
        let decoding: Vec<RequestId> = self
            .running
            .iter()
            .copied()
            .filter(|&id| self.engine.pending(id) == 1)
            .collect();
        let prefilling: Vec<RequestId> = self
            .running
            .iter()
            .copied()
            .filter(|&id| self.engine.pending(id) > 1)
            .collect();
        for id in decoding.into_iter().chain(prefilling) {
            if budget == 0 {
                break;
            }
            if !self.running.contains(&id) {
                continue; // preempted while planning an older sequence
            }
            let n = self.engine.pending(id).min(budget);
            if self.reserve(id, n, &mut plan, events) {
                plan.push(Work { seq: id, tokens: n });
                budget -= n;
            }
        }
        plan
    }

    /// Reserves blocks for `n` tokens of `id`, preempting younger sequences (and dropping them
    /// from `plan`) until it fits. False when `id` itself had to give way.
    fn reserve(
        &mut self,
        id: RequestId,
        n: usize,
        plan: &mut Vec<Work>,
        events: &mut Vec<Event>,
    ) -> bool {
        while !self.engine.reserve(id, n) {
            let victim = *self.running.last().expect("id is running");
            if victim == id && self.running.len() == 1 {
                // Alone and still short: the pool is this sequence's context limit.
                self.finish(id, FinishReason::ContextFull, events);
                return false;
            }
            self.preempt(victim);
            plan.retain(|w| w.seq != victim);
            if victim == id {
                return false;
            }
        }
        true
    }

    fn preempt(&mut self, id: RequestId) {
        self.engine.release(id);
        self.running.retain(|&r| r != id);
        self.waiting.push_front(id);
        self.preemptions += 1;
    }
}
