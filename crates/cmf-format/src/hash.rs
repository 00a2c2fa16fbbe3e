//! `hash64`: the per-tensor and per-section checksum of CMF v2 (spec §8).
//!
//! Not cryptographic: it detects corruption, it does not authenticate. Matches
//! `cortiq_core::hash::hash64` bit for bit (tested in `tests/interop_*.rs`).
//!
//! Definition: for each full 8-byte little-endian word `w_i`,
//! `acc ^= fmix64(w_i) ^ i·0x9E3779B97F4A7C15`; a shorter tail is zero-padded and
//! takes the next index; then `acc ^= len` and the result is `fmix64(acc)`.

const SALT: u64 = 0x9E37_79B9_7F4A_7C15;

/// murmur3's 64-bit finalizer.
#[inline]
fn fmix64(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    x ^= x >> 33;
    x = x.wrapping_mul(0xC4CE_B9FE_1A85_EC53);
    x ^= x >> 33;
    x
}

/// hash64 of a whole buffer.
pub fn hash64(bytes: &[u8]) -> u64 {
    let mut h = Hasher64::new();
    h.update(bytes);
    h.finish()
}

/// Incremental hash64, for payloads written in pieces (the streaming writer).
/// `update` may be called with any split of the input; the result equals
/// [`hash64`] of the concatenation.
#[derive(Debug, Clone, Default)]
pub struct Hasher64 {
    acc: u64,
    /// Index of the next full word.
    word: u64,
    /// Bytes of a word not yet complete.
    pending: [u8; 8],
    pending_len: usize,
    len: u64,
}

impl Hasher64 {
    pub fn new() -> Self {
        Self::default()
    }

    #[inline]
    fn mix_word(&mut self, w: u64) {
        self.acc ^= fmix64(w) ^ self.word.wrapping_mul(SALT);
        self.word += 1;
    }

    pub fn update(&mut self, mut bytes: &[u8]) {
        self.len += bytes.len() as u64;
        if self.pending_len > 0 {
            let take = (8 - self.pending_len).min(bytes.len());
            self.pending[self.pending_len..self.pending_len + take].copy_from_slice(&bytes[..take]);
            self.pending_len += take;
            bytes = &bytes[take..];
            if self.pending_len < 8 {
                return;
            }
            self.mix_word(u64::from_le_bytes(self.pending));
            self.pending_len = 0;
        }
        let mut words = bytes.chunks_exact(8);
        for w in &mut words {
            self.mix_word(u64::from_le_bytes(w.try_into().expect("8-byte chunk")));
        }
        let rest = words.remainder();
        self.pending[..rest.len()].copy_from_slice(rest);
        self.pending_len = rest.len();
    }

    pub fn finish(&self) -> u64 {
        let mut acc = self.acc;
        if self.pending_len > 0 {
            let mut w = [0u8; 8];
            w[..self.pending_len].copy_from_slice(&self.pending[..self.pending_len]);
            acc ^= fmix64(u64::from_le_bytes(w)) ^ self.word.wrapping_mul(SALT);
        }
        fmix64(acc ^ self.len)
    }

    /// Bytes hashed so far.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn incremental_equals_one_shot_for_every_split() {
        let data: Vec<u8> = (0..61u32).map(|i| (i * 37 + 11) as u8).collect();
        let whole = hash64(&data);
        for a in 0..data.len() {
            for b in a..data.len() {
                let mut h = Hasher64::new();
                h.update(&data[..a]);
                h.update(&data[a..b]);
                h.update(&data[b..]);
                assert_eq!(h.finish(), whole, "split at {a},{b}");
            }
        }
    }

    #[test]
    fn length_and_content_matter() {
        assert_ne!(hash64(&[]), hash64(&[0]));
        assert_ne!(hash64(&[0; 8]), hash64(&[0; 16]));
        assert_ne!(hash64(b"abcdefgh"), hash64(b"abcdefgi"));
    }
}
