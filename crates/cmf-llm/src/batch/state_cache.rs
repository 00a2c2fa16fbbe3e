//! Checkpoints of hybrid (GatedDeltaNet) models' recurrent state, kept beside the prefix cache so
//! a hybrid sequence can resume from a cached prefix instead of recomputing it.
//!
//! A KV block says nothing of the recurrent state at its end, and a recurrent state cannot be
//! rewound, so the engine copies a sequence's state at chosen block boundaries. Each checkpoint
//! is keyed by the chain hash of the block chain it ends (the hash the KV prefix cache
//! publishes that chain's last block under) and keeps the tokens it covers, compared on lookup,
//! so a 64-bit collision never hands out a wrong state.
//!
//! A checkpoint is only as good as the KV blocks before it: the engine uses one only at the end
//! of a chain it found in the block pool, and drops every checkpoint whose chain runs through a
//! block the pool evicts ([`StateCache::forget_through`]). Checkpoints are large (the whole
//! state of every GDN layer), so they live under their own byte budget, least recently used
//! evicted first; a budget of 0 turns the cache off.

use crate::model::GdnState;
use std::collections::{BTreeMap, HashMap};

/// One recurrent state at a block boundary.
struct Checkpoint {
    /// The chain hash of every block up to the boundary (the last one is the key).
    chain: Box<[u64]>,
    /// The tokens before the boundary.
    tokens: Box<[u32]>,
    /// Every GDN layer's state, in layer order.
    state: Box<[GdnState]>,
    bytes: usize,
    tick: u64,
}

/// Counters for metrics and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StateCacheStats {
    /// The byte budget (0: off).
    pub budget: usize,
    /// Bytes the checkpoints held now occupy.
    pub bytes: usize,
    pub entries: usize,
    /// Checkpoints stored, restored into a sequence, and dropped (budget or evicted KV blocks).
    pub stored: u64,
    pub restored: u64,
    pub dropped: u64,
}

pub(crate) struct StateCache {
    budget: usize,
    used: usize,
    by_hash: HashMap<u64, Checkpoint>,
    /// Hashes by the tick they were last stored or used (oldest first).
    lru: BTreeMap<u64, u64>,
    tick: u64,
    stored: u64,
    restored: u64,
    dropped: u64,
}

impl StateCache {
    pub fn new(budget: usize) -> StateCache {
        StateCache {
            budget,
            used: 0,
            by_hash: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            stored: 0,
            restored: 0,
            dropped: 0,
        }
    }

    pub fn enabled(&self) -> bool {
        self.budget > 0
    }

    /// Bytes a checkpoint takes from the budget: its state, tokens and chain.
    pub fn bytes_of(state_bytes: usize, tokens: usize, blocks: usize) -> usize {
        state_bytes + tokens * 4 + blocks * 8 + std::mem::size_of::<Checkpoint>()
    }

    /// Whether a checkpoint ends the chain `hash` over exactly `tokens` (no use recorded).
    pub fn contains(&self, hash: u64, tokens: &[u32]) -> bool {
        self.by_hash
            .get(&hash)
            .is_some_and(|c| *c.tokens == *tokens)
    }

    /// Keeps a copy of `state` at the end of the chain `chain` over `tokens`, evicting the least
    /// recently used checkpoints to make room. A checkpoint already there is only marked used;
    /// one larger than the whole budget is not kept. `state` is called only to store.
    pub fn store(
        &mut self,
        chain: &[u64],
        tokens: &[u32],
        state_bytes: usize,
        state: impl FnOnce() -> Vec<GdnState>,
    ) {
        let Some(&hash) = chain.last() else {
            return;
        };
        if self.contains(hash, tokens) {
            self.touch(hash);
            return;
        }
        let bytes = Self::bytes_of(state_bytes, tokens.len(), chain.len());
        if bytes > self.budget {
            return;
        }
        self.remove(hash); // a collision: the newer content wins
        while self.used + bytes > self.budget {
            let (_, &oldest) = self.lru.iter().next().expect("used > 0 means entries");
            self.remove(oldest);
            self.dropped += 1;
        }
        self.tick += 1;
        self.lru.insert(self.tick, hash);
        self.used += bytes;
        self.stored += 1;
        self.by_hash.insert(
            hash,
            Checkpoint {
                chain: chain.into(),
                tokens: tokens.into(),
                state: state().into(),
                bytes,
                tick: self.tick,
            },
        );
    }

    /// The state at the end of the chain `hash` over `tokens`, marked used; None on a miss.
    pub fn restore(&mut self, hash: u64, tokens: &[u32]) -> Option<&[GdnState]> {
        if !self.contains(hash, tokens) {
            return None;
        }
        self.touch(hash);
        self.restored += 1;
        Some(&self.by_hash[&hash].state)
    }

