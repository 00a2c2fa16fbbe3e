//! The batched engine: it owns every sequence's state (its tokens, how many of them are in the
//! KV pool, its block table) and runs one step over any set of them, each contributing one token
//! (decode) or a chunk of its prompt (prefill).
//!
//! Rules the engine keeps:
//! - a sequence writes only blocks it holds alone and has not published
//!   ([`BlockPool::is_exclusive`]); a step that would break this is refused, never run;
//! - a block is published for prefix reuse as soon as all its positions are computed;
//! - a forked sequence shares its parent's blocks (one more reference each); before it writes
//!   into a shared, partly filled block it takes a private copy (copy on write), so the blocks of
//!   a prompt with several choices are computed once;
//! - prefix reuse covers whole blocks and stops one token short of the known tokens, so the last
//!   known token is always computed (its logits are what the caller wants) into a private block;
//! - a hybrid (GatedDeltaNet) model's sequence holds a recurrent-state slot from its first
//!   reservation until its blocks go back ([`super::recurrent`]). A cached block carries no
//!   recurrent state, so such a sequence takes prefix hits only with the state cache on
//!   ([`BatchEngine::set_state_cache`], [`super::state_cache`]): the longest cached prefix whose
//!   blocks are all in the pool *and* whose end has a state checkpoint. It checkpoints its state
//!   at a few block boundaries of its prompt (the last one and some before it, and the end of
//!   the cached blocks it found without a checkpoint: where its prompt parted from an earlier
//!   one; the scheduler ends prompt chunks there, [`BatchEngine::until_checkpoint`]) and, when its
//!   blocks go back, at the last block boundary it passed while generating.

use super::blocks::{BlockId, BlockPool, PoolStats};
use super::device::DeviceBatch;
use super::recurrent::{RecurrentSlots, SlotId};
use super::state_cache::{StateCache, StateCacheStats};
use crate::error::{LlmError, Result};
use crate::model::{
    Activations, GdnState, LayerKv, Mixer, Model, ModelConfig, RowLogits, Segment, SeqRows,
};
use cmf_gpu::llm::batch::{BatchOut, BatchSeq, RowSampling};
use cmf_gpu::llm::sample::SampleSpec;
use cmf_kernels::{AttnParams, KvBlocks, KvDtype};
use std::collections::HashMap;

/// Identifies a sequence within one engine.
pub type SeqId = u64;

/// Size and shape of the KV pool.
#[derive(Clone, Copy, Debug)]
pub struct BatchConfig {
    /// Positions per block.
    pub block_size: usize,
    /// Blocks in the pool (each holds `block_size` positions of every layer).
    pub kv_blocks: usize,
    pub kv_dtype: KvDtype,
    /// Most tokens one sequence may hold (capped at the model's maximum positions).
    pub max_seq_len: usize,
}

impl BatchConfig {
    /// Positions per block unless the caller says otherwise (vLLM's and llama.cpp's default).
    pub const BLOCK_SIZE: usize = 16;

    /// Bytes one block takes over all attention layers of a model of config `c` (GatedDeltaNet
    /// layers keep no keys and values).
    pub fn block_bytes(c: &ModelConfig, block_size: usize, kv_dtype: KvDtype) -> usize {
        let attention = c.mixers.iter().filter(|&&m| m == Mixer::Attention).count();
        attention * KvBlocks::block_bytes(block_size, c.num_kv_heads, c.head_dim, kv_dtype)
    }

    /// A pool of as many blocks as `budget_bytes` holds.
    pub fn from_budget(
        model: &Model,
        budget_bytes: usize,
        kv_dtype: KvDtype,
        max_seq_len: usize,
    ) -> BatchConfig {
        let block_size = Self::BLOCK_SIZE;
        let c = &model.config;
        // At least one layer's worth, so a model without attention layers gets a sane count.
        let one = KvBlocks::block_bytes(block_size, c.num_kv_heads, c.head_dim, kv_dtype);
        let per = Self::block_bytes(c, block_size, kv_dtype).max(one).max(1);
        BatchConfig {
            block_size,
            kv_blocks: budget_bytes / per,
            kv_dtype,
            max_seq_len,
        }
    }
}

/// Rows the engine has computed since it was made, for metrics and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RowCounts {
    /// Positions inside their sequence's prompt (prefill, and recomputation after preemption).
    pub prompt: u64,
    /// Positions of generated tokens (decode, and their recomputation after preemption).
    pub generated: u64,
}

/// One sequence's share of a step: run its next `tokens` not yet computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Work {
    pub seq: SeqId,
    pub tokens: usize,
}

