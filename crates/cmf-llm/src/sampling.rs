//! Choosing the next token from logits.
//!
//! Order (transformers' `_get_logits_processor`: processors, then warpers): penalties on the raw
//! logits → temperature → top-k → top-p → min-p → draw. Temperature 0 (or top-k 1) is greedy: the
//! argmax after penalties, ties to the lowest id.
//!
//! - repetition penalty (CTRL; transformers `RepetitionPenaltyLogitsProcessor`, llama.cpp
//!   `penalty_repeat`): a logit of a recent token is divided by `p` when positive, multiplied
//!   when negative;
//! - presence / frequency penalty (OpenAI, llama.cpp `penalty_present` / `penalty_freq`):
//!   `logit −= presence·[count > 0] + frequency·count`;
//!   all three look at the last `penalty_last_n` tokens of the sequence, prompt included
//!   (llama.cpp's default window is 64);
//! - top-p keeps the smallest set of most likely tokens whose probability reaches p (at least
//!   one); min-p keeps tokens with probability ≥ min_p · p_max.
//!
//! The PRNG is xoshiro256** (Blackman & Vigna) seeded through splitmix64 from the 64-bit seed, so
//! a seed reproduces a run on every platform; a draw is `u = (next() >> 11) · 2⁻⁵³` times the
//! survivors' total, walked along their cumulative probabilities (descending order when top-p
//! sorted them, vocabulary order otherwise).

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    /// 1 = off.
    pub top_p: f32,
    /// 0 = off.
    pub min_p: f32,
    /// 1 = off.
    pub repeat_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Tokens the penalties look back over (0 = none).
    pub penalty_last_n: usize,
    pub seed: u64,
}

impl Default for SamplingParams {
    /// Greedy, no penalties.
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_last_n: 64,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Checks the ranges; the message names the flag-like field at fault.
    pub fn validate(&self) -> Result<(), String> {
        let bad = |f: &str, why: &str| Err(format!("{f}: {why}"));
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad("temperature", "must be ≥ 0");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", "must be in (0, 1]");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", "must be in [0, 1]");
        }
        if !(self.repeat_penalty > 0.0 && self.repeat_penalty.is_finite()) {
            return bad("repeat_penalty", "must be > 0");
        }
        if !self.presence_penalty.is_finite() || !self.frequency_penalty.is_finite() {
            return bad("presence/frequency penalty", "must be finite");
        }
        Ok(())
    }

    fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    fn has_penalties(&self) -> bool {
        self.penalty_last_n > 0
            && (self.repeat_penalty != 1.0
                || self.presence_penalty != 0.0
                || self.frequency_penalty != 0.0)
    }
}

/// A sampler with its PRNG and scratch space (no allocation per token after the first).
pub struct Sampler {
    pub params: SamplingParams,
    rng: Xoshiro256,
    candidates: Vec<(u32, f32)>,
    counts: Vec<(u32, u32)>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Sampler {
        let rng = Xoshiro256::seed(params.seed);
        Sampler {
            params,
            rng,
            candidates: Vec::new(),
            counts: Vec::new(),
        }
    }

    /// Picks the next token. `logits` is modified (penalties applied); `history` is the sequence
    /// so far (prompt and generated), of which the last `penalty_last_n` are penalised.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        let p = &self.params;
        if p.has_penalties() {
            let recent = &history[history.len().saturating_sub(p.penalty_last_n)..];
            self.counts.clear();
            for &t in recent {
                match self.counts.iter_mut().find(|(id, _)| *id == t) {
                    Some((_, c)) => *c += 1,
                    None => self.counts.push((t, 1)),
                }
            }
            for &(t, c) in &self.counts {
                let Some(l) = logits.get_mut(t as usize) else {
                    continue;
                };
                if p.repeat_penalty != 1.0 {
                    *l = if *l > 0.0 {
                        *l / p.repeat_penalty
                    } else {
                        *l * p.repeat_penalty
                    };
                }
                *l -= p.presence_penalty + p.frequency_penalty * c as f32;
            }
        }
        if p.is_greedy() {
            return argmax(logits);
        }

        // Temperature; then truncation, sorting only as much as top-p needs (a full sort of a
        // 150k vocabulary per token would cost milliseconds).
        let inv_t = 1.0 / p.temperature;
        let c = &mut self.candidates;
        c.clear();
        c.extend(
            logits
                .iter()
                .enumerate()
                .filter(|(_, l)| !l.is_nan())
                .map(|(i, &l)| (i as u32, l * inv_t)),
        );
        if c.is_empty() {
            return 0;
        }
        let desc = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && p.top_k < c.len() {
            c.select_nth_unstable_by(p.top_k - 1, desc);
            c.truncate(p.top_k);
        }
        // Softmax over the survivors.
        let max = c.iter().map(|e| e.1).fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f64;
        for e in c.iter_mut() {
            e.1 = (e.1 - max).exp();
            sum += e.1 as f64;
        }
        for e in c.iter_mut() {
            e.1 = (e.1 as f64 / sum) as f32;
        }
        if p.top_p < 1.0 {
            // Sort a growing prefix of the most likely tokens until it holds top_p of the mass.
            let mut k = 64.min(c.len());
            loop {
                if k < c.len() {
                    c.select_nth_unstable_by(k - 1, desc);
                }
                c[..k].sort_unstable_by(desc);
                let mut acc = 0.0f32;
                let keep = c[..k].iter().position(|e| {
                    acc += e.1;
                    acc >= p.top_p
                });
                match keep {
                    Some(i) => {
                        c.truncate(i + 1);
                        break;
                    }
                    None if k == c.len() => break,
                    None => k = (k * 4).min(c.len()),
                }
            }
        }
        if p.min_p > 0.0 {
            let floor = p.min_p * c.iter().map(|e| e.1).fold(0.0, f32::max);
            c.retain(|e| e.1 >= floor);
        }
        let total: f32 = c.iter().map(|e| e.1).sum();
        let u = self.rng.next_f64() as f32 * total;
        let mut acc = 0.0;
        for e in c.iter() {
            acc += e.1;
            if u < acc {
                return e.0;
            }
        }
        c[c.len() - 1].0
    }
}

