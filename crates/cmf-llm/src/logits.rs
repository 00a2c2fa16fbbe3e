//! What may happen to the logits between the engine and the sampler, on the host: processors
//! that bias or mask them (OpenAI's `logit_bias`, grammar constraints), and the log-probabilities
//! an API reports (OpenAI's `logprobs` / `top_logprobs`).
//!
//! A processor sees the logits of every step before the sampler and is told the token chosen.
//! A processor that only masks ([`LogitProcessor::masks_only`]) can also hand its allowed set
//! over as a bitset ([`LogitProcessor::mask_bits`]), which a device applies to logits that never
//! leave it.

use crate::error::Result;

/// Changes the logits of each step before sampling, and follows the tokens chosen.
pub trait LogitProcessor {
    /// Edits the step's logits in place (biases added, forbidden tokens set to `-inf`).
    fn process(&mut self, logits: &mut [f32]) -> Result<()>;

    /// The token the sampler chose (after `process`); a stateful processor advances here.
    fn accept(&mut self, token: u32) -> Result<()>;

    /// Whether `token` may be chosen at this step (after `process`). The loop asks it to catch
    /// a sampler fallback onto a masked token.
    fn allowed(&self, _token: u32) -> bool {
        true
    }

    /// Whether the processor only forbids tokens (no value changes), so that
    /// [`LogitProcessor::mask_bits`] can stand in for [`LogitProcessor::process`].
    fn masks_only(&self) -> bool {
        false
    }

    /// This step's allowed set, cleared into `words` (bit `i % 32` of word `i / 32` for token
    /// `i`; the caller sets them all first, so several masks combine): what `process` would do
    /// to logits elsewhere. Afterwards `allowed` and `accept` behave as after `process`.
    fn mask_bits(&mut self, _words: &mut [u32]) -> Result<()> {
        Err(crate::error::LlmError::Other(
            "this logit processor has no token mask".into(),
        ))
    }

    /// True when no further token can follow (a grammar reached its end): the loop stops as if
    /// an end-of-sequence token was sampled.
    fn finished(&self) -> bool {
        false
    }
}

/// OpenAI's `logit_bias`: a fixed value added to the logits of some tokens (-100 bans a
/// token in practice, +100 forces it).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LogitBias(pub Vec<(u32, f32)>);

impl LogitProcessor for LogitBias {
    fn process(&mut self, logits: &mut [f32]) -> Result<()> {
        for &(id, b) in &self.0 {
            if let Some(l) = logits.get_mut(id as usize) {
                *l += b;
            }
        }
        Ok(())
    }

    fn accept(&mut self, _token: u32) -> Result<()> {
        Ok(())
    }
}

/// The log-probability of one token and, optionally, of the most likely alternatives at that
/// position (most likely first).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub id: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// `log_softmax(logits)[token]` and the `top` most likely tokens, from the model's own
/// distribution (before penalties, biases, masks and temperature, as OpenAI reports them).
/// The sum of exponentials is taken in f64, as `cmf ppl` does, so the two agree.
pub fn token_logprob(logits: &[f32], token: u32, top: usize) -> TokenLogprob {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    let log_z = max as f64 + sum.ln();
    let lp = |l: f32| (l as f64 - log_z) as f32;
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(top + 1);
    if top > 0 {
        for (i, &l) in logits.iter().enumerate() {
            if l.is_nan() || (best.len() == top && l <= best[top - 1].1) {
                continue;
            }
            let at = best.partition_point(|&(_, b)| b >= l);
            best.insert(at, (i as u32, l));
            best.truncate(top);
        }
    }
    TokenLogprob {
        id: token,
        logprob: logits
            .get(token as usize)
            .map_or(f32::NEG_INFINITY, |&l| lp(l)),
        top: best.into_iter().map(|(i, l)| (i, lp(l))).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_a_normalised_log_softmax() {
        let logits = [1.0f32, 3.0, 2.0, -1.0];
        let t = token_logprob(&logits, 2, 3);
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        assert!((t.logprob as f64 - (2.0 - z.ln())).abs() < 1e-6);
        assert_eq!(t.top.iter().map(|e| e.0).collect::<Vec<_>>(), vec![1, 2, 0]);
        let total: f64 = logits
            .iter()
            .enumerate()
            .map(|(i, _)| (token_logprob(&logits, i as u32, 0).logprob as f64).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-6);
    }

    #[test]
    fn bias_adds_to_the_named_tokens_only() {
        let mut l = vec![0.0f32; 4];
        LogitBias(vec![(1, 5.0), (3, -100.0), (9, 1.0)])
            .process(&mut l)
            .unwrap();
        assert_eq!(l, vec![0.0, 5.0, 0.0, -100.0]);
    }
}