struct Sequence {
    /// Every token known: prompt, then each generated one.
    tokens: Vec<u32>,
    /// How many of `tokens` are the prompt (a fork keeps its parent's).
    prompt_len: usize,
    /// Leading tokens whose keys and values are in the pool.
    computed: usize,
    table: Vec<BlockId>,
    /// Chain hash of each full block of `table` that has been published.
    hashes: Vec<u64>,
    /// Recurrent state (hybrid models), held while `table` is; None ⇒ nothing computed.
    slot: Option<SlotId>,
    /// Every row a step computes returns its logits (a prompt being scored), not only the last.
    every_row: bool,
    /// Positions (block boundaries, ascending) where the recurrent state is checkpointed into
    /// the state cache once computed (hybrid models with the state cache on).
    stops: Vec<usize>,
    /// The state at the last block boundary passed while generating, stored into the state
    /// cache when the blocks go back (a conversation resent in full resumes there).
    boundary: Option<(usize, Vec<GdnState>)>,
}

pub struct BatchEngine<'m, 'a> {
    model: &'m Model<'a>,
    cfg: BatchConfig,
    layers: Vec<KvBlocks>,
    pool: BlockPool,
    seqs: HashMap<SeqId, Sequence>,
    slots: RecurrentSlots,
    /// Recurrent-state checkpoints for hybrid models' prefix reuse (budget 0: off).
    states: StateCache,
    next_id: SeqId,
    act: Activations,
    /// The device that runs the steps and holds the pool (None: the CPU does, in `layers`).
    device: Option<DeviceBatch>,
    /// The last device step's outputs.
    dev_logits: Vec<f32>,
    /// Steps whose tokens the device drew.
    device_sampled_steps: u64,
    rows: RowCounts,
}

/// What a device step returns.
#[derive(Clone, Copy)]
enum Out<'s> {
    Logits,
    Greedy,
    /// Each output's token drawn by its spec.
    Sampled(&'s [SampleSpec]),
}

impl<'m, 'a> BatchEngine<'m, 'a> {
    pub fn new(model: &'m Model<'a>, cfg: BatchConfig) -> Result<Self> {
        let c = &model.config;
        if model.weights.layers.len() != c.num_layers {
            return Err(LlmError::Other(format!(
                "only {} of {} layers are loaded",
                model.weights.layers.len(),
                c.num_layers
            )));
        }
        if cfg.block_size == 0 || cfg.kv_blocks == 0 {
            return Err(LlmError::Other(format!(
                "the KV pool needs at least one block of at least one position \
                 ({} blocks of {} given)",
                cfg.kv_blocks, cfg.block_size
            )));
        }
        let cfg = BatchConfig {
            max_seq_len: cfg.max_seq_len.min(c.max_position_embeddings.max(1)),
            ..cfg
        };
        Ok(BatchEngine {
            model,
            cfg,
            layers: cpu_layers(model, &cfg)?,
            pool: BlockPool::new(cfg.kv_blocks),
            seqs: HashMap::new(),
            slots: RecurrentSlots::new(model),
            states: StateCache::new(0),
            next_id: 0,
            act: Activations::default(),
            device: None,
            dev_logits: Vec::new(),
            device_sampled_steps: 0,
            rows: RowCounts::default(),
        })
    }

    /// An engine whose steps run on `device` and whose pool is the device's (its block count
    /// and size replace `cfg`'s; `cfg.kv_dtype` is the CPU pool's should the device refuse a
    /// step, when the engine moves to the CPU for good and recomputes what the device held).
    pub fn on_device(model: &'m Model<'a>, cfg: BatchConfig, device: DeviceBatch) -> Result<Self> {
        let cfg = BatchConfig {
            block_size: device.block_size(),
            kv_blocks: device.blocks(),
            ..cfg
        };
        // No CPU pool while the device holds it.
        let mut e = BatchEngine::new(
            model,
            BatchConfig {
                kv_blocks: 1,
                ..cfg
            },
        )?;
        e.cfg = BatchConfig {
            max_seq_len: e.cfg.max_seq_len,
            ..cfg
        };
        e.pool = BlockPool::new(cfg.kv_blocks);
        e.device = Some(device);
        Ok(e)
    }

    /// The device, for another engine (its pool's contents are left behind: a new engine's
    /// tables name no block until it computes one).
    pub fn into_device(self) -> Option<DeviceBatch> {
        self.device
    }

    /// Whether the steps run on the device (false after a refusal moved the engine to the CPU).
    pub fn is_device(&self) -> bool {
        self.device.is_some()
    }

    pub fn config(&self) -> &BatchConfig {
        &self.cfg
    }

    pub fn model(&self) -> &'m Model<'a> {
        self.model
    }

    pub fn pool_stats(&self) -> PoolStats {
        self.pool.stats()
    }

    /// Rows computed so far (prompt tokens taken from the prefix cache or shared by a fork are
    /// not computed, so they do not count).
    pub fn rows_computed(&self) -> RowCounts {
        self.rows
    }

    /// Recurrent-state slots held by sequences (0 for a model without GatedDeltaNet layers).
    pub fn slots_in_use(&self) -> usize {
        self.slots.in_use()
    }

