//! The resident LLM against the CPU reference: whole models, long contexts, the short-context
//! graphs, precise mode, refusals mid-run, steady-state uploads, the device sampler, decode
//! ahead and hybrid layer placement.

use super::*;

fn tiny_spec(head_dim: usize, window: Option<usize>) -> LlmSpec {
    let mut s = qwen3_spec(256, 512, 3, 8, 2, head_dim, 300);
    s.sliding_window[1] = window;
    s
}

/// How a test sets up the loaded model before [`compare_model`] runs it.
#[derive(Clone, Copy, Default)]
struct Setup {
    /// Decode-attention tuning (the defaults unless set).
    tuning: DecodeTuning,
    /// The prefill attention kernel (fa2 where it applies unless set).
    attn: Option<AttnKernel>,
    /// The short-context decode attention (staged where it fits unless set).
    short: Option<ShortDecode>,
}

/// Teacher-forced run: prefill `prompt`, then decode `steps` tokens feeding the reference's
/// greedy choice to both; returns (max logits rel err, steps where argmax differed).
fn compare_model(
    b: &CudaBackend,
    m: &SynthModel,
    opts: &LlmOptions,
    prompt: &[u32],
    steps: usize,
    setup: Setup,
) -> (f64, f64, usize) {
    let model = m.model();
    let placement = Placement::all(model.spec.num_layers);
    let mut dev = b
        .load_cuda_llm_tuned(&model, opts, &placement, setup.tuning)
        .unwrap();
    if let Some(attn) = setup.attn {
        dev.set_attention(attn);
    }
    if let Some(short) = setup.short {
        dev.set_short_decode(short);
    }
    let mut cache = RefCache::new(model.spec.num_layers);
    let v = model.spec.vocab;
    // Prefill: all positions' logits against the reference.
    let mut got = vec![f32::NAN; prompt.len() * v];
    dev.prefill(prompt, 0, Logits::All, &mut got).unwrap();
    let mut e_prefill = 0f64;
    let mut last = Vec::new();
    for (p, &t) in prompt.iter().enumerate() {
        last = reference::forward_token(&model, t, p, &mut cache);
        e_prefill = e_prefill.max(rel_err(&got[p * v..(p + 1) * v], &last));
    }
    let mut e_decode = 0f64;
    let mut mismatches = 0;
    let mut tok = reference::argmax(&last);
    for i in 0..steps {
        let pos = prompt.len() + i;
        let mut out = DecodeOutput::default();
        dev.decode(tok, pos, &Sampler::Greedy, true, &mut out)
            .unwrap();
        let want = reference::forward_token(&model, tok, pos, &mut cache);
        e_decode = e_decode.max(rel_err(&out.logits, &want));
        let ref_tok = reference::argmax(&want);
        if out.token != ref_tok {
            mismatches += 1;
        }
        tok = ref_tok;
    }
    (e_prefill, e_decode, mismatches)
}

#[test]
fn whole_model_matches_reference() {
    let Some(b) = backend() else { return };
    eprintln!(
        "{:<7} {:>3} {:>5} {:>6} {:>11} {:>11} {:>9}",
        "codec", "hd", "tied", "bias", "prefill", "decode", "argmax≠"
    );
    let prompt: Vec<u32> = (0..37).map(|i| (i * 7 + 3) % 300).collect();
    for &(d, hd, tied, bias) in &[
        (Dtype::F32, 64, false, false),
        (Dtype::F32, 16, false, true),
        (Dtype::Bf16, 16, true, false),
        (Dtype::F32, 128, true, true),
        (Dtype::F16, 64, true, false),
        (Dtype::Bf16, 128, false, false),
        (Dtype::Q8Row, 128, false, true),
        (Dtype::Q8_2f, 64, false, false),
        (Dtype::Q4Block, 128, true, false),
        (Dtype::Q4Tiled, 64, false, false),
    ] {
        let opts = SynthOptions {
            qk_norm: !bias,
            qkv_bias: bias,
            tied,
        };
        let m = SynthModel::new(tiny_spec(hd, Some(20)), d, opts, 42 + hd as u64);
        let (ep, ed, mis) = compare_model(
            &b,
            &m,
            &LlmOptions {
                max_context: 256,
                ..Default::default()
            },
            &prompt,
            24,
            Setup::default(),
        );
        eprintln!(
            "{:<7} {hd:>3} {tied:>5} {bias:>6} {ep:>11.2e} {ed:>11.2e} {mis:>9}",
            d.name()
        );
        let exact = matches!(d, Dtype::F32 | Dtype::F16);
        let tol = if exact { 1e-4 } else { 6e-2 };
        assert!(
            ep < tol && ed < tol,
            "{d} hd {hd}: prefill {ep:.2e} decode {ed:.2e}"
        );
        if exact {
            assert_eq!(mis, 0, "{d}: greedy tokens differ from the reference");
        }
    }
}

