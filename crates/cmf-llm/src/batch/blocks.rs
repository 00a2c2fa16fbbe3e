//! The block allocator and prefix cache: which KV blocks are free, who holds each one, and which
//! full blocks can be reused by content. Bookkeeping only; the keys and values themselves live
//! in `cmf_kernels::KvBlocks`.
//!
//! A block is in exactly one of three states:
//! - *held*: reference count ≥ 1 (sequences whose block table names it);
//! - *cached idle*: count 0 but published under its content hash, kept for reuse until evicted
//!   (least recently released first);
//! - *free*: count 0, no content worth keeping.
//!
//! A full block is published under a chain hash `hash(parent hash, its tokens)`, so a hit on
//! block `i` implies the whole prefix up to it is identical. The entry also keeps the parent hash
//! and the tokens, compared on lookup, so a 64-bit collision can never hand out wrong keys.
//! Published blocks are full and so are never written again; a sequence writes only the blocks
//! it allocated itself ([`BlockPool::is_exclusive`]).

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

pub type BlockId = u32;

/// The chain hash of a full block: its parent's hash (0 for the first block) and its tokens.
pub fn chain_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

/// What a published block holds.
struct Content {
    hash: u64,
    parent: u64,
    tokens: Box<[u32]>,
}

/// Counts for metrics and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    pub total: usize,
    /// Blocks held by at least one sequence.
    pub held: usize,
    /// Unreferenced blocks kept for prefix reuse.
    pub cached_idle: usize,
    pub free: usize,
}

pub struct BlockPool {
    refs: Vec<u32>,
    free: Vec<BlockId>,
    content: Vec<Option<Content>>,
    by_hash: HashMap<u64, BlockId>,
    /// Cached idle blocks by the tick they were released (oldest first).
    idle: BTreeMap<u64, BlockId>,
    idle_tick: Vec<Option<u64>>,
    tick: u64,
    /// Hashes of cached blocks evicted since [`BlockPool::take_evicted`] last ran (the
    /// recurrent-state checkpoints over them go too).
    evicted: Vec<u64>,
}

impl BlockPool {
    pub fn new(num_blocks: usize) -> BlockPool {
        BlockPool {
            refs: vec![0; num_blocks],
            // Popped from the end: low ids first.
            free: (0..num_blocks as BlockId).rev().collect(),
            content: (0..num_blocks).map(|_| None).collect(),
            by_hash: HashMap::new(),
            idle: BTreeMap::new(),
            idle_tick: vec![None; num_blocks],
            tick: 0,
            evicted: Vec::new(),
        }
    }

    pub fn total(&self) -> usize {
        self.refs.len()
    }

    /// Blocks an allocation can take now (free, or cached idle and evictable).
    pub fn available(&self) -> usize {
        self.free.len() + self.idle.len()
    }

