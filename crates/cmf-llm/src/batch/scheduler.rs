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
//!
//! Each sampled row gets its request's own treatment on the host, as `crate::guided` gives it:
//! logit processors (bias, grammar mask), seeded sampling with penalties over the sequence's
//! tokens, and log-probabilities from the unprocessed logits. A request with `n` choices is one
//! sequence until its prompt's logits come; then `n - 1` forks share its blocks
//! ([`BatchEngine::fork`]) and every choice samples its first token from those logits. On a
//! device, a step whose every row needs nothing but its sampler (no processors, log-probabilities
//! or choices to fork; a sampler within the device's limits) draws on the device instead
//! ([`BatchEngine::step_sampled`]): the same tokens, one id per sequence read back.
//!
//! A request that wants its prompt's own log-probabilities (OpenAI's `echo`) has every prompt
//! row's logits returned by the steps that compute its prompt (the other sequences of the step
//! keep their last row only); it takes no cached prefix, since a cached row has no logits.

use super::engine::{BatchEngine, SeqId, Work};
use crate::error::{LlmError, Result};
use crate::generate::FinishReason;
use crate::logits::{token_logprob, LogitProcessor, TokenLogprob};
use crate::sampling::{argmax, Sampler, SamplingParams};
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
    /// Sampling one of these ends the choice; it is not emitted.
    pub eos_ids: Vec<u32>,
    /// Choices (0 counts as 1): the prompt is computed once, then each choice continues in a
    /// sequence of its own that shares the prompt's blocks. Choice `i` samples with seed
    /// `sampling.seed + i`, as one-at-a-time generation does.
    pub n: usize,
    /// `Some(k)`: each token's log-probability and its `k` most likely alternatives, from the
    /// logits before any processor (as `crate::guided` reports them).
    pub logprobs: Option<usize>,
    /// `Some(k)`: the prompt's log-probabilities too (each token from the second on, with its
    /// `k` most likely alternatives), in one [`Event::Prompt`] before the first token. Needs
    /// the CPU step (a device engine refuses the request).
    pub prompt_logprobs: Option<usize>,
}

/// One choice's logit processors (bias, grammar mask), applied in order before sampling.
pub type Processors = Vec<Box<dyn LogitProcessor>>;

#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// The log-probabilities of a request's prompt tokens from the second on (when asked),
    /// before its first token.
    Prompt {
        id: RequestId,
        logprobs: Vec<TokenLogprob>,
    },
    /// The next generated token of one choice of a request.
    Token {
        id: RequestId,
        choice: usize,
        token: u32,
        logprob: Option<TokenLogprob>,
    },
    /// One choice is over; its blocks are back in the pool.
    Finished {
        id: RequestId,
        choice: usize,
        reason: FinishReason,
    },
    /// A logit processor failed: every choice of the request ended, its blocks are back.
    Failed { id: RequestId, error: String },
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

/// A choice not yet forked: it starts when its request's prompt logits come.
struct Unforked {
    choice: usize,
    sampler: Sampler,
    processors: Processors,
}

/// A prompt's log-probabilities as its rows come.
struct PromptScores {
    /// Alternatives per token.
    top: usize,
    /// Of tokens 1..=len, in order (a row recomputed after preemption is not scored twice).
    scores: Vec<TokenLogprob>,
}

/// One sequence: one choice of a request.
struct Entry {
    request: RequestId,
    choice: usize,
    sampler: Sampler,
    processors: Processors,
    logprobs: Option<usize>,
    max_tokens: usize,
    eos_ids: Vec<u32>,
    generated: usize,
    /// The request's other choices, on its first sequence until the prompt's logits come.
    unforked: Vec<Unforked>,
    /// Until the prompt's last row: its log-probabilities, when asked.
    prompt_scores: Option<PromptScores>,
}

impl Entry {
    /// Whether this sequence's next token needs nothing but its sampler, and the device's
    /// batched sampler takes it (`RowSampling::device_limit`).
    fn device_sampled(&self) -> bool {
        let p = &self.sampler.params;
        self.processors.is_empty()
            && self.logprobs.is_none()
            && self.prompt_scores.is_none()
            && self.unforked.is_empty()
            && p.validate().is_ok()
            && p.device_limit().is_none()
    }

