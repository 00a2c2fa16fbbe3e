//! Deterministic per-row random numbers: splitmix64 seeding, xoshiro256++ stream, Box–Muller
//! normals. Nothing here is cryptographic; it only has to be fast and reproducible.

/// FNV-1a of a tensor name, mixed into the row seeds.
pub fn hash_str(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01B3)
    })
}

fn splitmix64(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// xoshiro256++ (Blackman & Vigna).
pub struct Xoshiro([u64; 4]);

impl Xoshiro {
    pub fn seeded(mut seed: u64) -> Xoshiro {
        Xoshiro([
            splitmix64(&mut seed),
            splitmix64(&mut seed),
            splitmix64(&mut seed),
            splitmix64(&mut seed),
        ])
    }

    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.0;
        let result = s[0].wrapping_add(s[3]).rotate_left(23).wrapping_add(s[0]);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Two uniforms from one draw: u1 in (0, 1] (24 bits, never 0: Box–Muller takes its log)
    /// and u2 in [0, 1) (24 bits).
    fn two_units(&mut self) -> (f32, f32) {
        const SCALE: f32 = 1.0 / (1u32 << 24) as f32;
        let x = self.next_u64();
        (
            ((x >> 40) + 1) as f32 * SCALE,
            ((x >> 16) & 0xFF_FFFF) as f32 * SCALE,
        )
    }
}

/// Fills `row` with N(0, std²) values from the generator of (seed, tensor, row). Box–Muller in
/// f32 (two normals per 64-bit draw): exact enough for random benchmark weights, and the
/// generation cost stays below the encoding cost.
pub fn normal_row(seed: u64, tensor_hash: u64, row: u64, std: f32, out: &mut [f32]) {
    let mut g = Xoshiro::seeded(
        seed ^ tensor_hash.rotate_left(17) ^ row.wrapping_mul(0xD1B5_4A32_D192_ED03),
    );
    for pair in out.chunks_mut(2) {
        let (u1, u2) = g.two_units();
        let r = (-2.0 * u1.ln()).sqrt() * std;
        let (s, c) = (std::f32::consts::TAU * u2).sin_cos();
        pair[0] = r * c;
        if let Some(second) = pair.get_mut(1) {
            *second = r * s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_moments_and_determinism() {
        let mut row = vec![0f32; 100_000];
        normal_row(1, hash_str("w"), 3, 0.02, &mut row);
        let n = row.len() as f64;
        let mean = row.iter().map(|&v| v as f64).sum::<f64>() / n;
        let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
        assert!(mean.abs() < 5e-4, "mean {mean}");
        assert!((var.sqrt() - 0.02).abs() < 5e-4, "std {}", var.sqrt());
        let mut again = vec![0f32; 100_000];
        normal_row(1, hash_str("w"), 3, 0.02, &mut again);
        assert_eq!(row, again);
        normal_row(1, hash_str("w"), 4, 0.02, &mut again);
        assert_ne!(row, again);
    }
}