/// Index of the largest logit; the lowest index wins ties; NaN never wins.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v {
            best = i;
            best_v = v;
        }
    }
    best as u32
}

/// xoshiro256** 1.0 (public-domain reference by Blackman & Vigna), seeded with splitmix64.
#[derive(Clone, Debug)]
pub struct Xoshiro256 {
    s: [u64; 4],
}

impl Xoshiro256 {
    pub fn seed(seed: u64) -> Xoshiro256 {
        let mut x = seed;
        let mut splitmix = || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Xoshiro256 {
            s: [splitmix(), splitmix(), splitmix(), splitmix()],
        }
    }

    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1) with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            ..Default::default()
        }
    }

    #[test]
    fn greedy_is_argmax_lowest_tie() {
        let mut s = Sampler::new(params(0.0));
        assert_eq!(s.sample(&mut [0.1, 3.0, 3.0, -1.0], &[]), 1);
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative() {
        let mut s = Sampler::new(SamplingParams {
            repeat_penalty: 2.0,
            ..params(0.0)
        });
        let mut l = [4.0, 3.0, -1.0];
        assert_eq!(s.sample(&mut l, &[0, 2]), 1);
        assert_eq!(l, [2.0, 3.0, -2.0]);
    }

    #[test]
    fn presence_and_frequency_penalties_within_window() {
        let p = SamplingParams {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            penalty_last_n: 3,
            ..params(0.0)
        };
        let mut s = Sampler::new(p);
        let mut l = [1.0, 1.0, 1.0];
        s.sample(&mut l, &[2, 0, 0, 1]); // window = [0, 0, 1]
        assert_eq!(l, [1.0 - 0.5 - 0.5, 1.0 - 0.5 - 0.25, 1.0]);
    }

    #[test]
    fn top_k_top_p_min_p_restrict_the_support() {
        let logits = [0.0f32, 1.0, 2.0, 3.0, 4.0];
        for (p, allowed) in [
            (
                SamplingParams {
                    top_k: 2,
                    ..params(1.0)
                },
                vec![3, 4],
            ),
            (
                SamplingParams {
                    top_p: 0.5,
                    ..params(1.0)
                },
                vec![4],
            ), // p(4) ≈ 0.64
            (
                SamplingParams {
                    min_p: 0.3,
                    ..params(1.0)
                },
                vec![3, 4],
            ), // p(3)/p(4) ≈ 0.37
        ] {
            let mut s = Sampler::new(SamplingParams { seed: 7, ..p });
            for _ in 0..200 {
                let t = s.sample(&mut logits.clone(), &[]);
                assert!(allowed.contains(&t), "{t} not in {allowed:?}");
            }
        }
    }

    /// Top-p over a flat distribution keeps just enough tokens (past the first sorted block of 64).
    #[test]
    fn top_p_grows_its_sorted_prefix() {
        let mut logits = vec![0.0f32; 1000];
        logits[999] = 0.5; // one slightly likelier token, always kept first
        let mut s = Sampler::new(SamplingParams {
            top_p: 0.5,
            seed: 1,
            ..params(1.0)
        });
        let mut seen = std::collections::HashSet::new();
        for _ in 0..4000 {
            seen.insert(s.sample(&mut logits.clone(), &[]));
        }
        assert!(seen.contains(&999));
        // 0.5 of the mass is ≈ 499 tokens; every draw must come from that set.
        assert!(seen.len() > 400 && seen.len() <= 500, "{}", seen.len());
        assert!(s.candidates.len() <= 500);
    }

    /// With temperature 1 the empirical frequencies follow softmax(logits).
    #[test]
    fn draws_follow_the_distribution() {
        let logits = [0.0f32, (2.0f32).ln(), (5.0f32).ln()]; // probabilities 1/8, 2/8, 5/8
        let mut s = Sampler::new(SamplingParams {
            seed: 42,
            ..params(1.0)
        });
        let mut counts = [0usize; 3];
        let n = 40_000;
        for _ in 0..n {
            counts[s.sample(&mut logits.clone(), &[]) as usize] += 1;
        }
        for (c, p) in counts.iter().zip([0.125, 0.25, 0.625]) {
            assert!((*c as f64 / n as f64 - p).abs() < 0.01, "{counts:?}");
        }
    }

    #[test]
    fn same_seed_same_tokens() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let run = |seed| {
            let mut s = Sampler::new(SamplingParams {
                seed,
                ..params(0.8)
            });
            (0..20)
                .map(|_| s.sample(&mut logits.clone(), &[]))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(3), run(3));
        assert_ne!(run(3), run(4));
    }

    /// First outputs of xoshiro256** for the state {1, 2, 3, 4} (reference C implementation).
    #[test]
    fn xoshiro_reference_values() {
        let mut r = Xoshiro256 { s: [1, 2, 3, 4] };
        assert_eq!(r.next_u64(), 11520);
        assert_eq!(r.next_u64(), 0);
        assert_eq!(r.next_u64(), 1509978240);
        assert_eq!(r.next_u64(), 1215971899390074240);
    }
}
