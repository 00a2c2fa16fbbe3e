//! Per-sequence key/value cache: one `cmf_kernels::KvCache` per layer (rows
//! `[pos][kv_heads · head_dim]`, keys as RoPE left them) plus how many positions are filled.
//!
//! The per-layer buffers are allocated zeroed for `limit` positions up front; the OS commits
//! pages as they are written, so resident memory follows the positions actually used.

use crate::{LlmError, Result};
use cmf_kernels::{Kv, KvDtype};

pub struct KvCache {
    /// Positions filled (the same for every layer between forward passes).
    len: usize,
    limit: usize,
    layers: Vec<cmf_kernels::KvCache>,
}

impl KvCache {
    /// Reserves `limit` positions per layer; an error (not an abort) where the sizes, which come
    /// from the model file and the caller's context, cannot be allocated.
    pub fn new(
        num_layers: usize,
        kv_heads: usize,
        head_dim: usize,
        limit: usize,
        dtype: KvDtype,
    ) -> Result<KvCache> {
        let layers = (0..num_layers)
            .map(|_| cmf_kernels::KvCache::try_new(dtype, limit, kv_heads, head_dim))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                let bytes = (2 * num_layers * dtype.bytes()) as f64
                    * limit as f64
                    * kv_heads as f64
                    * head_dim as f64;
                LlmError::Other(format!(
                    "cannot reserve the KV cache: {limit} positions × {num_layers} layers × \
                     {kv_heads} KV heads × {head_dim} = {:.1} GiB; a shorter context needs less",
                    bytes / (1u64 << 30) as f64
                ))
            })?;
        Ok(KvCache {
            len: 0,
            limit,
            layers,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Largest number of positions the cache holds.
    pub fn limit(&self) -> usize {
        self.limit
    }

    pub fn dtype(&self) -> KvDtype {
        self.layers.first().map_or(KvDtype::F32, |l| l.dtype())
    }

    /// Forgets every position (a new sequence).
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Keeps the first `len` positions (e.g. the part of a chat that did not change).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Writes `n` new positions of `layer` after the filled ones (`k`, `v`: `[n, kv_dim]`).
    pub(crate) fn write(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        self.layers[layer].write(self.len, k, v);
    }

    /// Marks `n` positions written by every layer as filled.
    pub(crate) fn commit(&mut self, n: usize) {
        self.len += n;
    }

    /// Keys and values of `layer` for the first `len` positions.
    pub fn view(&self, layer: usize, len: usize) -> Kv<'_> {
        self.layers[layer].view(len)
    }

    /// Bytes reserved for keys and values (virtual; see the module note).
    pub fn reserved_bytes(&self) -> usize {
        self.layers.iter().map(|l| l.bytes()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_absurd_reservation_is_an_error_not_an_abort() {
        // 2^20 positions × 2^24 KV values × 4 bytes: 64 PiB per layer, past any address space.
        let err = KvCache::new(2, 1 << 16, 1 << 8, 1 << 20, KvDtype::F32)
            .err()
            .unwrap();
        assert!(
            err.to_string().contains("cannot reserve the KV cache"),
            "{err}"
        );
        // Sizes whose product overflows usize.
        assert!(KvCache::new(1, usize::MAX / 2, 4, 3, KvDtype::F16).is_err());
        let ok = KvCache::new(2, 2, 8, 16, KvDtype::Bf16).unwrap();
        assert_eq!(ok.reserved_bytes(), 2 * 2 * 2 * 8 * 16 * 2);
    }
}