    /// Drops every checkpoint whose chain runs through the block published under `hash` (the
    /// pool evicted it: those checkpoints can no longer be used).
    pub fn forget_through(&mut self, hash: u64) {
        let gone: Vec<u64> = self
            .by_hash
            .iter()
            .filter(|(_, c)| c.chain.contains(&hash))
            .map(|(&h, _)| h)
            .collect();
        self.dropped += gone.len() as u64;
        gone.into_iter().for_each(|h| self.remove(h));
    }

    /// Drops everything (the block pool was replaced).
    pub fn clear(&mut self) {
        self.dropped += self.by_hash.len() as u64;
        self.by_hash.clear();
        self.lru.clear();
        self.used = 0;
    }

    fn touch(&mut self, hash: u64) {
        let c = self.by_hash.get_mut(&hash).expect("touch: cached");
        self.lru.remove(&c.tick);
        self.tick += 1;
        c.tick = self.tick;
        self.lru.insert(self.tick, hash);
    }

    fn remove(&mut self, hash: u64) {
        if let Some(c) = self.by_hash.remove(&hash) {
            self.lru.remove(&c.tick);
            self.used -= c.bytes;
        }
    }

    pub fn stats(&self) -> StateCacheStats {
        StateCacheStats {
            budget: self.budget,
            bytes: self.used,
            entries: self.by_hash.len(),
            stored: self.stored,
            restored: self.restored,
            dropped: self.dropped,
        }
    }

    /// Checks the bookkeeping (tests): the budget kept, the LRU list naming every checkpoint
    /// once, each checkpoint's chain as long as its tokens in blocks.
    pub fn check(&self, block_size: usize) -> Result<(), String> {
        let used: usize = self.by_hash.values().map(|c| c.bytes).sum();
        if used != self.used || used > self.budget {
            return Err(format!(
                "state cache: {used} bytes held, {} counted, budget {}",
                self.used, self.budget
            ));
        }
        if self.lru.len() != self.by_hash.len() {
            return Err(format!(
                "state cache: {} in the LRU list, {} cached",
                self.lru.len(),
                self.by_hash.len()
            ));
        }
        for (&t, &h) in &self.lru {
            match self.by_hash.get(&h) {
                Some(c) if c.tick == t && c.chain.len() * block_size == c.tokens.len() => {}
                _ => {
                    return Err(format!(
                        "state cache: LRU entry {t} names a stale checkpoint"
                    ))
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Stores a (stateless) checkpoint of `bytes` over one block of `tokens` under `hash`.
    fn put(c: &mut StateCache, chain: &[u64], tokens: &[u32], bytes: usize) {
        c.store(chain, tokens, bytes, Vec::new);
        c.check(tokens.len() / chain.len()).unwrap();
    }

    #[test]
    fn least_recently_used_goes_first_within_the_budget() {
        let one = StateCache::bytes_of(1000, 2, 1);
        let mut c = StateCache::new(2 * one);
        put(&mut c, &[1], &[7, 7], 1000);
        put(&mut c, &[2], &[8, 8], 1000);
        assert!(c.restore(1, &[7, 7]).is_some(), "1 is now the most recent");
        put(&mut c, &[3], &[9, 9], 1000);
        assert!(c.contains(1, &[7, 7]) && c.contains(3, &[9, 9]));
        assert!(!c.contains(2, &[8, 8]), "2 was the least recently used");
        let s = c.stats();
        assert_eq!(
            (s.entries, s.bytes, s.stored, s.dropped),
            (2, 2 * one, 3, 1)
        );
        // Larger than the whole budget: not kept, nothing evicted for it.
        put(&mut c, &[4], &[1, 1], 10 * one);
        assert_eq!(c.stats().entries, 2);
    }

    #[test]
    fn a_checkpoint_needs_its_tokens_and_its_blocks() {
        let mut c = StateCache::new(1 << 20);
        put(&mut c, &[1, 2], &[5, 5, 6, 6], 100);
        put(&mut c, &[1, 3], &[5, 5, 4, 4], 100);
        put(&mut c, &[9], &[1, 1], 100);
        // Same hash, other tokens (a collision): a miss.
        assert!(c.restore(2, &[5, 5, 6, 7]).is_none());
        assert!(c.restore(2, &[5, 5, 6, 6]).is_some());
        // Block 1 evicted: both checkpoints over it go, the other stays.
        c.forget_through(1);
        assert!(!c.contains(2, &[5, 5, 6, 6]) && !c.contains(3, &[5, 5, 4, 4]));
        assert!(c.contains(9, &[1, 1]));
        c.check(2).unwrap();
        c.clear();
        assert_eq!(c.stats().bytes, 0);
        assert!(!StateCache::new(0).enabled());
    }
}