    /// Whether this sequence's next token is just the arg-max of its logits.
    fn plain_greedy(&self) -> bool {
        let p = &self.sampler.params;
        p.is_greedy()
            && !p.has_penalties()
            && self.processors.is_empty()
            && self.logprobs.is_none()
            && self.prompt_scores.is_none()
            && self.unforked.is_empty()
    }
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
    /// One choice's processed copy of a row.
    scratch: Vec<f32>,
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
            scratch: Vec::new(),
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

    /// Queues a request without logit processors. Refused (nothing queued) when its ids are
    /// outside the vocabulary, it asks for no tokens, or its prompt could never fit the context
    /// or the whole pool.
    pub fn submit(&mut self, req: Request) -> Result<RequestId> {
        self.submit_with(req, Vec::new())
    }

    /// Queues a request whose choices each apply their own processors: `processors` is empty
    /// or holds one list per choice.
    pub fn submit_with(&mut self, req: Request, processors: Vec<Processors>) -> Result<RequestId> {
        if req.max_tokens == 0 {
            return Err(LlmError::Other("max_tokens must be at least 1".into()));
        }
        let n = req.n.max(1);
        if !processors.is_empty() && processors.len() != n {
            return Err(LlmError::Other(format!(
                "{} processor lists for {n} choices",
                processors.len()
            )));
        }
        if req.prompt_logprobs.is_some() && self.engine.is_device() {
            return Err(LlmError::Other(
                "the prompt's log-probabilities need every prompt row's logits, which the \
                 device step does not return"
                    .into(),
            ));
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
        let prompt_scores = req.prompt_logprobs.map(|top| {
            self.engine.set_every_row(id, true);
            PromptScores {
                top,
                scores: Vec::new(),
            }
        });
        let mut processors = processors.into_iter();
        let mut choices = (0..n).map(|choice| {
            let mut sampling = req.sampling;
            sampling.seed = sampling.seed.wrapping_add(choice as u64);
            Unforked {
                choice,
                sampler: Sampler::new(sampling),
                processors: processors.next().unwrap_or_default(),
            }
        });
        let first = choices.next().expect("n is at least 1");
        self.entries.insert(
            id,
            Entry {
                request: id,
                choice: 0,
                sampler: first.sampler,
                processors: first.processors,
                logprobs: req.logprobs,
                max_tokens: req.max_tokens,
                eos_ids: req.eos_ids,
                generated: 0,
                unforked: choices.collect(),
                prompt_scores,
            },
        );
        self.waiting.push_back(id);
        Ok(id)
    }

    /// Ends a request (every choice) at once, waiting or running (also in the middle of its
    /// prompt), and frees its blocks. False when the id is unknown (already finished).
    pub fn cancel(&mut self, id: RequestId) -> bool {
        let seqs: Vec<SeqId> = self
            .entries
            .iter()
            .filter(|(_, e)| e.request == id)
            .map(|(&s, _)| s)
            .collect();
        seqs.iter().for_each(|&s| self.drop_sequence(s));
        !seqs.is_empty()
    }

    /// Ends one choice of a request (a stop string its caller found), freeing its blocks. False
    /// when it is unknown (already finished).
    pub fn cancel_choice(&mut self, id: RequestId, choice: usize) -> bool {
        let seq = self
            .entries
            .iter()
            .find(|(_, e)| e.request == id && e.choice == choice)
            .map(|(&s, _)| s);
        if let Some(seq) = seq {
            if !self.entries[&seq].unforked.is_empty() {
                // The other choices have not started: they go on from a sequence of their own.
                self.fork_choices(seq);
            }
            self.drop_sequence(seq);
        }
        seq.is_some()
    }

    fn drop_sequence(&mut self, seq: SeqId) {
        self.entries.remove(&seq);
        self.waiting.retain(|&r| r != seq);
        self.running.retain(|&r| r != seq);
        self.engine.remove(seq);
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
        // Each item's logits rows, in plan order: (sequence, first position, rows, whether
        // it reaches the last known token).
        let outputs: Vec<(SeqId, usize, usize, bool)> = plan
            .iter()
            .map(|w| {
                let e = &self.engine;
                let last = w.tokens == e.pending(w.seq);
                (w.seq, e.computed(w.seq), e.rows_out(w), last)
            })
            .filter(|o| o.2 > 0)
            .collect();
        // Greedy requests with nothing to process (no penalties, logprobs, biases, grammars or
        // choices still to fork) need only their arg-max: on a device that is one id a
        // sequence read back instead of a row of logits, and no host pass over the vocabulary.
        let plain = outputs.iter().all(|&(seq, _, n, last)| {
            last && n == 1 && self.entries.get(&seq).is_none_or(Entry::plain_greedy)
        });
        if plain {
            let ids = self.engine.step_greedy(&plan)?;
            for ((seq, ..), token) in outputs.into_iter().zip(ids) {
                if self.entries.contains_key(&seq) {
                    self.emit(seq, token, None, &mut events);
                }
            }
            return Ok(events);
        }
        // Sampled requests with nothing that needs their logits on the host (logprobs,
        // processors, choices still to fork) and samplers the device runs: on a device, each
        // sequence's token is drawn there (the host sampler's draw) and one id comes back.
        let specs: Option<Vec<SamplingParams>> = if self.engine.is_device() {
            outputs
                .iter()
                .map(|&(seq, _, n, last)| match self.entries.get(&seq) {
                    _ if !last || n != 1 => None,
                    Some(e) => e.device_sampled().then_some(e.sampler.params),
                    None => Some(SamplingParams::default()),
                })
                .collect()
        } else {
            None
        };
        if let Some(specs) = specs {
            let ids = self.engine.step_sampled(&plan, &specs)?;
            for ((seq, ..), token) in outputs.into_iter().zip(ids) {
                if self.entries.contains_key(&seq) {
                    self.emit(seq, token, None, &mut events);
                }
            }
            return Ok(events);
        }
        let logits = self.engine.step(&plan)?;
        let mut rows = std::mem::take(&mut self.logits);
        rows.clear();
        rows.extend_from_slice(logits);
        let vocab = self.engine.model().config.vocab_size;
        let mut at = 0;
        for (seq, start, n, last) in outputs {
            let block = &rows[at * vocab..(at + n) * vocab];
            at += n;
            if self
                .entries
                .get(&seq)
                .is_some_and(|e| e.prompt_scores.is_some())
            {
                self.score_prompt(seq, start, block, last, &mut events);
            }
            if !last {
                continue;
            }
            let row = &block[(n - 1) * vocab..];
            // Every choice of a request samples its first token from the prompt's logits.
            for seq in std::iter::once(seq).chain(self.fork_choices(seq)) {
                self.sample(seq, row, &mut events);
            }
        }
        self.logits = rows;
        Ok(events)
    }

    /// Scores the prompt rows `block` (positions from `start`) of `seq`: row `p` gives token
    /// `p + 1`'s log-probability. At the prompt's last row the scores go out and the engine
    /// returns only last rows again.
    fn score_prompt(
        &mut self,
        seq: SeqId,
        start: usize,
        block: &[f32],
        last: bool,
        events: &mut Vec<Event>,
    ) {
        let vocab = self.engine.model().config.vocab_size;
        let tokens = self.engine.tokens(seq);
        let e = self.entries.get_mut(&seq).expect("checked");
        let ps = e.prompt_scores.as_mut().expect("checked");
        for (i, row) in block.chunks_exact(vocab).enumerate() {
            let p = start + i;
            // Rows scored before a preemption are not scored again.
            if p + 1 < tokens.len() && p == ps.scores.len() {
                ps.scores.push(token_logprob(row, tokens[p + 1], ps.top));
            }
        }
        if last {
            let ps = e.prompt_scores.take().expect("checked");
            self.engine.set_every_row(seq, false);
            events.push(Event::Prompt {
                id: e.request,
                logprobs: ps.scores,
            });
        }
    }

    /// Starts the choices still waiting on `seq`'s prompt: one fork of it each, running.
    fn fork_choices(&mut self, seq: SeqId) -> Vec<SeqId> {
        let Some(e) = self.entries.get_mut(&seq) else {
            return Vec::new();
        };
        let unforked = std::mem::take(&mut e.unforked);
        let (request, logprobs, max_tokens, eos_ids) =
            (e.request, e.logprobs, e.max_tokens, e.eos_ids.clone());
        let mut forks = Vec::with_capacity(unforked.len());
        for u in unforked {
            let child = self.engine.fork(seq);
            self.entries.insert(
                child,
                Entry {
                    request,
                    choice: u.choice,
                    sampler: u.sampler,
                    processors: u.processors,
                    logprobs,
                    max_tokens,
                    eos_ids: eos_ids.clone(),
                    generated: 0,
                    unforked: Vec::new(),
                    prompt_scores: None,
                },
            );
            if self.running.contains(&seq) {
                self.running.push(child);
            } else {
                self.waiting.push_front(child);
            }
            forks.push(child);
        }
        forks
    }

    /// Samples `seq`'s next token from its logits `row` as `crate::guided` does: processors,
    /// sampler, a masked draw replaced by the best allowed token, log-probabilities of `row`.
    fn sample(&mut self, seq: SeqId, row: &[f32], events: &mut Vec<Event>) {
        let Some(e) = self.entries.get_mut(&seq) else {
            return; // its request failed earlier in this step
        };
        let id = e.request;
        if e.processors.iter().any(|p| p.finished()) {
            self.finish(seq, FinishReason::Eos, events);
            return;
        }
        self.scratch.clear();
        self.scratch.extend_from_slice(row);
        let logits = &mut self.scratch;
        let drawn = (|| {
            for p in e.processors.iter_mut() {
                p.process(logits)?;
            }
            let mut token = e.sampler.sample(logits, self.engine.tokens(seq));
            if !e.processors.iter().all(|p| p.allowed(token)) {
                // The draw fell on a masked token through rounding: take the best allowed one.
                token = argmax(logits);
            }
            for p in e.processors.iter_mut() {
                p.accept(token)?;
            }
            Ok::<u32, LlmError>(token)
        })();
        let token = match drawn {
            Ok(t) => t,
            Err(err) => {
                self.cancel(id);
                events.push(Event::Failed {
                    id,
                    error: err.to_string(),
                });
                return;
            }
        };
        let logprob = e.logprobs.map(|k| token_logprob(row, token, k));
        self.emit(seq, token, logprob, events);
    }

    /// `seq`'s next token is `token`: the end of its answer (an end-of-sequence id, its token
    /// budget, a full context) or a token event and the token appended.
    fn emit(
        &mut self,
        seq: SeqId,
        token: u32,
        logprob: Option<TokenLogprob>,
        events: &mut Vec<Event>,
    ) {
        let e = self.entries.get_mut(&seq).expect("a running sequence");
        let (id, choice) = (e.request, e.choice);
        if e.eos_ids.contains(&token) {
            self.finish(seq, FinishReason::Eos, events);
            return;
        }
        events.push(Event::Token {
            id,
            choice,
            token,
            logprob,
        });
        e.generated += 1;
        if e.generated >= e.max_tokens {
            self.finish(seq, FinishReason::Length, events);
        } else if self.engine.push(seq, token).is_err() {
            self.finish(seq, FinishReason::ContextFull, events);
        }
    }

    fn finish(&mut self, seq: SeqId, reason: FinishReason, events: &mut Vec<Event>) {
        let Some(e) = self.entries.get(&seq) else {
            return;
        };
        let (id, choice) = (e.request, e.choice);
        self.drop_sequence(seq);
        events.push(Event::Finished { id, choice, reason });
    }

    /// FCFS: the head of the queue joins while there is room for its uncomputed prompt (and
    /// its choices: a sequence each, and a block each for the copy of the prompt's last one).
    fn admit(&mut self) {
        while self.running.len() < self.cfg.max_running {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            let forks = self.entries[&id].unforked.len();
            if !self.running.is_empty() && self.running.len() + 1 + forks > self.cfg.max_running {
                break;
            }
            // A prompt being scored computes every row: no cached prefix.
            let reused = match self.entries[&id].prompt_scores {
                Some(_) => 0,
                None => self.engine.reuse_prefix(id),
            };
            let need = self.engine.blocks_needed(id, self.engine.pending(id)) + forks;
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
            // A hybrid's prompt chunk ends where its state is checkpointed.
            let n = self
                .engine
                .pending(id)
                .min(budget)
                .min(self.engine.until_checkpoint(id));
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