    /// Bytes of one sequence's recurrent state (0 without GatedDeltaNet layers).
    pub fn slot_bytes(&self) -> usize {
        self.slots.slot_bytes()
    }

    /// Whether sequences may take cached prefix blocks: a hybrid model's only with the state
    /// cache on (its cached blocks carry no recurrent state), and on the CPU.
    pub fn reuses_prefixes(&self) -> bool {
        !self.slots.needed() || (self.states.enabled() && self.device.is_none())
    }

    /// Gives a hybrid model's recurrent-state checkpoints `bytes` (0 turns them off, and with
    /// them the hybrid's prefix reuse; the default). Checkpoints already kept are dropped. No
    /// effect on a model without GatedDeltaNet layers.
    pub fn set_state_cache(&mut self, bytes: usize) {
        let bytes = if self.slots.needed() { bytes } else { 0 };
        self.states = StateCache::new(bytes);
    }

    /// Bytes one checkpoint over `tokens` tokens takes from the state cache's budget (0 for a
    /// model without GatedDeltaNet layers).
    pub fn checkpoint_bytes(&self, tokens: usize) -> usize {
        if !self.slots.needed() {
            return 0;
        }
        let bs = self.cfg.block_size;
        StateCache::bytes_of(self.slots.slot_bytes(), tokens, tokens / bs)
    }

    pub fn state_cache_stats(&self) -> StateCacheStats {
        self.states.stats()
    }

    /// Most tokens `id`'s next step item may compute so that it ends at the sequence's next
    /// checkpoint (usize::MAX when none is due).
    pub fn until_checkpoint(&self, id: SeqId) -> usize {
        let s = self.seq(id);
        s.stops
            .iter()
            .find(|&&p| p > s.computed)
            .map_or(usize::MAX, |&p| p - s.computed)
    }

    /// Checks the block pool's and the recurrent slots' bookkeeping against every sequence
    /// (tests).
    pub fn check(&self) -> std::result::Result<(), String> {
        self.pool.check()?;
        self.states.check(self.cfg.block_size)?;
        let mut held: Vec<SlotId> = Vec::new();
        for (id, s) in &self.seqs {
            match s.slot {
                Some(slot) if !self.slots.is_held(slot) || held.contains(&slot) => {
                    return Err(format!("sequence {id}: slot {slot} is free or shared"));
                }
                Some(slot) => held.push(slot),
                None if self.slots.needed() && s.computed > 0 => {
                    return Err(format!("sequence {id}: computed tokens but no slot"));
                }
                None => {}
            }
        }
        if held.len() != self.slots.in_use() {
            return Err(format!(
                "{} slots in use, {} held by sequences",
                self.slots.in_use(),
                held.len()
            ));
        }
        let mut refs = vec![0u32; self.cfg.kv_blocks];
        for s in self.seqs.values() {
            for &b in &s.table {
                refs[b as usize] += 1;
            }
        }
        for (b, &r) in refs.iter().enumerate() {
            if self.pool.refs(b as BlockId) != r {
                return Err(format!(
                    "block {b}: {} references counted, {r} tables name it",
                    self.pool.refs(b as BlockId)
                ));
            }
        }
        Ok(())
    }

