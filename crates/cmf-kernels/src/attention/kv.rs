//! Key/value storage: element types, a per-layer cache, and borrowed views the kernels read.
//!
//! Element type (see `docs/kernels.md` for the measured decode-speed effect at ctx 4096):
//! - `F32`: exact; what the f32 parity tests against transformers use.
//! - `F16` (recommended default for generation): half the memory and half the bytes streamed per
//!   decoded token; 11-bit mantissa, values up to 65504 (K/V after projection are far below).
//! - `Bf16`: same size as f16, f32 range, 8-bit mantissa (coarser than f16).

/// Element type of a KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvDtype {
    F32,
    F16,
    Bf16,
}

impl KvDtype {
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::Bf16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Bf16 => "bf16",
        }
    }

    pub fn from_name(s: &str) -> Option<KvDtype> {
        match s {
            "f32" => Some(KvDtype::F32),
            "f16" => Some(KvDtype::F16),
            "bf16" => Some(KvDtype::Bf16),
            _ => None,
        }
    }
}

/// Borrowed rows of keys or values: `[len, n_kv_heads, head_dim]`, token-major.
#[derive(Clone, Copy, Debug)]
pub enum KvSlice<'a> {
    F32(&'a [f32]),
    F16(&'a [u16]),
    Bf16(&'a [u16]),
}

impl KvSlice<'_> {
    pub fn len(&self) -> usize {
        match self {
            KvSlice::F32(s) => s.len(),
            KvSlice::F16(s) | KvSlice::Bf16(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Keys and values the attention reads: `len` tokens of `[n_kv_heads, head_dim]` each.
#[derive(Clone, Copy, Debug)]
pub struct Kv<'a> {
    pub k: KvSlice<'a>,
    pub v: KvSlice<'a>,
    pub len: usize,
}

impl<'a> Kv<'a> {
    /// Plain f32 keys and values (`len` = k.len() / (n_kv_heads·head_dim), checked by the kernel).
    pub fn f32(k: &'a [f32], v: &'a [f32], len: usize) -> Kv<'a> {
        Kv {
            k: KvSlice::F32(k),
            v: KvSlice::F32(v),
            len,
        }
    }
}

#[inline(always)]
pub(crate) fn f16_bits_to_f32(h: u16) -> f32 {
    // Normal and subnormal halves: move the bits into an f32 and rescale by 2^112
    // (exact); infinities and NaNs: set the f32 exponent to all ones.
    let h = h as u32;
    let sign = (h & 0x8000) << 16;
    let em = h & 0x7FFF;
    let v = f32::from_bits(em << 13) * f32::from_bits(0x7780_0000);
    let bits = if em >= 0x7C00 {
        (em << 13) | 0x7F80_0000
    } else {
        v.to_bits()
    };
    f32::from_bits(bits | sign)
}

#[inline(always)]
pub(crate) fn bf16_bits_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

fn f32_to_bf16_bits(v: f32) -> u16 {
    half::bf16::from_f32(v).to_bits()
}

fn f32_to_f16_bits(v: f32) -> u16 {
    half::f16::from_f32(v).to_bits()
}

enum Store {
    F32(Vec<f32>),
    F16(Vec<u16>),
    Bf16(Vec<u16>),
}

impl Store {
    fn new(dtype: KvDtype, n: usize) -> Store {
        match dtype {
            KvDtype::F32 => Store::F32(vec![0.0; n]),
            KvDtype::F16 => Store::F16(vec![0; n]),
            KvDtype::Bf16 => Store::Bf16(vec![0; n]),
        }
    }

    fn write(&mut self, at: usize, src: &[f32]) {
        match self {
            Store::F32(d) => d[at..at + src.len()].copy_from_slice(src),
            Store::F16(d) => d[at..at + src.len()]
                .iter_mut()
                .zip(src)
                .for_each(|(o, v)| *o = f32_to_f16_bits(*v)),
            Store::Bf16(d) => d[at..at + src.len()]
                .iter_mut()
                .zip(src)
                .for_each(|(o, v)| *o = f32_to_bf16_bits(*v)),
        }
    }

    fn slice(&self, n: usize) -> KvSlice<'_> {
        match self {
            Store::F32(d) => KvSlice::F32(&d[..n]),
            Store::F16(d) => KvSlice::F16(&d[..n]),
            Store::Bf16(d) => KvSlice::Bf16(&d[..n]),
        }
    }
}

/// One layer's keys and values, `[capacity, n_kv_heads, head_dim]` each, allocated up front.
pub struct KvCache {
    dtype: KvDtype,
    capacity: usize,
    n_kv_heads: usize,
    head_dim: usize,
    k: Store,
    v: Store,
}

impl KvCache {
    pub fn new(dtype: KvDtype, capacity: usize, n_kv_heads: usize, head_dim: usize) -> KvCache {
        let n = capacity * n_kv_heads * head_dim;
        KvCache {
            dtype,
            capacity,
            n_kv_heads,
            head_dim,
            k: Store::new(dtype, n),
            v: Store::new(dtype, n),
        }
    }

    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Bytes held (keys and values).
    pub fn bytes(&self) -> usize {
        2 * self.capacity * self.n_kv_heads * self.head_dim * self.dtype.bytes()
    }

    /// Stores `k`, `v` (`[n, n_kv_heads, head_dim]`) at positions `pos..pos + n`.
    pub fn write(&mut self, pos: usize, k: &[f32], v: &[f32]) {
        let row = self.n_kv_heads * self.head_dim;
        assert!(
            k.len() == v.len() && k.len().is_multiple_of(row),
            "KvCache::write: k and v must be n × {row} values"
        );
        assert!(
            pos + k.len() / row <= self.capacity,
            "KvCache::write: positions {pos}.. exceed capacity {}",
            self.capacity
        );
        self.k.write(pos * row, k);
        self.v.write(pos * row, v);
    }

    /// The first `len` positions, for the attention kernels.
    pub fn view(&self, len: usize) -> Kv<'_> {
        assert!(
            len <= self.capacity,
            "KvCache::view: {len} > capacity {}",
            self.capacity
        );
        let n = len * self.n_kv_heads * self.head_dim;
        Kv {
            k: self.k.slice(n),
            v: self.v.slice(n),
            len,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_decode_matches_half_for_every_bit_pattern() {
        for h in 0..=u16::MAX {
            let want = half::f16::from_bits(h).to_f32();
            let got = f16_bits_to_f32(h);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{h:#06x}: {got} vs {want}"
            );
        }
    }
}
