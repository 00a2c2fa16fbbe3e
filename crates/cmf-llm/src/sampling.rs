//! Choosing the next token from logits: the user-facing parameters ([`SamplingParams`], what
//! the CLI and the API accept) and the host sampler. The algorithm itself lives in
//! `cmf_gpu::llm::sample`, shared with the device sampler so that a seed draws the same tokens
//! on the CPU and on the GPU: penalties on the raw logits → temperature → top-k → top-p → min-p
//! → a draw from (seed, position). Its module notes define each step.
//!
//! - repetition penalty (CTRL; transformers `RepetitionPenaltyLogitsProcessor`, llama.cpp
//!   `penalty_repeat`); presence / frequency penalty (OpenAI, llama.cpp `penalty_present` /
//!   `penalty_freq`); all three over the last `penalty_last_n` tokens, prompt included
//!   (llama.cpp's default window is 64);
//! - the draw's random number is a pure function of the seed and the token's position (a
//!   counter-based generator), so a step re-run after a device refusal, or run ahead on the
//!   device, draws the same token.

use cmf_gpu::llm::batch::RowSampling;
use cmf_gpu::llm::sample;

/// The parameters the CLI and the API accept are the shared algorithm's own description.
pub use sample::SampleSpec as SamplingParams;

/// The host sampler.
pub struct Sampler {
    pub params: SamplingParams,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Sampler {
        Sampler { params }
    }

    /// Picks the next token. `logits` is modified (penalties applied); `history` is the sequence
    /// so far (prompt and generated, the token these logits follow last): the penalties look at
    /// its last `penalty_last_n` ids and the draw at its last position.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        row(history, self.params).sample_host(logits)
    }
}

/// What a sampler reads of a sequence whose tokens are `history` (the token its logits follow
/// last): the penalty window (its last `penalty_last_n` ids) and the draw's position. The host
/// sampler and the batched device draws (`BatchEngine::step_sampled`) both take it from here.
pub fn row(history: &[u32], spec: SamplingParams) -> RowSampling<'_> {
    RowSampling {
        spec,
        pos: history.len().saturating_sub(1) as u64,
        window: &history[history.len().saturating_sub(spec.penalty_last_n)..],
    }
}

pub use sample::argmax;

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

    /// The window is the history's tail and the draw's position its last index, so sampling a
    /// suffix of the same history with the same seed draws the same token.
    #[test]
    fn window_and_position_come_from_the_history() {
        let logits: Vec<f32> = (0..40).map(|i| (i as f32 * 0.61).cos()).collect();
        let params = SamplingParams {
            temperature: 1.0,
            repeat_penalty: 1.5,
            penalty_last_n: 3,
            seed: 9,
            ..Default::default()
        };
        let history = [5u32, 6, 7, 8, 9, 10];
        let mut s = Sampler::new(params);
        let got = s.sample(&mut logits.clone(), &history);
        let want = sample::sample(&mut logits.clone(), &[8, 9, 10], &params, 5);
        assert_eq!(got, want);
        // The penalised ids are the window's.
        let mut l = logits.clone();
        s.sample(&mut l, &history);
        assert_ne!(l[10], logits[10]);
        assert_eq!(l[5], logits[5]);
    }

    #[test]
    fn greedy_is_argmax_lowest_tie() {
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&mut [0.1, 3.0, 3.0, -1.0], &[]), 1);
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
