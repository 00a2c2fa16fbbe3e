//! A seeded generator for test data.

/// splitmix64 from the seed it holds: deterministic, good enough for test data, no dependency.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E3779B97F4A7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub fn f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    /// Uniform in [0, n).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    /// `n` values uniform in [-scale, scale).
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f32() * scale).collect()
    }
    /// Activations with a few large outlier channels, as LLM activations have.
    pub fn activations(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| self.f32() * if i % 97 == 13 { 30.0 } else { 1.0 })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::Rng;

    #[test]
    fn a_seed_gives_one_stream() {
        let (mut a, mut b) = (Rng(7), Rng(7));
        let x: Vec<u64> = (0..4).map(|_| a.next_u64()).collect();
        assert_eq!(x, (0..4).map(|_| b.next_u64()).collect::<Vec<_>>());
        assert_ne!(x[0], Rng(8).next_u64());
        assert!(Rng(1)
            .vec(1000, 2.0)
            .iter()
            .all(|v| (-2.0..2.0).contains(v)));
    }
}
