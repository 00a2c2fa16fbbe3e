//! Scaled dot-product attention with grouped-query heads, blockwise with an online softmax
//! (never an N×N score matrix).
//!
//! Shapes: `q[nq, n_heads, head_dim]`, keys/values `[len, n_kv_heads, head_dim]` or, in a
//! [`KvCache`], `[n_kv_heads, capacity, head_dim]` ([`Kv`], [`KvLayout`]),
//! `out[nq, n_heads, head_dim]`. Query head `h` reads kv head `h / (n_heads / n_kv_heads)`
//! (transformers' `repeat_kv`).
//!
//! Two schedules, same arithmetic (f32 throughout, K/V widened from their storage type):
//! - `flash` (many queries: prefill, Z-Image's joint attention): per kv head, K is transposed and
//!   V widened once; tasks are blocks of query tokens; per 64-key block, S = Q·Kᵀ and O += P·V run
//!   as 4×32 register-tiled products.
//! - `decode` (a few queries): tasks are (kv head, key range) pairs so that even one query token
//!   keeps every thread busy (flash-decoding); partial softmax states are merged at the end.
//!
//! Many sequences sharing one block pool: [`paged`] ([`KvBlocks`], [`attention_paged`]).

mod decode;
mod flash;
pub mod kv;
mod paged;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use kv::{Kv, KvCache, KvDtype, KvLayout, KvSlice};
pub use paged::{attention_paged, KvBlocks, PagedKv};

use crate::cpu::Isa;
use crate::simd::Fma;

/// Attention geometry and masking.
#[derive(Clone, Copy, Debug)]
pub struct AttnParams {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Multiplies q·k (usually 1/sqrt(head_dim)).
    pub scale: f32,
    /// Causal: query i, at position `q_pos0 + i`, sees keys at positions ≤ its own.
    pub causal: bool,
    /// Position of the first query (causal and window masks). For decode: `len − 1`.
    pub q_pos0: usize,
    /// Sliding window (with `causal`): a query at position p sees keys p − window < k ≤ p.
    pub window: Option<usize>,
}

impl AttnParams {
    /// Keys `[lo, hi)` that the query at `pos` may see, before the key mask.
    pub(crate) fn key_range(&self, pos: usize, len: usize) -> (usize, usize) {
        if !self.causal {
            return (0, len);
        }
        let hi = (pos + 1).min(len);
        let lo = match self.window {
            Some(w) => (pos + 1).saturating_sub(w),
            None => 0,
        };
        (lo.min(hi), hi)
    }

    fn check(&self, q: &[f32], kv: &Kv, key_mask: Option<&[bool]>, out: &[f32]) -> usize {
        let (h, kvh, d) = (self.n_heads, self.n_kv_heads, self.head_dim);
        assert!(
            h > 0 && kvh > 0 && d > 0 && h % kvh == 0,
            "attention: {h} heads cannot share {kvh} kv heads"
        );
        assert!(
            q.len().is_multiple_of(h * d),
            "attention: q is not [nq, {h}, {d}]"
        );
        assert_eq!(out.len(), q.len(), "attention: out must have q's shape");
        if let KvLayout::HeadMajor { capacity } = kv.layout {
            assert!(
                kv.len <= capacity,
                "attention: {} keys exceed the cache capacity {capacity}",
                kv.len
            );
        }
        let need = kv.needed(kvh, d);
        assert!(
            kv.k.len() >= need && kv.v.len() >= need,
            "attention: keys/values hold fewer than {} tokens",
            kv.len
        );
        if let Some(m) = key_mask {
            assert!(
                m.len() >= kv.len,
                "attention: key mask shorter than {} keys",
                kv.len
            );
        }
        q.len() / (h * d)
    }
}

/// out = softmax(q·kᵀ·scale + mask)·v for every query head. A query that may see no key at all
/// (possible only through `key_mask`) gets zeros.
pub fn attention(q: &[f32], kv: Kv, p: &AttnParams, key_mask: Option<&[bool]>, out: &mut [f32]) {
    attention_with(crate::cpu::active(), q, kv, p, key_mask, out)
}

