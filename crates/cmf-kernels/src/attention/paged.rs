//! Paged keys and values: one layer's pool of fixed-size blocks that many sequences share, each
//! sequence naming its blocks in a block table (position `p` lives in block `table[p / size]`,
//! slot `p % size`).
//!
//! Layout: `[num_blocks, block_size, n_kv_heads, head_dim]` for K and for V, so one block of one
//! layer is a contiguous run of `block_size` token-major rows.
//!
//! [`attention_paged`] is the CPU reference: it gathers a sequence's blocks into a contiguous
//! token-major copy and runs [`super::attention`] on it, so its arithmetic is the contiguous
//! kernel's (the layout does not change the order of any sum). A device implements the same
//! contract over its own block pool.

use super::kv::{KvDtype, KvLayout, KvSlice, Store};
use super::{attention, AttnParams, Kv};

/// One layer's block pool.
pub struct KvBlocks {
    dtype: KvDtype,
    num_blocks: usize,
    block_size: usize,
    n_kv_heads: usize,
    head_dim: usize,
    k: Store,
    v: Store,
}

impl KvBlocks {
    /// A pool of `num_blocks` blocks of `block_size` positions, zeroed (the OS commits pages
    /// as blocks are first written). Panics where the memory cannot be reserved; see
    /// [`KvBlocks::try_new`].
    pub fn new(
        dtype: KvDtype,
        num_blocks: usize,
        block_size: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> KvBlocks {
        KvBlocks::try_new(dtype, num_blocks, block_size, n_kv_heads, head_dim).unwrap_or_else(
            || panic!("cannot allocate {num_blocks} KV blocks of {block_size} × {n_kv_heads} × {head_dim}"),
        )
    }

    /// [`KvBlocks::new`], or None where the sizes overflow or the allocator refuses them.
    pub fn try_new(
        dtype: KvDtype,
        num_blocks: usize,
        block_size: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> Option<KvBlocks> {
        assert!(block_size > 0, "KvBlocks: block size 0");
        let n = num_blocks
            .checked_mul(block_size)?
            .checked_mul(n_kv_heads)?
            .checked_mul(head_dim)?;
        Some(KvBlocks {
            dtype,
            num_blocks,
            block_size,
            n_kv_heads,
            head_dim,
            k: Store::try_new(dtype, n)?,
            v: Store::try_new(dtype, n)?,
        })
    }

    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Bytes one block takes in this layer (keys and values).
    pub fn block_bytes(block_size: usize, n_kv_heads: usize, head_dim: usize, d: KvDtype) -> usize {
        2 * block_size * n_kv_heads * head_dim * d.bytes()
    }

    fn row(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Stores `k`, `v` (`[n, n_kv_heads, head_dim]`) at positions `pos..pos + n` of the sequence
    /// whose blocks are `table`.
    pub fn write(&mut self, table: &[u32], pos: usize, k: &[f32], v: &[f32]) {
        let (row, bs) = (self.row(), self.block_size);
        assert!(
            k.len() == v.len() && k.len().is_multiple_of(row),
            "KvBlocks::write: k and v must be n × {row} values"
        );
        let n = k.len() / row;
        assert!(
            (pos + n).div_ceil(bs) <= table.len(),
            "KvBlocks::write: positions {pos}..{} exceed the {} blocks of the table",
            pos + n,
            table.len()
        );
        for t in 0..n {
            let p = pos + t;
            let block = table[p / bs] as usize;
            assert!(
                block < self.num_blocks,
                "KvBlocks::write: block {block} out of range"
            );
            let at = (block * bs + p % bs) * row;
            self.k.write(at, &k[t * row..(t + 1) * row]);
            self.v.write(at, &v[t * row..(t + 1) * row]);
        }
    }

    /// Copies block `src`'s keys and values into block `dst` (a sequence taking a private copy
    /// of a block it shares before writing into it).
    pub fn copy_block(&mut self, src: u32, dst: u32) {
        let (src, dst) = (src as usize, dst as usize);
        assert!(
            src < self.num_blocks && dst < self.num_blocks,
            "KvBlocks::copy_block: block {src} or {dst} out of range"
        );
        let n = self.block_size * self.row();
        self.k.copy_within(src * n, dst * n, n);
        self.v.copy_within(src * n, dst * n, n);
    }

    /// The first `len` positions of the sequence whose blocks are `table`.
    pub fn view<'a>(&'a self, table: &'a [u32], len: usize) -> PagedKv<'a> {
        assert!(
            len.div_ceil(self.block_size) <= table.len(),
            "KvBlocks::view: {len} positions need more than the table's {} blocks",
            table.len()
        );
        PagedKv {
            blocks: self,
            table,
            len,
        }
    }
}

/// A sequence's keys and values in a block pool.
#[derive(Clone, Copy)]
pub struct PagedKv<'a> {
    blocks: &'a KvBlocks,
    table: &'a [u32],
    len: usize,
}

impl PagedKv<'_> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Copies the first `len` rows of a paged sequence into one token-major buffer.
fn gather<T: Copy + Default>(src: &[T], kv: &PagedKv, row: usize) -> Vec<T> {
    let bs = kv.blocks.block_size;
    let mut out = Vec::with_capacity(kv.len * row);
    for (i, &b) in kv.table.iter().enumerate() {
        let n = kv.len.saturating_sub(i * bs).min(bs);
        if n == 0 {
            break;
        }
        let at = b as usize * bs * row;
        out.extend_from_slice(&src[at..at + n * row]);
    }
    out
}

fn sub_slice(s: KvSlice<'_>, at: usize, n: usize) -> KvSlice<'_> {
    match s {
        KvSlice::F32(d) => KvSlice::F32(&d[at..at + n]),
        KvSlice::F16(d) => KvSlice::F16(&d[at..at + n]),
        KvSlice::Bf16(d) => KvSlice::Bf16(&d[at..at + n]),
    }
}

enum Gathered {
    F32(Vec<f32>, Vec<f32>),
    F16(Vec<u16>, Vec<u16>),
    Bf16(Vec<u16>, Vec<u16>),
}

/// [`super::attention`] of `q` (`[nq, n_heads, head_dim]`, first query at `p.q_pos0`) against a
/// paged sequence.
pub fn attention_paged(q: &[f32], kv: PagedKv, p: &AttnParams, out: &mut [f32]) {
    let b = kv.blocks;
    assert!(
        p.n_kv_heads == b.n_kv_heads && p.head_dim == b.head_dim,
        "attention_paged: parameters name {}×{} kv heads, the pool holds {}×{}",
        p.n_kv_heads,
        p.head_dim,
        b.n_kv_heads,
        b.head_dim
    );
    let row = b.row();
    let all = b.num_blocks * b.block_size * row;
    // Blocks that follow each other in the pool (a sequence that got fresh blocks in order) are
    // already one token-major run: read them in place instead of copying.
    let used = &kv.table[..kv.len.div_ceil(b.block_size)];
    if let Some(&first) = used.first() {
        if used
            .iter()
            .enumerate()
            .all(|(i, &t)| t as usize == first as usize + i)
        {
            let (at, n) = (first as usize * b.block_size * row, kv.len * row);
            let view = Kv {
                k: sub_slice(b.k.slice(all), at, n),
                v: sub_slice(b.v.slice(all), at, n),
                len: kv.len,
                layout: KvLayout::TokenMajor,
            };
            return attention(q, view, p, None, out);
        }
    }
    let g = match (b.k.slice(all), b.v.slice(all)) {
        (KvSlice::F32(k), KvSlice::F32(v)) => {
            Gathered::F32(gather(k, &kv, row), gather(v, &kv, row))
        }
        (KvSlice::F16(k), KvSlice::F16(v)) => {
            Gathered::F16(gather(k, &kv, row), gather(v, &kv, row))
        }
        (KvSlice::Bf16(k), KvSlice::Bf16(v)) => {
            Gathered::Bf16(gather(k, &kv, row), gather(v, &kv, row))
        }
        _ => unreachable!("K and V share one element type"),
    };
    let (k, v) = match &g {
        Gathered::F32(k, v) => (KvSlice::F32(k), KvSlice::F32(v)),
        Gathered::F16(k, v) => (KvSlice::F16(k), KvSlice::F16(v)),
        Gathered::Bf16(k, v) => (KvSlice::Bf16(k), KvSlice::Bf16(v)),
    };
    let view = Kv {
        k,
        v,
        len: kv.len,
        layout: KvLayout::TokenMajor,
    };
    attention(q, view, p, None, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::KvCache;

    /// A pool the allocator refuses, or whose size overflows, is None, not an abort.
    #[test]
    fn an_absurd_pool_is_none() {
        assert!(KvBlocks::try_new(KvDtype::F32, 1 << 30, 1 << 10, 1 << 8, 1 << 8).is_none());
        assert!(KvBlocks::try_new(KvDtype::F16, usize::MAX / 2, 16, 8, 128).is_none());
        assert!(KvBlocks::try_new(KvDtype::Bf16, 4, 16, 2, 16).is_some());
    }

    /// Scattered blocks give exactly the contiguous cache's output, for every element type.
    #[test]
    fn paged_equals_contiguous() {
        let (kvh, hd, heads, bs) = (2, 16, 4, 4);
        let row = kvh * hd;
        let len = 23;
        let val = |i: usize| ((i * 7919 % 1000) as f32 / 500.0) - 1.0;
        let k: Vec<f32> = (0..len * row).map(val).collect();
        let v: Vec<f32> = (0..len * row).map(|i| val(i + 13)).collect();
        let q: Vec<f32> = (0..3 * heads * hd).map(|i| val(i + 101)).collect();
        // Scattered blocks (gathered) and consecutive ones (read in place).
        for (table, dtype) in [[5u32, 0, 7, 2, 3, 9], [3u32, 4, 5, 6, 7, 8]]
            .into_iter()
            .flat_map(|t| [KvDtype::F32, KvDtype::F16, KvDtype::Bf16].map(|d| (t, d)))
        {
            let mut cache = KvCache::new(dtype, 32, kvh, hd);
            cache.write(0, &k, &v);
            let mut pool = KvBlocks::new(dtype, 10, bs, kvh, hd);
            // Written in two pieces across a block boundary.
            pool.write(&table, 0, &k[..10 * row], &v[..10 * row]);
            pool.write(&table, 10, &k[10 * row..], &v[10 * row..]);
            let p = AttnParams {
                n_heads: heads,
                n_kv_heads: kvh,
                head_dim: hd,
                scale: 0.25,
                causal: true,
                q_pos0: len - 3,
                window: None,
            };
            let mut want = vec![0f32; q.len()];
            attention(&q, cache.view(len), &p, None, &mut want);
            let mut got = vec![0f32; q.len()];
            attention_paged(&q, pool.view(&table, len), &p, &mut got);
            assert_eq!(got, want, "{dtype:?} {table:?}");
            // A copied block stands in for its original exactly (block 1 is in neither table).
            pool.copy_block(table[2], 1);
            let mut copied = table;
            copied[2] = 1;
            attention_paged(&q, pool.view(&copied, len), &p, &mut got);
            assert_eq!(got, want, "{dtype:?} {copied:?} (copied block)");
        }
    }
}