#[test]
fn chunked_prefill_and_split_attention_at_long_context() {
    let Some(b) = backend() else { return };
    // bf16 weights → f16 KV cache → tensor-core prefill attention; 3 chunks of 128 with a
    // sliding-window layer; decode then runs split-K over ~400 positions. Both prefill
    // attention kernels (the fallback forced where fa2 applies).
    let m = SynthModel::new(
        tiny_spec(128, Some(100)),
        Dtype::Bf16,
        SynthOptions::QWEN3,
        7,
    );
    let prompt: Vec<u32> = (0..380).map(|i| (i * 13 + 1) % 300).collect();
    let opts = LlmOptions {
        max_context: 1024,
        kv: KvPrecision::Auto,
        prefill_chunk: 128,
        ..Default::default()
    };
    for attn in [AttnKernel::Fa2, AttnKernel::Simple] {
        let setup = Setup {
            attn: Some(attn),
            ..Setup::default()
        };
        let (ep, ed, mis) = compare_model(&b, &m, &opts, &prompt, 16, setup);
        eprintln!(
            "long context bf16, f16 KV, {attn:?}: prefill {ep:.2e} decode {ed:.2e} argmax≠ {mis}"
        );
        assert!(ep < 6e-2 && ed < 6e-2, "{attn:?}");
    }
    // Many small decode splits (16 keys at least: ~25 per kv head here) through the merge of
    // the last block (the default, 128, gives four).
    let setup = Setup {
        tuning: DecodeTuning { min_chunk: 16 },
        ..Setup::default()
    };
    let (ep, ed, mis) = compare_model(&b, &m, &opts, &prompt, 8, setup);
    eprintln!("long context bf16, f16 KV, decode splits of 16 keys: prefill {ep:.2e} decode {ed:.2e} argmax≠ {mis}");
    assert!(ep < 6e-2 && ed < 6e-2, "small decode splits");
    let opts = LlmOptions {
        kv: KvPrecision::F32,
        ..opts
    };
    let (ep2, ed2, _) = compare_model(&b, &m, &opts, &prompt, 4, Setup::default());
    eprintln!("long context bf16, f32 KV (simple attention): prefill {ep2:.2e} decode {ed2:.2e}");
    assert!(ep2 < 6e-2 && ed2 < 6e-2);
}

#[test]
fn short_context_decode_graphs_match_reference_across_the_switch() {
    let Some(b) = backend() else { return };
    // Below DEC_ONE_BLOCK (256) keys decode runs a second graph with one attention block per kv
    // head (K/V staged in shared memory by default); from position 256 on, the split-K graph.
    // Decode from 250 crosses the switch; both modes, with a sliding-window layer, q8 and bf16
    // weights (f16 KV) and f16 weights (f32 KV: too large to stage at head_dim 128, so `Grid`).
    let below = cmf_gpu::cuda::llm::DEC_ONE_BLOCK - 6;
    let prompt: Vec<u32> = (0..below as u32).map(|i| (i * 17 + 2) % 300).collect();
    let opts = LlmOptions {
        max_context: 512,
        prefill_chunk: 128,
        ..Default::default()
    };
    for (d, hd) in [(Dtype::Q8Row, 128), (Dtype::Bf16, 64), (Dtype::F16, 128)] {
        let m = SynthModel::new(tiny_spec(hd, Some(100)), d, SynthOptions::QWEN3, 11);
        for mode in [ShortDecode::Grid, ShortDecode::Staged] {
            let setup = Setup {
                short: Some(mode),
                ..Setup::default()
            };
            let (ep, ed, mis) = compare_model(&b, &m, &opts, &prompt, 12, setup);
            eprintln!(
                "{d} hd {hd}, short decode {mode:?}: prefill {ep:.2e} decode {ed:.2e} argmax≠ {mis}"
            );
            let exact = d == Dtype::F16;
            let tol = if exact { 1e-4 } else { 6e-2 };
            assert!(
                ep < tol && ed < tol,
                "{d} hd {hd} {mode:?}: decode {ed:.2e}"
            );
            if exact {
                assert_eq!(
                    mis, 0,
                    "{d} {mode:?}: greedy tokens differ from the reference"
                );
            }
        }
    }
}

