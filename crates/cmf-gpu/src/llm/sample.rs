//! The sampling algorithm, defined once: the host sampler (cmf-llm) runs this code, and the
//! device sampler (`cuda/llm/kernels/sample.cu`) computes the same thing, so a seed gives the same
//! tokens wherever the step runs (within the rounding notes below).
//!
//! Order (transformers' processors, then warpers): penalties on the raw logits → greedy? →
//! temperature → top-k → top-p → min-p → draw.
//! - Penalties look at the last `penalty_last_n` tokens of the sequence (prompt included, the
//!   token being run included): a recent token's logit is divided by `repeat_penalty` when
//!   positive and multiplied when negative, then `presence + frequency · count` is subtracted.
//! - Greedy (temperature 0 or top-k 1): the arg-max, ties to the lowest id, NaN never wins.
//! - Otherwise every logit becomes a weight `e = exp((l − max) / T)` (f32; NaN logits weigh 0).
//!   Tokens are ranked by (logit descending, id ascending). Top-k keeps the k best; top-p keeps
//!   the shortest ranked prefix whose weight reaches `top_p` of the weight top-k kept; min-p
//!   keeps `e ≥ min_p` (the best token weighs 1).
//! - Weights are summed as 40-bit fixed point in u64 ([`fixed`]): integer sums do not depend on
//!   the order of the additions, so the device's parallel sums equal the host's sequential ones.
//!   The top-p test compares `cum ≥ top_p · total` in f64 on those integers.
//! - The draw: `u` from [`uniform24`] of (seed, position), target `⌊u · kept⌋`, and the kept
//!   tokens are walked in vocabulary order (no sort of the kept set is needed). A position's draw
//!   depends on nothing else, so a step replayed after a refusal draws the same token.
//!
//! Rounding: the device's `expf` may differ from the host's `exp` by an ulp, so a token whose
//! weight sits on a top-p or min-p boundary, or a draw landing exactly between two tokens, can
//! differ between host and device; both are rare (probability ~1e-7 a step).

/// Tokens a device top-k can keep (candidates merged by one block); larger k samples on the host.
pub const DEVICE_TOP_K_MAX: usize = 64;
/// Longest penalty window the device keeps (its ring of recent ids); longer windows sample on
/// the host.
pub const DEVICE_PENALTY_WINDOW: usize = 1024;

/// Scale of the fixed-point weights: 2⁴⁰ (a weight below 2⁻⁴⁰ of the best token's counts as 0).
pub const FIXED_ONE: f64 = (1u64 << 40) as f64;

/// Everything a sampled step needs besides the logits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleSpec {
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

