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

/// How token j of kv head h is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvLayout {
    /// `[len, n_kv_heads, head_dim]`: what a K or V projection produces.
    TokenMajor,
    /// `[n_kv_heads, capacity, head_dim]`: the cache layout, so that decode streams each head's
    /// keys sequentially.
    HeadMajor { capacity: usize },
}

/// Keys and values the attention reads: `len` tokens of `n_kv_heads × head_dim` each.
#[derive(Clone, Copy, Debug)]
pub struct Kv<'a> {
    pub k: KvSlice<'a>,
    pub v: KvSlice<'a>,
    pub len: usize,
    pub layout: KvLayout,
}

impl<'a> Kv<'a> {
    /// Plain f32 keys and values, token-major `[len, n_kv_heads, head_dim]`.
    pub fn f32(k: &'a [f32], v: &'a [f32], len: usize) -> Kv<'a> {
        Kv {
            k: KvSlice::F32(k),
            v: KvSlice::F32(v),
            len,
            layout: KvLayout::TokenMajor,
        }
    }

    /// Element offset of (token j, kv head h) and the distance between consecutive tokens.
    #[inline(always)]
    pub(crate) fn at(&self, j: usize, h: usize, n_kv: usize, hd: usize) -> usize {
        match self.layout {
            KvLayout::TokenMajor => (j * n_kv + h) * hd,
            KvLayout::HeadMajor { capacity } => (h * capacity + j) * hd,
        }
    }

    #[inline(always)]
    pub(crate) fn token_stride(&self, n_kv: usize, hd: usize) -> usize {
        match self.layout {
            KvLayout::TokenMajor => n_kv * hd,
            KvLayout::HeadMajor { .. } => hd,
        }
    }

    /// Elements the slices must hold for `len` tokens.
    pub(crate) fn needed(&self, n_kv: usize, hd: usize) -> usize {
        match self.layout {
            KvLayout::TokenMajor => self.len * n_kv * hd,
            KvLayout::HeadMajor { capacity } if self.len > 0 => {
                ((n_kv - 1) * capacity + self.len) * hd
            }
            KvLayout::HeadMajor { .. } => 0,
        }
    }
}

pub(crate) use crate::codec::f16_to_f32 as f16_bits_to_f32;

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

pub(crate) enum Store {
    F32(Vec<f32>),
    F16(Vec<u16>),
    Bf16(Vec<u16>),
}

/// Element types whose all-zero bit pattern is the value zero.
trait ZeroBits: Copy {}
impl ZeroBits for f32 {}
impl ZeroBits for u16 {}

/// `vec![0; n]` that returns None where the allocator refuses instead of aborting the process:
/// a cache sized from a model file's hyper-parameters may be absurd, and the caller turns that
/// into an error naming the sizes. Zeroed pages are committed lazily by the OS, as with `vec!`.
fn try_zeroed<T: ZeroBits>(n: usize) -> Option<Vec<T>> {
    let layout = std::alloc::Layout::array::<T>(n).ok()?;
    if layout.size() == 0 {
        return Some(Vec::new());
    }
    // SAFETY: the layout has a non-zero size; zero bits are a valid T (ZeroBits); the block comes
    // from the global allocator with exactly the layout Vec uses for capacity n.
    unsafe {
        let p = std::alloc::alloc_zeroed(layout).cast::<T>();
        (!p.is_null()).then(|| Vec::from_raw_parts(p, n, n))
    }
}

impl Store {
    pub(crate) fn try_new(dtype: KvDtype, n: usize) -> Option<Store> {
        Some(match dtype {
            KvDtype::F32 => Store::F32(try_zeroed(n)?),
            KvDtype::F16 => Store::F16(try_zeroed(n)?),
            KvDtype::Bf16 => Store::Bf16(try_zeroed(n)?),
        })
    }

    /// Writes `src` at element `at`.
    pub(crate) fn write(&mut self, at: usize, src: &[f32]) {
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

    /// Copies elements `src..src + n` to `dst..dst + n` (stored values, no conversion).
    pub(crate) fn copy_within(&mut self, src: usize, dst: usize, n: usize) {
        match self {
            Store::F32(d) => d.copy_within(src..src + n, dst),
            Store::F16(d) | Store::Bf16(d) => d.copy_within(src..src + n, dst),
        }
    }

    pub(crate) fn slice(&self, n: usize) -> KvSlice<'_> {
        match self {
            Store::F32(d) => KvSlice::F32(&d[..n]),
            Store::F16(d) => KvSlice::F16(&d[..n]),
            Store::Bf16(d) => KvSlice::Bf16(&d[..n]),
        }
    }
}

/// One layer's keys and values, `[n_kv_heads, capacity, head_dim]` each (head-major: decode reads
/// each head's keys as one sequential stream), allocated up front.
pub struct KvCache {
    dtype: KvDtype,
    capacity: usize,
    n_kv_heads: usize,
    head_dim: usize,
    k: Store,
    v: Store,
}

impl KvCache {
    /// Panics where the memory cannot be reserved; see [`KvCache::try_new`].
    pub fn new(dtype: KvDtype, capacity: usize, n_kv_heads: usize, head_dim: usize) -> KvCache {
        KvCache::try_new(dtype, capacity, n_kv_heads, head_dim).unwrap_or_else(|| {
            panic!("cannot allocate a KV cache of {capacity} × {n_kv_heads} × {head_dim}")
        })
    }

    /// None where the sizes overflow or the allocator refuses them.
    pub fn try_new(
        dtype: KvDtype,
        capacity: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> Option<KvCache> {
        let n = capacity.checked_mul(n_kv_heads)?.checked_mul(head_dim)?;
        Some(KvCache {
            dtype,
            capacity,
            n_kv_heads,
            head_dim,
            k: Store::try_new(dtype, n)?,
            v: Store::try_new(dtype, n)?,
        })
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
        let (hd, cap) = (self.head_dim, self.capacity);
        for (t, (kt, vt)) in k.chunks(row).zip(v.chunks(row)).enumerate() {
            for h in 0..self.n_kv_heads {
                let at = (h * cap + pos + t) * hd;
                self.k.write(at, &kt[h * hd..(h + 1) * hd]);
                self.v.write(at, &vt[h * hd..(h + 1) * hd]);
            }
        }
    }

    /// The first `len` positions, for the attention kernels.
    pub fn view(&self, len: usize) -> Kv<'_> {
        assert!(
            len <= self.capacity,
            "KvCache::view: {len} > capacity {}",
            self.capacity
        );
        let n = self.capacity * self.n_kv_heads * self.head_dim;
        Kv {
            k: self.k.slice(n),
            v: self.v.slice(n),
            len,
            layout: KvLayout::HeadMajor {
                capacity: self.capacity,
            },
        }
    }
}
