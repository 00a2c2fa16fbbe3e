//! The grammar mask on the device: `apply_token_mask` against the host's
//! `llm::sample::apply_token_mask` on random logits and masks, and a masked decode step
//! (`decode_masked`: greedy graph, the host's mask uploaded meanwhile, the spec's sampler) against
//! the host algorithm over the same step's logits: never a disallowed token, the host's draw.

use super::*;
use cmf_gpu::llm::sample::{apply_token_mask, mask_words, sample, SampleSpec};

/// Uniform in [0, 1).
fn unit(rng: &mut Rng) -> f32 {
    (rng.uniform() + 1.0) * 0.5
}

/// A random mask allowing about `density` of the tokens (at least one).
fn random_mask(rng: &mut Rng, v: usize, density: f32) -> Vec<u32> {
    let mut bits = vec![0u32; mask_words(v)];
    for i in 0..v {
        if unit(rng) < density {
            bits[i / 32] |= 1 << (i % 32);
        }
    }
    let any = ((unit(rng) * v as f32) as usize).min(v - 1);
    bits[any / 32] |= 1 << (any % 32);
    // Bits past the vocabulary are set, as a grammar's wider mask may have them.
    for i in v..bits.len() * 32 {
        bits[i / 32] |= 1 << (i % 32);
    }
    bits
}

#[test]
fn mask_kernel_matches_the_host() {
    let Some(b) = backend() else { return };
    for (v, seed) in [(300usize, 1u64), (4099, 2), (151_937, 3)] {
        let m = sampler_model(v, seed);
        let mut dev = load(&b, &m.model(), &context(16));
        let mut rng = Rng::new(seed);
        for density in [0.0, 0.01, 0.5, 1.0] {
            let logits: Vec<f32> = (0..v).map(|_| 4.0 * rng.uniform()).collect();
            let bits = random_mask(&mut rng, v, density);
            let mut want = logits.clone();
            apply_token_mask(&mut want, &bits);
            let got = dev.mask_logits(&logits, &bits).unwrap();
            let differ = (0..v)
                .filter(|&i| got[i].to_bits() != want[i].to_bits())
                .count();
            assert_eq!(differ, 0, "v {v} density {density}: {differ} logits differ");
        }
        println!("mask kernel: v {v}: equal to the host");
    }
}

#[test]
fn masked_decode_draws_the_host_token_among_the_allowed() {
    let Some(b) = backend() else { return };
    let v = 4099;
    let m = SynthModel::new(
        qwen3_spec(64, 128, 2, 2, 1, 32, v),
        Dtype::F32,
        SynthOptions::QWEN3,
        7,
    );
    let mut dev = load(&b, &m.model(), &context(64));
    let prompt = [3u32, 5, 3, 9, 3];
    let mut none = Vec::new();
    dev.prefill(&prompt[..4], 0, Logits::None, &mut none)
        .unwrap();
    let mut raw = DecodeOutput::default();
    dev.decode(prompt[4], 4, &Sampler::Greedy, true, &mut raw)
        .unwrap();
    let base = SampleSpec::default();
    let specs = [
        base,
        SampleSpec {
            temperature: 1.0,
            ..base
        },
        SampleSpec {
            temperature: 0.8,
            top_p: 0.9,
            ..base
        },
        SampleSpec {
            temperature: 1.5,
            top_k: 40,
            min_p: 0.01,
            ..base
        },
        SampleSpec {
            temperature: 1.0,
            repeat_penalty: 1.3,
            presence_penalty: 0.5,
            penalty_last_n: 4,
            ..base
        },
    ];
    let mut rng = Rng::new(11);
    let (mut runs, mut differ) = (0, Vec::new());
    for spec in specs {
        for seed in 0..8u64 {
            let spec = SampleSpec { seed, ..spec };
            let density = [0.002, 0.05, 0.5][seed as usize % 3];
            let bits = random_mask(&mut rng, v, density);
            let mut logits = raw.logits.clone();
            apply_token_mask(&mut logits, &bits);
            let n = spec.penalty_last_n.min(prompt.len());
            let want = sample(&mut logits, &prompt[prompt.len() - n..], &spec, 4);
            let sampler = Sampler::of(&spec);
            let mut calls = 0;
            let got = dev
                .decode_masked(prompt[4], 4, &sampler, &mut |w: &mut [u32]| {
                    calls += 1;
                    w.copy_from_slice(&bits);
                })
                .unwrap();
            assert_eq!(calls, 1);
            assert!(
                (bits[got as usize / 32] >> (got % 32)) & 1 == 1,
                "{spec:?}: drew {got}, which the mask forbids"
            );
            runs += 1;
            if got != want {
                differ.push((spec, got, want));
            }
        }
    }
    println!(
        "masked decode: {} of {runs} draws differ from the host",
        differ.len()
    );
    assert!(differ.len() <= 1, "{differ:?}");
    // The unmasked decode after masked steps still matches its own logits' arg-max.
    let mut out = DecodeOutput::default();
    dev.decode(prompt[4], 4, &Sampler::Greedy, true, &mut out)
        .unwrap();
    assert_eq!(out.token, cmf_gpu::llm::sample::argmax(&out.logits));
}