    /// A block for one sequence's exclusive use (count 1): a free one, else the least recently
    /// released cached one (its cache entry is dropped). None when every block is held.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let (&tick, &b) = self.idle.iter().next()?;
                self.idle.remove(&tick);
                self.idle_tick[b as usize] = None;
                let c = self.content[b as usize]
                    .take()
                    .expect("idle blocks are cached");
                self.by_hash.remove(&c.hash);
                self.evicted.push(c.hash);
                b
            }
        };
        debug_assert_eq!(self.refs[b as usize], 0);
        self.refs[b as usize] = 1;
        Some(b)
    }

    /// The cached block holding `tokens` after the prefix whose last block hashed to `parent`,
    /// with one more reference taken; None on a miss.
    pub fn lookup(&mut self, parent: u64, tokens: &[u32]) -> Option<BlockId> {
        let hash = chain_hash(parent, tokens);
        let &b = self.by_hash.get(&hash)?;
        let c = self.content[b as usize]
            .as_ref()
            .expect("indexed blocks are cached");
        if c.parent != parent || *c.tokens != *tokens {
            return None;
        }
        if let Some(t) = self.idle_tick[b as usize].take() {
            self.idle.remove(&t);
        }
        self.refs[b as usize] += 1;
        Some(b)
    }

    /// The hashes of the cached blocks evicted since the last call.
    pub fn take_evicted(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.evicted)
    }

    /// One more reference to a held block (a forked sequence sharing its parent's blocks).
    pub fn retain(&mut self, b: BlockId) {
        let r = &mut self.refs[b as usize];
        assert!(*r > 0, "retain: block {b} is not held");
        *r += 1;
    }

    /// Publishes a held, full block under its chain hash and returns the hash. When another
    /// block already holds this content the index keeps that one (this block stays private and
    /// is freed normally).
    pub fn publish(&mut self, b: BlockId, parent: u64, tokens: &[u32]) -> u64 {
        let hash = chain_hash(parent, tokens);
        assert!(self.refs[b as usize] > 0, "publish: block {b} is not held");
        if self.content[b as usize].is_none() && !self.by_hash.contains_key(&hash) {
            self.by_hash.insert(hash, b);
            self.content[b as usize] = Some(Content {
                hash,
                parent,
                tokens: tokens.into(),
            });
        }
        hash
    }

    /// Drops one reference; at zero a published block becomes cached idle, another one free.
    pub fn release(&mut self, b: BlockId) {
        let r = &mut self.refs[b as usize];
        assert!(*r > 0, "release: block {b} is not held");
        *r -= 1;
        if *r > 0 {
            return;
        }
        if self.content[b as usize].is_some() {
            self.tick += 1;
            self.idle.insert(self.tick, b);
            self.idle_tick[b as usize] = Some(self.tick);
        } else {
            self.free.push(b);
        }
    }

    /// True when only one sequence holds `b` and it is not published: the only blocks a
    /// sequence may write.
    pub fn is_exclusive(&self, b: BlockId) -> bool {
        self.refs[b as usize] == 1 && self.content[b as usize].is_none()
    }

    pub fn refs(&self, b: BlockId) -> u32 {
        self.refs[b as usize]
    }

    pub fn stats(&self) -> PoolStats {
        let held = self.refs.iter().filter(|&&r| r > 0).count();
        PoolStats {
            total: self.total(),
            held,
            cached_idle: self.idle.len(),
            free: self.free.len(),
        }
    }

    /// Checks the pool's internal consistency (tests): every block in exactly one state, the
    /// hash index and the idle list agreeing with the blocks' contents and counts.
    pub fn check(&self) -> Result<(), String> {
        let n = self.total();
        let mut seen = vec![0u8; n];
        for &b in &self.free {
            let b = b as usize;
            seen[b] += 1;
            if self.refs[b] != 0 || self.content[b].is_some() {
                return Err(format!("free block {b} is held or cached"));
            }
        }
        for &b in self.idle.values() {
            let b = b as usize;
            seen[b] += 1;
            if self.refs[b] != 0 || self.content[b].is_none() {
                return Err(format!("idle block {b} is held or not cached"));
            }
        }
        for (b, (s, &r)) in seen.iter_mut().zip(&self.refs).enumerate() {
            if r > 0 {
                *s += 1;
            }
            if *s != 1 {
                return Err(format!("block {b} is in {s} states"));
            }
        }
        for (&h, &b) in &self.by_hash {
            match &self.content[b as usize] {
                Some(c) if c.hash == h => {}
                _ => return Err(format!("hash index names block {b} with other content")),
            }
        }
        let cached = self.content.iter().filter(|c| c.is_some()).count();
        if cached != self.by_hash.len() {
            return Err(format!(
                "{cached} cached blocks, {} indexed",
                self.by_hash.len()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// One operation of a random workload: sequences grow block by block (reusing cached blocks
    /// when their content matches), publish full blocks and are dropped.
    #[derive(Clone, Debug)]
    enum Op {
        /// Start a sequence whose blocks hold these token patterns (small alphabet: many shared
        /// prefixes).
        Start(Vec<u8>),
        /// Drop the i-th live sequence (modulo the count).
        Drop(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            prop::collection::vec(0u8..3, 1..6).prop_map(Op::Start),
            (0usize..8).prop_map(Op::Drop),
        ]
    }

    fn tokens_of(pattern: u8) -> Vec<u32> {
        vec![pattern as u32; 4]
    }

    proptest! {
        /// Any interleaving of starts and drops keeps every block in one state, never hands a
        /// held block to a second allocation, and once every sequence is gone no block is held.
        #[test]
        fn no_leak_no_double_ownership(ops in prop::collection::vec(op(), 1..60), size in 2usize..12) {
            let mut pool = BlockPool::new(size);
            let mut live: Vec<Vec<BlockId>> = Vec::new();
            for op in ops {
                match op {
                    Op::Start(blocks) => {
                        let mut table = Vec::new();
                        let mut parent = 0;
                        let mut ok = true;
                        for p in blocks {
                            let t = tokens_of(p);
                            let b = match pool.lookup(parent, &t) {
                                Some(b) => b,
                                None => match pool.allocate() {
                                    Some(b) => {
                                        // A fresh block is ours alone until published.
                                        prop_assert!(pool.is_exclusive(b));
                                        b
                                    }
                                    None => { ok = false; break; }
                                },
                            };
                            parent = pool.publish(b, parent, &t);
                            table.push(b);
                        }
                        if ok {
                            live.push(table);
                        } else {
                            table.iter().for_each(|&b| pool.release(b));
                        }
                    }
                    Op::Drop(i) if !live.is_empty() => {
                        let t = live.remove(i % live.len());
                        t.iter().for_each(|&b| pool.release(b));
                    }
                    Op::Drop(_) => {}
                }
                pool.check().map_err(TestCaseError::fail)?;
                // Reference counts equal the number of tables naming each block.
                for b in 0..size as BlockId {
                    let n = live.iter().flatten().filter(|&&x| x == b).count() as u32;
                    prop_assert_eq!(pool.refs(b), n);
                }
            }
            for t in live.drain(..) {
                t.iter().for_each(|&b| pool.release(b));
            }
            pool.check().map_err(TestCaseError::fail)?;
            let s = pool.stats();
            prop_assert_eq!(s.held, 0);
            prop_assert_eq!(s.free + s.cached_idle, size);
            prop_assert_eq!(pool.available(), size);
        }

        /// A lookup finds only the exact chain: same tokens after a different prefix miss.
        #[test]
        fn hits_need_the_whole_prefix(a in prop::collection::vec(0u8..3, 1..5), b in prop::collection::vec(0u8..3, 1..5)) {
            let mut pool = BlockPool::new(16);
            let mut parent = 0;
            let mut held = Vec::new();
            for &p in &a {
                let blk = pool.allocate().unwrap();
                parent = pool.publish(blk, parent, &tokens_of(p));
                held.push(blk);
            }
            held.iter().for_each(|&blk| pool.release(blk));
            // Walk b's chain: hits exactly for its common prefix with a.
            let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
            let mut parent = 0;
            for (i, &p) in b.iter().enumerate() {
                let t = tokens_of(p);
                let hit = pool.lookup(parent, &t);
                prop_assert_eq!(hit.is_some(), i < common);
                match hit {
                    Some(blk) => { parent = chain_hash(parent, &t); pool.release(blk); }
                    None => break,
                }
            }
            pool.check().map_err(TestCaseError::fail)?;
        }
    }

    #[test]
    fn eviction_takes_the_least_recently_released() {
        let mut pool = BlockPool::new(2);
        let (a, b) = (pool.allocate().unwrap(), pool.allocate().unwrap());
        let ha = pool.publish(a, 0, &[1]);
        pool.publish(b, 0, &[2]);
        pool.release(a);
        pool.release(b);
        assert_eq!(pool.allocate(), Some(a));
        assert!(pool.lookup(0, &[1]).is_none(), "a's entry went with it");
        assert!(pool.lookup(0, &[2]).is_some());
        assert!(pool.allocate().is_none(), "b is held again, a is allocated");
        let _ = ha;
        pool.check().unwrap();
    }
}