#[test]
fn precise_mode_is_exact_for_bf16_weights() {
    let Some(b) = backend() else { return };
    // bf16 weights are exact in f32; with f32 prefill GEMMs and an f32 cache every operation
    // is f32, so the logits match the reference as closely as an f32 model's.
    let m = SynthModel::new(
        tiny_spec(64, Some(20)),
        Dtype::Bf16,
        SynthOptions::QWEN3,
        21,
    );
    let prompt: Vec<u32> = (0..41).map(|i| (i * 11 + 5) % 300).collect();
    let opts = LlmOptions {
        max_context: 256,
        prefill_chunk: 32,
        precise: true,
        ..Default::default()
    };
    let (ep, ed, mis) = compare_model(&b, &m, &opts, &prompt, 16, Setup::default());
    eprintln!("bf16 precise: prefill {ep:.2e} decode {ed:.2e} argmax≠ {mis}");
    assert!(ep < 1e-4 && ed < 1e-4);
    assert_eq!(mis, 0);
}

/// Greedy generation as a caller does it: device first, CPU reference after a refusal.
fn generate(gpu: &Gpu, model: &LlmModel, prompt: &[u32], steps: usize) -> (Vec<u32>, usize) {
    let mut dev = gpu
        .load_llm(
            model,
            &LlmOptions {
                max_context: 128,
                ..Default::default()
            },
            None,
        )
        .ok();
    assert!(dev.is_some(), "model should load on the device");
    let mut tokens = prompt.to_vec();
    let mut logits = vec![0f32; model.spec.vocab];
    let mut next = match dev
        .as_mut()
        .unwrap()
        .prefill(prompt, 0, Logits::Last, &mut logits)
    {
        Ok(()) => reference::argmax(&logits),
        Err(_) => panic!("prefill refused"),
    };
    let mut refusals = 0;
    let mut cpu: Option<RefCache> = None;
    for _ in 0..steps {
        tokens.push(next);
        let pos = tokens.len() - 1;
        if let Some(d) = dev.as_mut() {
            let mut out = DecodeOutput {
                token: 0xDEAD,
                logits: vec![1.0],
            };
            match d.decode(next, pos, &Sampler::Greedy, false, &mut out) {
                Ok(()) => {
                    next = out.token;
                    continue;
                }
                Err(_) => {
                    assert_eq!(
                        out,
                        DecodeOutput {
                            token: 0xDEAD,
                            logits: vec![1.0]
                        },
                        "refusal touched the output"
                    );
                    refusals += 1;
                    dev = None;
                }
            }
        }
        let c = cpu.get_or_insert_with(|| {
            let mut c = RefCache::new(model.spec.num_layers);
            for (p, &t) in tokens[..pos].iter().enumerate() {
                reference::forward_token(model, t, p, &mut c);
            }
            c
        });
        next = reference::argmax(&reference::forward_token(model, next, pos, c));
    }
    (tokens, refusals)
}

#[test]
fn forced_refusal_mid_run_leaves_outputs_and_matches_cpu() {
    let Some(b) = backend() else { return };
    let m = SynthModel::new(tiny_spec(64, None), Dtype::F32, SynthOptions::QWEN3, 3);
    let model = m.model();
    let prompt = [5u32, 17, 29, 41];
    let mut cache = RefCache::new(3);
    let mut cpu_tokens = prompt.to_vec();
    let mut l = Vec::new();
    for (p, &t) in prompt.iter().enumerate() {
        l = reference::forward_token(&model, t, p, &mut cache);
    }
    for _ in 0..12 {
        let t = reference::argmax(&l);
        cpu_tokens.push(t);
        l = reference::forward_token(&model, t, cpu_tokens.len() - 1, &mut cache);
    }
    let gpu = Gpu::with_backend(GpuMode::Cuda, b.clone());
    let (all_dev, r0) = generate(&gpu, &model, &prompt, 12);
    assert_eq!(r0, 0);
    gpu.inject_refusal_after(6); // load, prefill, 4 decodes, then refuse
    let (mixed, r1) = generate(&gpu, &model, &prompt, 12);
    gpu.inject_refusal_after(u64::MAX);
    assert_eq!(r1, 1);
    assert_eq!(all_dev, cpu_tokens);
    assert_eq!(mixed, cpu_tokens);
}

