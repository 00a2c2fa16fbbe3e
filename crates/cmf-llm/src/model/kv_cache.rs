//! Per-sequence key/value cache.
//!
//! Layout per layer: keys and values as rows `[pos][kv_heads · head_dim]` (f32), rotated keys as
//! RoPE left them. Rows are appended; capacity grows in steps so a long chat does not reserve the
//! whole context up front (resident memory ≈ what the sequence has used).

#[derive(Debug, Clone)]
pub struct KvCache {
    /// Elements per position per layer (kv_heads · head_dim).
    pub kv_dim: usize,
    /// Positions filled (the same for every layer between forward passes).
    len: usize,
    /// Largest number of positions the cache may hold.
    limit: usize,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

/// Positions reserved at a time when the cache grows.
const GROW_STEP: usize = 256;

impl KvCache {
    pub fn new(num_layers: usize, kv_dim: usize, limit: usize) -> KvCache {
        KvCache {
            kv_dim,
            len: 0,
            limit,
            k: vec![Vec::new(); num_layers],
            v: vec![Vec::new(); num_layers],
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Forgets every position (a new sequence); keeps the allocations.
    pub fn clear(&mut self) {
        self.truncate(0);
    }

    /// Keeps the first `len` positions (e.g. to re-run a turn).
    pub fn truncate(&mut self, len: usize) {
        let len = len.min(self.len);
        for l in 0..self.k.len() {
            self.k[l].truncate(len * self.kv_dim);
            self.v[l].truncate(len * self.kv_dim);
        }
        self.len = len;
    }

    /// Appends `n` positions of layer `layer` (rows of `kv_dim`). The new length becomes visible
    /// through [`KvCache::commit`] once every layer has been appended.
    pub(crate) fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        for (buf, src) in [(&mut self.k[layer], k), (&mut self.v[layer], v)] {
            let needed = buf.len() + src.len();
            if needed > buf.capacity() {
                let positions = (needed / self.kv_dim)
                    .next_multiple_of(GROW_STEP)
                    .min(self.limit.max(1));
                buf.reserve_exact(positions * self.kv_dim - buf.len());
            }
            buf.extend_from_slice(src);
        }
    }

    pub(crate) fn commit(&mut self, n: usize) {
        self.len += n;
    }

    /// Keys and values of `layer` for positions `0..len` (including rows appended this pass).
    pub fn layer(&self, layer: usize) -> (&[f32], &[f32]) {
        (&self.k[layer], &self.v[layer])
    }

    /// Bytes held by the cache allocations.
    pub fn allocated_bytes(&self) -> usize {
        self.k.iter().chain(&self.v).map(|b| b.capacity() * 4).sum()
    }
}