    /// A new sequence holding `tokens` (none computed, no blocks yet).
    pub fn add(&mut self, tokens: Vec<u32>) -> Result<SeqId> {
        if tokens.is_empty() {
            return Err(LlmError::Other(
                "a sequence needs at least one token".into(),
            ));
        }
        let vocab = self.model.config.vocab_size;
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(LlmError::TokenOutOfRange { id, vocab });
        }
        if tokens.len() > self.cfg.max_seq_len {
            return Err(LlmError::ContextFull {
                needed: tokens.len(),
                limit: self.cfg.max_seq_len,
            });
        }
        let id = self.next_id;
        self.next_id += 1;
        self.seqs.insert(
            id,
            Sequence {
                prompt_len: tokens.len(),
                tokens,
                computed: 0,
                table: Vec::new(),
                hashes: Vec::new(),
                slot: None,
                every_row: false,
                stops: Vec::new(),
                boundary: None,
            },
        );
        Ok(id)
    }

    /// A new sequence continuing `parent` as it is now: the same tokens, its computed blocks
    /// shared (one more reference each) and, for a hybrid model, a copy of its recurrent state.
    /// The first write into a shared, partly filled block copies it ([`BatchEngine::reserve`]).
    pub fn fork(&mut self, parent: SeqId) -> SeqId {
        let bs = self.cfg.block_size;
        let p = self.seq(parent);
        // A device pool's blocks cannot be copied from here: there the fork recomputes the
        // parent's partly filled tail block instead of sharing it (only dense models batch on
        // the device, so there is no recurrent state to rewind).
        let computed = if self.device.is_some() {
            p.computed / bs * bs
        } else {
            p.computed
        };
        let table = p.table[..computed.div_ceil(bs)].to_vec();
        let child = Sequence {
            tokens: p.tokens.clone(),
            prompt_len: p.prompt_len,
            computed,
            hashes: p.hashes.clone(),
            slot: p.slot,
            table,
            every_row: false,
            stops: Vec::new(),
            boundary: None,
        };
        for &b in &child.table {
            self.pool.retain(b);
        }
        let slot = child.slot.map(|s| self.slots.fork(s));
        let id = self.next_id;
        self.next_id += 1;
        self.seqs.insert(id, Sequence { slot, ..child });
        id
    }

    /// The shared, partly filled block `id` would write next, if any: it must be copied first.
    fn shared_tail(&self, id: SeqId) -> Option<usize> {
        let s = self.seq(id);
        let bs = self.cfg.block_size;
        let i = s.computed / bs;
        (!s.computed.is_multiple_of(bs) && i < s.table.len() && !self.pool.is_exclusive(s.table[i]))
            .then_some(i)
    }

    fn seq(&self, id: SeqId) -> &Sequence {
        self.seqs.get(&id).expect("unknown sequence id")
    }

    pub fn contains(&self, id: SeqId) -> bool {
        self.seqs.contains_key(&id)
    }

    pub fn tokens(&self, id: SeqId) -> &[u32] {
        &self.seq(id).tokens
    }

    /// Tokens whose keys and values are in the pool.
    pub fn computed(&self, id: SeqId) -> usize {
        self.seq(id).computed
    }

    /// Known tokens not yet computed.
    pub fn pending(&self, id: SeqId) -> usize {
        let s = self.seq(id);
        s.tokens.len() - s.computed
    }

    /// Whether each row `id` computes from now on returns its logits (a prompt whose
    /// log-probabilities are wanted) instead of only the row of its last known token. The CPU
    /// step only: a device engine refuses a step with such a sequence.
    pub fn set_every_row(&mut self, id: SeqId, on: bool) {
        self.seqs
            .get_mut(&id)
            .expect("unknown sequence id")
            .every_row = on;
    }

    /// The logits rows `w` gets from [`Self::step`]: all its tokens for a sequence that wants
    /// every row, else one when it reaches the last known token, else none.
    pub fn rows_out(&self, w: &Work) -> usize {
        let s = self.seq(w.seq);
        if s.every_row {
            w.tokens
        } else {
            usize::from(s.computed + w.tokens == s.tokens.len())
        }
    }

    /// Appends a generated token (computed by a later step). Refused past the length limit.
    pub fn push(&mut self, id: SeqId, token: u32) -> Result<()> {
        let limit = self.cfg.max_seq_len;
        let s = self.seqs.get_mut(&id).expect("unknown sequence id");
        if s.tokens.len() >= limit {
            return Err(LlmError::ContextFull {
                needed: s.tokens.len() + 1,
                limit,
            });
        }
        s.tokens.push(token);
        Ok(())
    }

    /// Takes cached blocks for the longest run of full blocks at the start of a sequence that
    /// has none yet; returns the tokens they cover (now computed). A hybrid model's sequence
    /// takes the longest such run that ends at a state checkpoint, restored into its slot, and
    /// plans where it checkpoints its own prompt.
    pub fn reuse_prefix(&mut self, id: SeqId) -> usize {
        let bs = self.cfg.block_size;
        let reuse = self.reuses_prefixes();
        let hybrid = self.slots.needed();
        let BatchEngine {
            seqs,
            pool,
            slots,
            states,
            ..
        } = self;
        let s = seqs.get_mut(&id).expect("unknown sequence id");
        if !s.table.is_empty() || s.slot.is_some() || !reuse {
            return 0;
        }
        // Whole blocks, and never the last known token (see the module note).
        let reusable = (s.tokens.len() - 1) / bs;
        let mut parent = 0;
        for i in 0..reusable {
            let block = &s.tokens[i * bs..(i + 1) * bs];
            match pool.lookup(parent, block) {
                Some(b) => {
                    parent = super::blocks::chain_hash(parent, block);
                    s.table.push(b);
                    s.hashes.push(parent);
                }
                None => break,
            }
        }
        if hybrid {
            let found = s.table.len();
            let keep = (1..=found)
                .rev()
                .find(|&k| states.contains(s.hashes[k - 1], &s.tokens[..k * bs]))
                .unwrap_or(0);
            for b in s.table.drain(keep..) {
                pool.release(b);
            }
            s.hashes.truncate(keep);
            if keep > 0 {
                let slot = slots.allocate();
                let state = states
                    .restore(s.hashes[keep - 1], &s.tokens[..keep * bs])
                    .expect("found above");
                slots.restore(slot, state);
                s.slot = Some(slot);
            }
            s.stops = checkpoint_plan(s.prompt_len, keep * bs, found * bs, bs);
        }
        s.computed = s.table.len() * bs;
        s.computed
    }

    /// More blocks `id` needs to compute its next `n` tokens (a private copy of a shared block
    /// it writes into included).
    pub fn blocks_needed(&self, id: SeqId, n: usize) -> usize {
        let s = self.seq(id);
        let grow = (s.computed + n)
            .div_ceil(self.cfg.block_size)
            .saturating_sub(s.table.len());
        grow + usize::from(self.shared_tail(id).is_some())
    }

    /// Blocks an allocation can take now.
    pub fn blocks_available(&self) -> usize {
        self.pool.available()
    }

    /// Gives `id` the blocks for its next `n` tokens (and, for a hybrid model, its recurrent
    /// slot); false, with nothing taken, when the pool cannot supply them.
    pub fn reserve(&mut self, id: SeqId, n: usize) -> bool {
        let need = self.blocks_needed(id, n);
        if need > self.pool.available() {
            return false;
        }
        if let Some(i) = self.shared_tail(id) {
            let copy = self.pool.allocate().expect("availability was checked");
            let s = self.seqs.get_mut(&id).expect("unknown sequence id");
            let shared = std::mem::replace(&mut s.table[i], copy);
            // GatedDeltaNet layers hold no blocks.
            for layer in self.layers.iter_mut().filter(|l| l.num_blocks() > 0) {
                layer.copy_block(shared, copy);
            }
            self.pool.release(shared);
        }
        let need = self.blocks_needed(id, n);
        let s = self.seqs.get_mut(&id).expect("unknown sequence id");
        if self.slots.needed() && s.slot.is_none() {
            debug_assert_eq!(
                s.computed, 0,
                "a sequence without a slot has nothing computed"
            );
            s.slot = Some(self.slots.allocate());
        }
        for _ in 0..need {
            let b = self.pool.allocate().expect("availability was checked");
            s.table.push(b);
        }
        // Checkpoints over an evicted block can no longer be used.
        for h in self.pool.take_evicted() {
            self.states.forget_through(h);
        }
        true
    }

    /// Returns every block of `id` to the pool (and its recurrent slot) and forgets its computed
    /// state; its tokens stay, to be recomputed (a preempted sequence). Published blocks stay
    /// cached for reuse.
    pub fn release(&mut self, id: SeqId) {
        let bs = self.cfg.block_size;
        let s = self.seqs.get_mut(&id).expect("unknown sequence id");
        if let Some((at, state)) = s.boundary.take() {
            // Its blocks are published (they stay cached), so the checkpoint is usable.
            let blocks = at / bs;
            if s.hashes.len() >= blocks {
                let bytes = self.slots.slot_bytes();
                self.states
                    .store(&s.hashes[..blocks], &s.tokens[..at], bytes, || state);
            }
        }
        s.stops.clear();
        for b in s.table.drain(..) {
            self.pool.release(b);
        }
        if let Some(slot) = s.slot.take() {
            self.slots.release(slot);
        }
        s.hashes.clear();
        s.computed = 0;
    }

    /// Releases `id`'s blocks and forgets the sequence.
    pub fn remove(&mut self, id: SeqId) {
        if self.seqs.contains_key(&id) {
            self.release(id);
            self.seqs.remove(&id);
        }
    }

    /// Runs one step: for each item, its sequence's next `tokens` uncomputed tokens. Returns the
    /// logits (`[m, vocab]`) of the items that reach their sequence's last known token, in the
    /// items' order (every row of an item whose sequence wants them all: [`Self::rows_out`]).
    /// Each sequence may appear once and must have reserved its blocks.
    pub fn step(&mut self, work: &[Work]) -> Result<&[f32]> {
        self.check_work(work)?;
        self.check_rows(work)?;
        if self.device.is_some() {
            self.check_last_rows(work)?;
            match self.step_device(work, Out::Logits) {
                Ok(m) => return Ok(&self.dev_logits[..m * self.model.config.vocab_size]),
                Err(r) => self.fall_back(r)?,
            }
        }
        self.step_cpu(work)
    }

    /// [`Self::step`] returning each output's arg-max (ties to the lowest id): on the device,
    /// one id per sequence comes back instead of its logits.
    pub fn step_greedy(&mut self, work: &[Work]) -> Result<Vec<u32>> {
        self.check_work(work)?;
        self.check_rows(work)?;
        self.check_last_rows(work)?;
        if self.device.is_some() {
            match self.step_device(work, Out::Greedy) {
                Ok(m) => return Ok(self.dev_logits[..m].iter().map(|&x| x.to_bits()).collect()),
                Err(r) => self.fall_back(r)?,
            }
        }
        let v = self.model.config.vocab_size;
        Ok(self
            .step_cpu(work)?
            .chunks(v)
            .map(crate::sampling::argmax)
            .collect())
    }

    /// [`Self::step`] returning each output's token drawn by its sampler (`specs[i]` for the
    /// `i`-th output, with its sequence's penalty window and position, as
    /// [`crate::sampling::Sampler::sample`] draws): on the device, the draws run there and one
    /// id per sequence comes back (the caller checks each spec's `device_limit` first); on the
    /// CPU, the host sampler draws from the logits.
    pub fn step_sampled(&mut self, work: &[Work], specs: &[SampleSpec]) -> Result<Vec<u32>> {
        self.check_work(work)?;
        self.check_rows(work)?;
        self.check_last_rows(work)?;
        // The items that reach their sequence's last token, one output (and spec) each.
        let wanted: Vec<SeqId> = work
            .iter()
            .filter(|w| {
                let s = self.seq(w.seq);
                s.computed + w.tokens == s.tokens.len()
            })
            .map(|w| w.seq)
            .collect();
        if wanted.len() != specs.len() {
            return Err(LlmError::Other(format!(
                "step: {} samplers for {} outputs",
                specs.len(),
                wanted.len()
            )));
        }
        if self.device.is_some() {
            match self.step_device(work, Out::Sampled(specs)) {
                Ok(m) => {
                    self.device_sampled_steps += 1;
                    return Ok(self.dev_logits[..m].iter().map(|&x| x.to_bits()).collect());
                }
                Err(r) => self.fall_back(r)?,
            }
        }
        let v = self.model.config.vocab_size;
        let mut logits = self.step_cpu(work)?.to_vec();
        let mut ids = Vec::with_capacity(specs.len());
        for ((row, spec), seq) in logits.chunks_mut(v).zip(specs).zip(wanted) {
            ids.push(crate::sampling::row(&self.seq(seq).tokens, *spec).sample_host(row));
        }
        Ok(ids)
    }

    /// Steps whose tokens the device drew ([`Self::step_sampled`] on the device).
    pub fn device_sampled_steps(&self) -> u64 {
        self.device_sampled_steps
    }

    /// A checked step on the device; returns the outputs (in `dev_logits`: logits, or ids as
    /// f32 bit patterns for greedy and sampled steps).
    fn step_device(
        &mut self,
        work: &[Work],
        out: Out,
    ) -> std::result::Result<usize, cmf_gpu::facade::Refusal> {
        let bs = self.cfg.block_size;
        let v = self.model.config.vocab_size;
        let items: Vec<BatchSeq> = work
            .iter()
            .map(|w| {
                let s = &self.seqs[&w.seq];
                let end = s.computed + w.tokens;
                BatchSeq {
                    tokens: &s.tokens[s.computed..end],
                    start: s.computed,
                    blocks: &s.table,
                    want: end == s.tokens.len(),
                }
            })
            .collect();
        let m = items.iter().filter(|i| i.want).count();
        let dev = self.device.as_mut().expect("checked");
        match out {
            Out::Logits => {
                self.dev_logits.resize(m * v, 0.0);
                dev.step(&items, BatchOut::Logits(&mut self.dev_logits[..m * v]))?;
            }
            Out::Greedy | Out::Sampled(_) => {
                // Each wanted item's sampler reads its sequence's tokens (all known ones: the
                // step reaches the last).
                let rows: Vec<RowSampling> = match out {
                    Out::Sampled(specs) => work
                        .iter()
                        .zip(&items)
                        .filter(|(_, i)| i.want)
                        .zip(specs)
                        .map(|((w, _), &spec)| {
                            crate::sampling::row(&self.seqs[&w.seq].tokens, spec)
                        })
                        .collect(),
                    _ => Vec::new(),
                };
                let mut ids = vec![0u32; m];
                let out = match out {
                    Out::Greedy => BatchOut::Greedy(&mut ids),
                    _ => BatchOut::Sampled {
                        rows: &rows,
                        ids: &mut ids,
                    },
                };
                dev.step(&items, out)?;
                self.dev_logits.clear();
                self.dev_logits
                    .extend(ids.iter().map(|&i| f32::from_bits(i)));
            }
        }
        drop(items);
        for w in work {
            self.advance(w.seq, w.tokens, bs);
        }
        Ok(m)
    }

    /// After a device refusal: the CPU takes the pool over for good. Every sequence's blocks are
    /// given back and its computed tokens recomputed on the CPU into blocks of its own (as many as
    /// it held, so the step being run finds its reservation), one sequence at a time.
    fn fall_back(&mut self, why: cmf_gpu::facade::Refusal) -> Result<()> {
        cmf_gpu::facade::log::debug(&format!(
            "batch: the device refused a step ({why}); recomputing on the CPU"
        ));
        let layers = cpu_layers(self.model, &self.cfg)?;
        self.device = None;
        self.dev_logits = Vec::new();
        self.layers = layers;
        self.pool = BlockPool::new(self.cfg.kv_blocks);
        self.states.clear();
        let mut held: Vec<(SeqId, usize, usize)> = self
            .seqs
            .iter()
            .map(|(&id, s)| (id, s.computed, s.table.len()))
            .collect();
        held.sort_unstable();
        for s in self.seqs.values_mut() {
            s.table.clear();
            s.hashes.clear();
            s.computed = 0;
        }
        let bs = self.cfg.block_size;
        for (id, computed, blocks) in held {
            if !self.reserve(id, blocks * bs) {
                return Err(LlmError::Other(format!(
                    "the device refused a step ({why}) and the CPU pool cannot hold what it held"
                )));
            }
            let mut done = 0;
            while done < computed {
                let n = (computed - done).min(crate::model::PREFILL_CHUNK);
                self.step_cpu(&[Work { seq: id, tokens: n }])?;
                done += n;
            }
        }
        Ok(())
    }

    fn step_cpu(&mut self, work: &[Work]) -> Result<&[f32]> {
        let bs = self.cfg.block_size;
        let BatchEngine {
            model,
            layers,
            seqs,
            slots,
            act,
            ..
        } = self;
        let mut rows = Vec::with_capacity(work.len());
        let mut tables = Vec::with_capacity(work.len());
        let mut of_segment = Vec::with_capacity(work.len());
        for w in work {
            let s = &seqs[&w.seq];
            let end = s.computed + w.tokens;
            let logits = match (s.every_row, end == s.tokens.len()) {
                (true, _) => RowLogits::All,
                (false, true) => RowLogits::Last,
                (false, false) => RowLogits::None,
            };
            rows.push(SeqRows {
                tokens: &s.tokens[s.computed..end],
                start: s.computed,
                logits,
            });
            tables.push(s.table.as_slice());
            of_segment.push(s.slot);
        }
        let mut pass = PagedPass { layers, tables };
        let mut recurrent = slots.pass(of_segment);
        let model = *model;
        let m = cmf_kernels::run_in_pool(|| {
            model
                .forward_batch(&rows, &mut pass, &mut recurrent, act)
                .len()
        });
        drop(rows);
        for w in work {
            let s = &self.seqs[&w.seq];
            let prompt = s.prompt_len.saturating_sub(s.computed).min(w.tokens);
            self.rows.prompt += prompt as u64;
            self.rows.generated += (w.tokens - prompt) as u64;
            self.advance(w.seq, w.tokens, bs);
        }
        Ok(&self.act.logits()[..m])
    }

    /// Most rows one step may hold (the device's step size; unbounded on the CPU).
    pub fn max_step_rows(&self) -> usize {
        self.device.as_ref().map_or(usize::MAX, |d| d.max_rows())
    }

    fn check_rows(&self, work: &[Work]) -> Result<()> {
        let rows: usize = work.iter().map(|w| w.tokens).sum();
        if rows > self.max_step_rows() {
            return Err(LlmError::Other(format!(
                "step: {rows} rows, the device takes at most {} per step",
                self.max_step_rows()
            )));
        }
        Ok(())
    }

    /// Refuses sequences that want every row's logits (the device step and the arg-max step
    /// return one output per sequence).
    fn check_last_rows(&self, work: &[Work]) -> Result<()> {
        match work.iter().find(|w| self.seq(w.seq).every_row) {
            Some(w) => Err(LlmError::Other(format!(
                "step: sequence {} wants every row's logits, which only the CPU step returns",
                w.seq
            ))),
            None => Ok(()),
        }
    }

    fn check_work(&self, work: &[Work]) -> Result<()> {
        let bs = self.cfg.block_size;
        for (i, w) in work.iter().enumerate() {
            let s = self
                .seqs
                .get(&w.seq)
                .ok_or_else(|| LlmError::Other(format!("step: unknown sequence {}", w.seq)))?;
            if work[..i].iter().any(|o| o.seq == w.seq) {
                return Err(LlmError::Other(format!("step: sequence {} twice", w.seq)));
            }
            if w.tokens == 0 || s.computed + w.tokens > s.tokens.len() {
                return Err(LlmError::Other(format!(
                    "step: sequence {} has {} tokens to compute, {} asked",
                    w.seq,
                    s.tokens.len() - s.computed,
                    w.tokens
                )));
            }
            if self.slots.needed() && s.slot.is_none() {
                return Err(LlmError::Other(format!(
                    "step: sequence {} holds no recurrent-state slot (reserve first)",
                    w.seq
                )));
            }
            let end = s.computed + w.tokens;
            if end.div_ceil(bs) > s.table.len() {
                return Err(LlmError::Other(format!(
                    "step: sequence {} has not reserved blocks for {end} positions",
                    w.seq
                )));
            }
            for &b in &s.table[s.computed / bs..end.div_ceil(bs)] {
                if !self.pool.is_exclusive(b) {
                    return Err(LlmError::Other(format!(
                        "step: sequence {} would write shared block {b}",
                        w.seq
                    )));
                }
            }
        }
        Ok(())
    }

    /// Marks `n` more tokens of `id` computed, publishes the blocks they filled and takes the
    /// recurrent-state checkpoints due.
    fn advance(&mut self, id: SeqId, n: usize, bs: usize) {
        let s = self.seqs.get_mut(&id).expect("checked");
        s.computed += n;
        while s.hashes.len() < s.computed / bs {
            let i = s.hashes.len();
            let parent = if i == 0 { 0 } else { s.hashes[i - 1] };
            let h = self
                .pool
                .publish(s.table[i], parent, &s.tokens[i * bs..(i + 1) * bs]);
            s.hashes.push(h);
        }
        let Some(slot) = s.slot.filter(|_| self.states.enabled()) else {
            return;
        };
        let at = s.computed;
        if s.stops.contains(&at) {
            let bytes = self.slots.slot_bytes();
            let slots = &self.slots;
            self.states
                .store(&s.hashes[..at / bs], &s.tokens[..at], bytes, || {
                    slots.snapshot(slot)
                });
        }
        s.stops.retain(|&p| p > at);
        if at > s.prompt_len && at.is_multiple_of(bs) {
            let mut state = s.boundary.take().map(|b| b.1).unwrap_or_default();
            self.slots.snapshot_into(slot, &mut state);
            s.boundary = Some((at, state));
        }
    }
}