#[test]
fn steady_state_decode_uploads_nothing() {
    let Some(b) = backend() else { return };
    let m = SynthModel::new(tiny_spec(64, None), Dtype::Q8Row, SynthOptions::QWEN3, 9);
    let mut dev = load(
        &b,
        &m.model(),
        &LlmOptions {
            max_context: 128,
            ..Default::default()
        },
    );
    let mut out = DecodeOutput::default();
    dev.decode(1, 0, &Sampler::Greedy, false, &mut out).unwrap();
    let before = b.stats().uploaded();
    let mut tok = out.token;
    for pos in 1..40 {
        dev.decode(tok, pos, &Sampler::Greedy, false, &mut out)
            .unwrap();
        tok = out.token;
    }
    assert_eq!(b.stats().uploaded(), before, "decode window uploaded bytes");
}

/// The device sampler draws what the host's algorithm (`cmf_gpu::llm::sample`) draws from the
/// same logits: every option (penalties over a prefilled window, temperature, top-k, top-p
/// within the 64 best and past them, min-p), many seeds. A token whose weight sits on a cut or
/// a draw between two tokens may differ by the device's `expf` rounding: at most one in the run.
#[test]
fn device_sampler_matches_the_host_algorithm() {
    use cmf_gpu::llm::sample::{sample, SampleSpec};
    let Some(b) = backend() else { return };
    let m = SynthModel::new(tiny_spec(64, None), Dtype::F32, SynthOptions::QWEN3, 5);
    let model = m.model();
    let mut dev = load(
        &b,
        &model,
        &LlmOptions {
            max_context: 64,
            ..Default::default()
        },
    );
    let prompt = [3u32, 5, 3, 9, 3];
    let mut none = Vec::new();
    dev.prefill(&prompt[..4], 0, Logits::None, &mut none)
        .unwrap();
    let mut raw = DecodeOutput::default();
    dev.decode(prompt[4], 4, &Sampler::Greedy, true, &mut raw)
        .unwrap();
    let base = SampleSpec::default();
    let specs = [
        SampleSpec {
            temperature: 1.0,
            ..base
        },
        SampleSpec {
            temperature: 2.0,
            top_k: 5,
            ..base
        },
        SampleSpec {
            temperature: 0.7,
            top_p: 0.9,
            ..base
        },
        SampleSpec {
            temperature: 4.0,
            top_p: 0.95,
            ..base
        }, // the nucleus passes the 64 best
        SampleSpec {
            temperature: 3.0,
            top_p: 0.6,
            min_p: 0.05,
            ..base
        },
        SampleSpec {
            temperature: 1.5,
            top_k: 40,
            top_p: 0.8,
            ..base
        },
        SampleSpec {
            temperature: 1.0,
            repeat_penalty: 1.3,
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            penalty_last_n: 4,
            ..base
        },
        SampleSpec {
            temperature: 0.0,
            repeat_penalty: 5.0,
            penalty_last_n: 64,
            ..base
        },
    ];
    let (mut runs, mut differ) = (0, Vec::new());
    let mut seen = std::collections::HashSet::new();
    for spec in specs {
        for seed in 0..24u64 {
            let spec = SampleSpec { seed, ..spec };
            let n = spec.penalty_last_n.min(prompt.len());
            let want = sample(
                &mut raw.logits.clone(),
                &prompt[prompt.len() - n..],
                &spec,
                4,
            );
            let mut out = DecodeOutput::default();
            dev.decode(prompt[4], 4, &Sampler::Sample(spec), false, &mut out)
                .unwrap();
            runs += 1;
            if out.token != want {
                differ.push((spec, out.token, want));
            }
            seen.insert(out.token);
        }
    }
    assert!(
        differ.len() <= 1,
        "{} of {runs} draws differ: {differ:?}",
        differ.len()
    );
    assert!(seen.len() > 20, "draws are not spread: {seen:?}");
}