impl Default for SampleSpec {
    /// Greedy, no penalties.
    fn default() -> Self {
        SampleSpec {
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

impl SampleSpec {
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

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    pub fn has_penalties(&self) -> bool {
        self.penalty_last_n > 0
            && (self.repeat_penalty != 1.0
                || self.presence_penalty != 0.0
                || self.frequency_penalty != 0.0)
    }

    /// Why the device sampler cannot run this spec (the host then samples), or None.
    pub fn device_limit(&self) -> Option<String> {
        if !self.is_greedy() && self.top_k > DEVICE_TOP_K_MAX {
            return Some(format!(
                "top-k {} > {DEVICE_TOP_K_MAX} candidates",
                self.top_k
            ));
        }
        if self.has_penalties() && self.penalty_last_n > DEVICE_PENALTY_WINDOW {
            return Some(format!(
                "penalty window {} > {DEVICE_PENALTY_WINDOW} tokens",
                self.penalty_last_n
            ));
        }
        None
    }
}

/// The draw's uniform number for (seed, position): splitmix64's finaliser of
/// `seed + (pos + 1) · golden`, top 24 bits, as an integer in [0, 2²⁴).
pub fn uniform24(seed: u64, pos: u64) -> u64 {
    let mut z = seed.wrapping_add(pos.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    z >> 40
}

/// A weight in (0, 1] as 40-bit fixed point.
pub fn fixed(e: f32) -> u64 {
    (e as f64 * FIXED_ONE) as u64
}

/// `⌊u24 · total / 2²⁴⌋` without overflow.
pub fn draw_target(u24: u64, total: u64) -> u64 {
    ((u24 as u128 * total as u128) >> 24) as u64
}

/// Whether a cumulative weight reaches `top_p` of `total` (the one comparison both sides make).
pub fn reaches(cum: u64, top_p: f32, total: u64) -> bool {
    cum as f64 >= top_p as f64 * total as f64
}

/// Words of a token mask over `vocab` tokens (bit `i % 32` of word `i / 32` stands for token `i`).
pub fn mask_words(vocab: usize) -> usize {
    vocab.div_ceil(32)
}

/// Sets to −∞ the logits of the tokens whose bit in `allowed` is clear (a grammar's mask, applied
/// before the sampler: `kernels/sample.cu`'s `apply_token_mask` does the same on the device).
/// Tokens past the mask's words count as disallowed.
pub fn apply_token_mask(logits: &mut [f32], allowed: &[u32]) {
    for (i, l) in logits.iter_mut().enumerate() {
        let on = allowed
            .get(i / 32)
            .is_some_and(|w| (w >> (i % 32)) & 1 == 1);
        if !on {
            *l = f32::NEG_INFINITY;
        }
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

/// Applies the penalties of `spec` for the ids in `window` (the last `penalty_last_n` tokens).
pub fn apply_penalties(logits: &mut [f32], window: &[u32], spec: &SampleSpec) {
    if !spec.has_penalties() {
        return;
    }
    let mut counts: Vec<(u32, u32)> = Vec::new();
    for &t in window {
        match counts.iter_mut().find(|(id, _)| *id == t) {
            Some((_, c)) => *c += 1,
            None => counts.push((t, 1)),
        }
    }
    for (t, c) in counts {
        let Some(l) = logits.get_mut(t as usize) else {
            continue;
        };
        if spec.repeat_penalty != 1.0 {
            *l = if *l > 0.0 {
                *l / spec.repeat_penalty
            } else {
                *l * spec.repeat_penalty
            };
        }
        *l -= spec.presence_penalty + spec.frequency_penalty * c as f32;
    }
}

/// Whether (a, ia) ranks before (b, ib): larger logit first, lower id on ties.
fn ranks_before(a: f32, ia: u32, b: f32, ib: u32) -> bool {
    a > b || (a == b && ia < ib)
}

/// The token drawn for the step at `pos` (the position of the token whose logits these are).
/// `logits` get the penalties; `window` is the penalty window (the last `penalty_last_n` ids
/// of the sequence, the token at `pos` last).
pub fn sample(logits: &mut [f32], window: &[u32], spec: &SampleSpec, pos: u64) -> u32 {
    apply_penalties(logits, window, spec);
    if spec.is_greedy() || logits.is_empty() {
        return argmax(logits);
    }
    let best = argmax(logits);
    let max = logits[best as usize];
    if !max.is_finite() {
        return best;
    }
    let inv_t = 1.0 / spec.temperature;
    let weight = |l: f32| -> u64 {
        if l.is_nan() {
            0
        } else {
            fixed(((l - max) * inv_t).exp())
        }
    };
    let min_p_ok =
        |l: f32| -> bool { spec.min_p <= 0.0 || ((l - max) * inv_t).exp() >= spec.min_p };

    // The rank cut: tokens ranking at or before (cut_v, cut_i) survive top-k and top-p.
    let mut cut: Option<(f32, u32)> = None;
    let v = logits.len();
    let k = if spec.top_k > 0 && spec.top_k < v {
        spec.top_k
    } else {
        v
    };
    let needs_rank = k < v || spec.top_p < 1.0;
    if needs_rank {
        let mut ranked: Vec<u32> = (0..v as u32)
            .filter(|&i| !logits[i as usize].is_nan())
            .collect();
        let order = |a: &u32, b: &u32| {
            if ranks_before(logits[*a as usize], *a, logits[*b as usize], *b) {
                std::cmp::Ordering::Less
            } else {
                std::cmp::Ordering::Greater
            }
        };
        if k < ranked.len() {
            ranked.select_nth_unstable_by(k - 1, order);
            ranked.truncate(k);
        }
        // Index into `ranked` of the last survivor; ranked[k - 1] is the k-th best after the
        // selection above.
        let mut last = ranked.len().saturating_sub(1);
        if spec.top_p < 1.0 && !ranked.is_empty() {
            let total: u64 = ranked.iter().map(|&i| weight(logits[i as usize])).sum();
            // Sort a growing prefix of the best until it holds top_p of the weight (a full sort
            // of a large vocabulary would cost milliseconds a token).
            let mut n = 64.min(ranked.len());
            'grow: loop {
                if n < ranked.len() {
                    ranked.select_nth_unstable_by(n - 1, order);
                }
                ranked[..n].sort_unstable_by(order);
                let mut cum = 0u64;
                for (j, &i) in ranked[..n].iter().enumerate() {
                    cum += weight(logits[i as usize]);
                    if reaches(cum, spec.top_p, total) {
                        last = j;
                        break 'grow;
                    }
                }
                if n == ranked.len() {
                    break;
                }
                n = (n * 4).min(ranked.len());
            }
        }
        if let Some(&i) = ranked.get(last) {
            cut = Some((logits[i as usize], i));
        }
    }
    let kept = |i: usize| -> bool {
        let l = logits[i];
        !l.is_nan() && min_p_ok(l) && cut.is_none_or(|(cv, ci)| !ranks_before(cv, ci, l, i as u32))
    };
    let total: u64 = (0..v).filter(|&i| kept(i)).map(|i| weight(logits[i])).sum();
    if total == 0 {
        return best;
    }
    let target = draw_target(uniform24(spec.seed, pos), total);
    let mut acc = 0u64;
    let mut last = best;
    for i in (0..v).filter(|&i| kept(i)) {
        let w = weight(logits[i]);
        if w == 0 {
            continue;
        }
        acc += w;
        last = i as u32;
        if target < acc {
            return i as u32;
        }
    }
    last
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(temperature: f32) -> SampleSpec {
        SampleSpec {
            temperature,
            ..Default::default()
        }
    }

    #[test]
    fn greedy_is_argmax_lowest_tie() {
        assert_eq!(sample(&mut [0.1, 3.0, 3.0, -1.0], &[], &spec(0.0), 0), 1);
        assert_eq!(sample(&mut [f32::NAN, 1.0, 0.5], &[], &spec(0.0), 0), 1);
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative() {
        let s = SampleSpec {
            repeat_penalty: 2.0,
            ..spec(0.0)
        };
        let mut l = [4.0, 3.0, -1.0];
        assert_eq!(sample(&mut l, &[0, 2], &s, 0), 1);
        assert_eq!(l, [2.0, 3.0, -2.0]);
    }

    #[test]
    fn presence_and_frequency_penalties_count_each_id_once() {
        let s = SampleSpec {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..spec(0.0)
        };
        let mut l = [1.0, 1.0, 1.0];
        sample(&mut l, &[0, 0, 1], &s, 0);
        assert_eq!(l, [1.0 - 0.5 - 0.5, 1.0 - 0.5 - 0.25, 1.0]);
    }

    #[test]
    fn top_k_top_p_min_p_restrict_the_support() {
        let logits = [0.0f32, 1.0, 2.0, 3.0, 4.0];
        for (s, allowed) in [
            (
                SampleSpec {
                    top_k: 2,
                    ..spec(1.0)
                },
                vec![3, 4],
            ),
            // p(4) ≈ 0.64 of the whole
            (
                SampleSpec {
                    top_p: 0.5,
                    ..spec(1.0)
                },
                vec![4],
            ),
            // p(3)/p(4) ≈ 0.37
            (
                SampleSpec {
                    min_p: 0.3,
                    ..spec(1.0)
                },
                vec![3, 4],
            ),
            // top-p over the two top-k survivors: p(4) = 0.73 of their weight
            (
                SampleSpec {
                    top_k: 2,
                    top_p: 0.8,
                    ..spec(1.0)
                },
                vec![3, 4],
            ),
        ] {
            for pos in 0..300 {
                let t = sample(&mut logits.clone(), &[], &s, pos);
                assert!(allowed.contains(&t), "{s:?}: {t} not in {allowed:?}");
            }
        }
    }

    #[test]
    fn top_p_over_a_flat_distribution_keeps_just_enough_tokens() {
        let mut logits = vec![0.0f32; 1000];
        logits[999] = 0.5;
        let s = SampleSpec {
            top_p: 0.5,
            seed: 1,
            ..spec(1.0)
        };
        let seen: std::collections::HashSet<u32> = (0..4000)
            .map(|pos| sample(&mut logits.clone(), &[], &s, pos))
            .collect();
        assert!(seen.contains(&999));
        // 0.5 of the mass is ≈ 499 tokens: the best, then ids 0.. in rank order.
        assert!(seen.len() > 400 && seen.len() <= 500, "{}", seen.len());
        assert!(seen.iter().all(|&t| t == 999 || t < 500));
    }

    #[test]
    fn draws_follow_the_distribution() {
        let logits = [0.0f32, (2.0f32).ln(), (5.0f32).ln()]; // 1/8, 2/8, 5/8
        let s = SampleSpec {
            seed: 42,
            ..spec(1.0)
        };
        let n = 40_000;
        let mut counts = [0usize; 3];
        for pos in 0..n {
            counts[sample(&mut logits.clone(), &[], &s, pos) as usize] += 1;
        }
        for (c, p) in counts.iter().zip([0.125, 0.25, 0.625]) {
            assert!((*c as f64 / n as f64 - p).abs() < 0.01, "{counts:?}");
        }
    }

    #[test]
    fn a_draw_depends_on_seed_and_position_only() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let run = |seed| {
            (0..20)
                .map(|pos| sample(&mut logits.clone(), &[], &spec(0.8).with_seed(seed), pos))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(3), run(3));
        assert_ne!(run(3), run(4));
        // Position 7 alone draws what position 7 drew inside the run.
        let alone = sample(&mut logits.clone(), &[], &spec(0.8).with_seed(3), 7);
        assert_eq!(alone, run(3)[7]);
    }

    #[test]
    fn a_token_mask_keeps_the_set_bits_only() {
        let v = 70; // three words, the last one partly used
        let mut allowed = vec![0u32; mask_words(v)];
        assert_eq!(allowed.len(), 3);
        for t in [0usize, 31, 32, 33, 69] {
            allowed[t / 32] |= 1 << (t % 32);
        }
        let mut logits: Vec<f32> = (0..v).map(|i| i as f32).collect();
        apply_token_mask(&mut logits, &allowed);
        for (i, &l) in logits.iter().enumerate() {
            let kept = [0, 31, 32, 33, 69].contains(&i);
            assert_eq!(
                l,
                if kept { i as f32 } else { f32::NEG_INFINITY },
                "token {i}"
            );
        }
        // A masked greedy draw takes the best allowed token; a sampled one never a masked one.
        assert_eq!(argmax(&logits), 69);
        for seed in 0..50 {
            let s = SampleSpec { seed, ..spec(5.0) };
            let t = sample(&mut logits.clone(), &[], &s, 3) as usize;
            assert!([0, 31, 32, 33, 69].contains(&t), "drew {t}");
        }
        // Words missing from a short mask count as disallowed.
        let mut l = vec![1.0f32; v];
        apply_token_mask(&mut l, &[u32::MAX]);
        assert!(l[..32].iter().all(|&x| x == 1.0) && l[32..].iter().all(|&x| x.is_infinite()));
    }

    #[test]
    fn fixed_point_helpers() {
        assert_eq!(fixed(1.0), 1 << 40);
        assert_eq!(draw_target(1 << 23, 1000), 500);
        assert_eq!(draw_target((1 << 24) - 1, 1 << 30), (1 << 30) - (1 << 6));
        assert!(reaches(50, 0.5, 100) && !reaches(49, 0.5, 100));
    }

    impl SampleSpec {
        fn with_seed(self, seed: u64) -> SampleSpec {
            SampleSpec { seed, ..self }
        }
    }
}