/// Boundaries back from the last one of a prompt (in blocks) where a hybrid sequence checkpoints
/// its state: a later prompt sharing this one up to a point a few tokens before its end (a
/// shared system prompt, then another question) resumes at most about as far back again.
const PROMPT_CHECKPOINTS_BACK: [usize; 5] = [0, 1, 2, 4, 8];

/// Where a hybrid sequence whose prompt has `prompt_len` tokens, resuming at `from` with cached
/// blocks up to `cached`, checkpoints its state: the prompt's last block boundary and some
/// before it ([`PROMPT_CHECKPOINTS_BACK`]), and `cached` (the cached blocks end there without a
/// checkpoint: another prompt parted from this one there, and the next one sharing both resumes
/// there). Ascending, each a block boundary after `from`.
fn checkpoint_plan(prompt_len: usize, from: usize, cached: usize, bs: usize) -> Vec<usize> {
    let last = prompt_len / bs;
    let mut stops: Vec<usize> = PROMPT_CHECKPOINTS_BACK
        .iter()
        .filter(|&&back| back < last)
        .map(|&back| (last - back) * bs)
        .chain(std::iter::once(cached))
        .filter(|&p| p > from)
        .collect();
    stops.sort_unstable();
    stops.dedup();
    stops
}

/// The CPU pool of `cfg`: per layer, its blocks (none for GatedDeltaNet layers, whose state
/// lives in the sequence's recurrent slot). An error, not an abort, where the allocator refuses
/// the reservation.
fn cpu_layers(model: &Model, cfg: &BatchConfig) -> Result<Vec<KvBlocks>> {
    let c = &model.config;
    c.mixers
        .iter()
        .map(|&m| {
            let blocks = if m == Mixer::Attention {
                cfg.kv_blocks
            } else {
                0
            };
            KvBlocks::try_new(
                cfg.kv_dtype,
                blocks,
                cfg.block_size,
                c.num_kv_heads,
                c.head_dim,
            )
            .ok_or_else(|| {
                let bytes = 2.0
                    * (cfg.kv_dtype.bytes() * c.num_kv_heads * c.head_dim) as f64
                    * (blocks as f64)
                    * (cfg.block_size as f64);
                LlmError::Other(format!(
                    "cannot reserve the KV pool: {blocks} blocks of {} positions × {} KV heads \
                     × {} = {:.1} GiB a layer; a smaller pool (--kv-pool) needs less",
                    cfg.block_size,
                    c.num_kv_heads,
                    c.head_dim,
                    bytes / (1u64 << 30) as f64
                ))
            })
        })
        .collect()
}

/// One step's view of the pool: every layer's blocks and each segment's block table.
struct PagedPass<'p> {
    layers: &'p mut [KvBlocks],
    tables: Vec<&'p [BlockId]>,
}

impl LayerKv for PagedPass<'_> {
    fn write(&mut self, layer: usize, i: usize, seg: &Segment, k: &[f32], v: &[f32]) {
        self.layers[layer].write(self.tables[i], seg.start, k, v);
    }

    fn attend(
        &self,
        layer: usize,
        i: usize,
        seg: &Segment,
        q: &[f32],
        p: &AttnParams,
        out: &mut [f32],
    ) {
        let kv = self.layers[layer].view(self.tables[i], seg.start + seg.n);
        cmf_kernels::attention_paged(q, kv, p, out);
    }
}