/// The sampler alone (`CudaLlm::sample_logits`) against the host algorithm on logits no model
/// gives: flat over a 151,936 vocabulary (random weights' shape: top-p's cut lies far past the
/// 64 best, so the vocabulary passes' radix select decides it), heavy ties (logits in steps of
/// 0.25: cuts inside runs of equal logits spread over many slices), NaN / −inf / −0 among
/// peaked logits, vocabularies not a multiple of the 256 slices; top-k 1, 40 and 64 (the
/// candidates' merge; a larger top-k is sampled on the host), top-p 1, min-p. As above, the
/// device's `expf` may round
/// a weight on a cut or a draw boundary differently: at most 1 % of the draws may differ.
#[test]
fn device_sampler_matches_the_host_on_flat_tied_and_odd_vocabularies() {
    use cmf_gpu::llm::sample::{sample, SampleSpec};
    let Some(b) = backend() else { return };
    let spec = |temperature: f32, top_k: usize, top_p: f32, min_p: f32| SampleSpec {
        temperature,
        top_k,
        top_p,
        min_p,
        ..SampleSpec::default()
    };
    let (mut runs, mut differ) = (0usize, Vec::new());
    for (v, seed) in [(151_936usize, 1u64), (151_937, 2), (4099, 3), (300, 4)] {
        let m = sampler_model(v, seed);
        let mut dev = load(&b, &m.model(), &context(64));
        let mut rng = Rng::new(seed);
        let flat: Vec<f32> = (0..v).map(|_| 0.05 * rng.uniform()).collect();
        let tied: Vec<f32> = (0..v)
            .map(|_| (rng.uniform() * 8.0).round() * 0.25)
            .collect();
        let mut odd: Vec<f32> = (0..v).map(|_| 3.0 * rng.uniform()).collect();
        for i in (0..v).step_by(7) {
            odd[i] = f32::NAN;
        }
        for i in (3..v).step_by(11) {
            odd[i] = f32::NEG_INFINITY;
        }
        for i in (5..v).step_by(13) {
            odd[i] = if i % 2 == 0 { 0.0 } else { -0.0 };
        }
        let specs = [
            spec(0.7, 0, 0.9, 0.0),
            spec(1.0, 0, 0.5, 0.0),
            spec(4.0, 0, 0.95, 0.0),
            spec(1.0, 0, 0.001, 0.0),
            spec(0.7, 0, 1.0, 0.0),
            spec(1.5, 0, 1.0, 0.05),
            spec(3.0, 0, 0.6, 0.2),
            spec(1.0, 64, 0.9, 0.0),
            spec(1.0, 1, 0.9, 0.0),
            spec(2.0, 40, 0.8, 0.01),
            spec(0.0, 0, 0.9, 0.0),
        ];
        for (name, logits) in [("flat", &flat), ("tied", &tied), ("odd", &odd)] {
            let mut seen = std::collections::HashSet::new();
            for s in specs {
                for seed in 0..6u64 {
                    let s = SampleSpec { seed, ..s };
                    let pos = (seed as usize * 5 + 2) % 64;
                    let want = sample(&mut logits.clone(), &[], &s, pos as u64);
                    let got = dev.sample_logits(logits, 0, pos, &s).unwrap();
                    runs += 1;
                    if got != want {
                        differ.push((v, name, s, got, want));
                    }
                    seen.insert(got);
                }
            }
            assert!(
                seen.len() > 20,
                "v {v} {name}: draws are not spread: {seen:?}"
            );
        }
    }
    println!(
        "sampler alone: {} of {runs} draws differ from the host",
        differ.len()
    );
    assert!(
        differ.len() * 100 <= runs,
        "{} of {runs} draws differ: {differ:?}",
        differ.len()
    );
}

/// Greedy decode with a caller that sometimes does not feed the sampled token back (`forced`:
/// step → token) or wants logits (`logits_at`); returns the fed tokens and the logits asked for.
fn decode_run(
    dev: &mut CudaLlm,
    v: usize,
    prompt: &[u32],
    last: usize,
    forced: &[(usize, u32)],
    logits_at: &[usize],
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut l = vec![0f32; v];
    dev.prefill(prompt, 0, Logits::Last, &mut l).unwrap();
    let mut fed = prompt.to_vec();
    let mut next = reference::argmax(&l);
    let mut got_logits = Vec::new();
    for pos in prompt.len()..=last {
        if let Some(&(_, t)) = forced.iter().find(|(p, _)| *p == pos) {
            next = t;
        }
        fed.push(next);
        let want = logits_at.contains(&pos);
        let mut out = DecodeOutput::default();
        dev.decode(next, pos, &Sampler::Greedy, want, &mut out)
            .unwrap();
        if want {
            got_logits.push(out.logits);
        }
        next = out.token;
    }
    fed.push(next);
    (fed, got_logits)
}