/// [`attention`] on a given path (tests and benchmarks).
#[doc(hidden)]
pub fn attention_with(
    isa: Isa,
    q: &[f32],
    kv: Kv,
    p: &AttnParams,
    key_mask: Option<&[bool]>,
    out: &mut [f32],
) {
    assert!(
        isa.supported(),
        "attention: {isa} is not supported by this CPU"
    );
    let nq = p.check(q, &kv, key_mask, out);
    if nq == 0 {
        return;
    }
    let group = p.n_heads / p.n_kv_heads;
    if nq * group >= flash::MIN_ROWS && nq >= 4 {
        flash::run(isa, q, &kv, p, key_mask, out, nq)
    } else {
        decode::run(isa, q, &kv, p, key_mask, out, nq)
    }
}

/// Decode step: one query token at position `len − 1` against the first `len` cached positions.
pub fn attention_decode(q: &[f32], cache: &KvCache, len: usize, p: &AttnParams, out: &mut [f32]) {
    let p = AttnParams {
        q_pos0: len.saturating_sub(1),
        ..*p
    };
    attention(q, cache.view(len), &p, None, out)
}

/// Widens `n` elements of a K/V slice starting at `at` into `dst`.
#[inline(always)]
pub(crate) fn widen<F: Fma>(src: KvSlice, at: usize, dst: &mut [f32]) {
    let n = dst.len();
    match src {
        KvSlice::F32(s) => dst.copy_from_slice(&s[at..at + n]),
        KvSlice::F16(s) => {
            let s = &s[at..at + n];
            #[allow(unused_mut)] // only the x86 branch advances it
            let mut i = 0;
            #[cfg(target_arch = "x86_64")]
            if F::X86_SIMD {
                use std::arch::x86_64::*;
                // F16C: eight halves per instruction (this instance runs on AVX2 or AVX-512).
                while i + 8 <= n {
                    // SAFETY: i + 8 ≤ n for both slices; F16C is present in this instance.
                    unsafe {
                        let h = _mm_loadu_si128(s.as_ptr().add(i) as *const __m128i);
                        _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
                    }
                    i += 8;
                }
            }
            for (o, h) in dst[i..].iter_mut().zip(&s[i..]) {
                *o = kv::f16_bits_to_f32(*h);
            }
        }
        KvSlice::Bf16(s) => dst
            .iter_mut()
            .zip(&s[at..at + n])
            .for_each(|(o, h)| *o = kv::bf16_bits_to_f32(*h)),
    }
}

/// Max of a slice with 16 independent lanes (a serial `f32::max` fold does not vectorize).
#[inline(always)]
pub(crate) fn max_lanes(x: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; 16];
    let mut it = x.chunks_exact(16);
    for c in &mut it {
        for l in 0..16 {
            m[l] = if c[l] > m[l] { c[l] } else { m[l] };
        }
    }
    let mut r = it
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a });
    for v in m {
        r = if v > r { v } else { r };
    }
    r
}

/// x ← e^(x − m) in place; returns Σ (16 independent partial sums).
#[inline(always)]
pub(crate) fn exp_sum(x: &mut [f32], m: f32) -> f32 {
    let mut s = [0f32; 16];
    let mut it = x.chunks_exact_mut(16);
    for c in &mut it {
        for l in 0..16 {
            c[l] = crate::ops::math::exp(c[l] - m);
            s[l] += c[l];
        }
    }
    let mut tail = 0f32;
    for v in it.into_remainder() {
        *v = crate::ops::math::exp(*v - m);
        tail += *v;
    }
    s.iter().sum::<f32>() + tail
}

/// Sets the entries of a key block that a row may not see to −∞: keys outside `[lo, hi)` or
/// masked out. `kb0` is the block's first key.
#[inline(always)]
pub(crate) fn mask_block(
    s: &mut [f32],
    kb0: usize,
    lo: usize,
    hi: usize,
    key_mask: Option<&[bool]>,
) {
    let n = s.len();
    let a = lo.saturating_sub(kb0).min(n);
    let b = hi.saturating_sub(kb0).min(n).max(a);
    s[..a].fill(f32::NEG_INFINITY);
    s[b..].fill(f32::NEG_INFINITY);
    if let Some(m) = key_mask {
        for (v, ok) in s[a..b].iter_mut().zip(&m[kb0 + a..kb0 + b]) {
            if !ok {
                *v = f32::NEG_INFINITY;
            }
        }
    }
}

/// Running softmax state of one query row.
#[derive(Clone, Copy)]
pub(crate) struct RowState {
    pub m: f32,
    pub l: f32,
}

impl RowState {
    pub const EMPTY: RowState = RowState {
        m: f32::NEG_INFINITY,
        l: 0.0,
    };
}