#[test]
fn decode_ahead_matches_step_by_step_and_the_reference() {
    let Some(b) = backend() else { return };
    // The graph for position p + 1 is launched before the token of p is read; a caller that
    // feeds another token, asks for logits, or stops at the context's end must see exactly what
    // step-by-step decoding gives. f32 weights: greedy tokens equal the CPU reference's.
    let m = SynthModel::new(tiny_spec(64, None), Dtype::F32, SynthOptions::QWEN3, 31);
    let model = m.model();
    let opts = LlmOptions {
        max_context: 48,
        ..Default::default()
    };
    let prompt = [3u32, 141, 59, 26, 5];
    let forced = [(17, 7u32), (18, 7), (30, 299)];
    let logits_at = [12, 31, 47];
    let mut runs = Vec::new();
    for ahead in [true, false] {
        let mut dev = load(&b, &model, &opts);
        dev.set_decode_ahead(ahead);
        runs.push(decode_run(
            &mut dev,
            model.spec.vocab,
            &prompt,
            47,
            &forced,
            &logits_at,
        ));
    }
    assert_eq!(runs[0].0, runs[1].0, "tokens differ with decode-ahead on");
    assert_eq!(runs[0].1, runs[1].1, "logits differ with decode-ahead on");
    // The CPU reference fed the same tokens.
    let mut cache = RefCache::new(model.spec.num_layers);
    let fed = &runs[0].0;
    let mut want_logits = Vec::new();
    for pos in 0..fed.len() - 1 {
        let l = reference::forward_token(&model, fed[pos], pos, &mut cache);
        let forced_next = forced.iter().any(|(p, _)| *p == pos + 1);
        if pos >= prompt.len() - 1 && !forced_next {
            assert_eq!(
                fed[pos + 1],
                reference::argmax(&l),
                "greedy token at {}",
                pos + 1
            );
        }
        if logits_at.contains(&pos) {
            want_logits.push(l);
        }
    }
    for (g, w) in runs[0].1.iter().zip(&want_logits) {
        assert!(rel_err(g, w) < 1e-4, "logits rel err {:.2e}", rel_err(g, w));
    }
}

#[test]
fn hybrid_layers_match_reference() {
    let Some(b) = backend() else { return };
    let m = SynthModel::new(tiny_spec(64, None), Dtype::F32, SynthOptions::QWEN3, 13);
    let model = m.model();
    let set = LayerSet::parse("0,2", "--gpu-layers").unwrap();
    let placement = Placement::plan(&[1; 3], 1, 0, u64::MAX, Some(&set)).unwrap();
    let mut dev = b
        .load_cuda_llm(
            &model,
            &LlmOptions {
                max_context: 64,
                ..Default::default()
            },
            &placement,
        )
        .unwrap();
    let mut cache = RefCache::new(3);
    let mut cpu_cache = RefCache::new(3);
    let tokens = [3u32, 9, 27, 81, 243];
    // A batched step (t = 4) then single tokens.
    let want: Vec<Vec<f32>> = tokens
        .iter()
        .enumerate()
        .map(|(p, &t)| reference::forward_token(&model, t, p, &mut cache))
        .collect();
    let run = |dev: &mut cmf_gpu::cuda::llm::CudaLlm,
               cpu_cache: &mut RefCache,
               toks: &[u32],
               start: usize|
     -> Vec<Vec<f32>> {
        let h = model.spec.hidden;
        let mut x: Vec<f32> = toks
            .iter()
            .flat_map(|&t| reference::embed(&model, t))
            .collect();
        dev.forward_layers(0..1, &mut x, toks.len(), start).unwrap();
        for (i, row) in x.chunks_mut(h).enumerate() {
            reference::layer(&model, 1, row, start + i, cpu_cache);
        }
        dev.forward_layers(2..3, &mut x, toks.len(), start).unwrap();
        x.chunks(h).map(|r| reference::head(&model, r)).collect()
    };
    let mut got = run(&mut dev, &mut cpu_cache, &tokens[..4], 0);
    got.extend(run(&mut dev, &mut cpu_cache, &tokens[4..], 4));
    for (p, (g, w)) in got.iter().zip(&want).enumerate() {
        let e = rel_err(g, w);
        assert!(e < 1e-4, "position {p}: rel err {e:.2e}");
    }
    // The head is not resident in a split placement: refused, buffer untouched.
    let mut logits = vec![f32::NAN; model.spec.vocab];
    assert!(dev
        .head(&vec![0.0; model.spec.hidden], 1, &mut logits)
        .is_err());
    assert!(logits.iter().all(|v| v.is_nan()));
}
