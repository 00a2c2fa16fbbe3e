//! Generation with the device sampler (the fake backend runs the shared algorithm on the CPU,
//! fed only what a device gets: the prefill's tokens and each step's token and position)
//! against the CPU engine with the host sampler, on the llama-tiny fixture: the same seed gives
//! the same tokens for every sampler option, also when the device refuses mid-run and the CPU
//! takes over, and when the spec is past the device's limits (the host samples then).

mod common;
use cmf_gpu::facade::fake::FakeBackend;
use cmf_gpu::facade::{Gpu, GpuMode};
use cmf_llm::chat::Tokenizer;
use cmf_llm::engine::{CpuEngine, Engine};
use cmf_llm::generate::{generate, GenerationConfig};
use cmf_llm::gpu::{GpuEngine, GpuModel};
use cmf_llm::sampling::SamplingParams;
use cmf_llm::{Model, ModelConfig};
use common::*;
use std::sync::Arc;

fn fake_gpu() -> Gpu {
    Gpu::with_backend(GpuMode::Auto, Arc::new(FakeBackend::new(1 << 40)))
}

/// Generated ids, and whether the engine was still on the device at the end.
fn run(
    engine: &mut dyn Engine,
    tok: &Tokenizer,
    prompt: &[u32],
    params: &SamplingParams,
) -> Vec<u32> {
    let cfg = GenerationConfig {
        max_tokens: 24,
        sampling: *params,
        ..Default::default()
    };
    let mut history = Vec::new();
    generate(engine, tok, prompt, &mut history, &cfg, &mut |_| {}).unwrap();
    history[prompt.len()..].to_vec()
}

#[test]
fn device_sampler_equals_host_sampler_on_seeded_runs() {
    let dir = fixture_dir("llama-tiny");
    let files = read_weight_files(&dir);
    let source = SafetensorsSource::new(&files);
    let config = ModelConfig::from_json(&read_json(dir.join("config.json"))).unwrap();
    let model = Model::from_source(&source, config, "").unwrap();
    let tok = Tokenizer::from_bytes(&std::fs::read(dir.join("tokenizer.json")).unwrap()).unwrap();
    let prompt = ids(&read_json(dir.join("expected.json"))["prompt_ids"]);
    let base = SamplingParams::default();
    let cases = [
        base,
        SamplingParams {
            temperature: 0.8,
            top_p: 0.9,
            seed: 1,
            ..base
        },
        SamplingParams {
            temperature: 1.3,
            top_k: 20,
            min_p: 0.02,
            seed: 2,
            ..base
        },
        SamplingParams {
            temperature: 1.0,
            repeat_penalty: 1.3,
            presence_penalty: 0.4,
            frequency_penalty: 0.2,
            penalty_last_n: 16,
            seed: 3,
            ..base
        },
        // Greedy with penalties: the device graph with the penalty kernel and an arg-max.
        SamplingParams {
            repeat_penalty: 2.0,
            ..base
        },
        // Past the device's limits: the host samples from read-back logits.
        SamplingParams {
            temperature: 1.0,
            top_k: 100,
            seed: 4,
            ..base
        },
    ];
    let gpu = fake_gpu();
    let mut spread = std::collections::HashSet::new();
    for params in &cases {
        let mut cpu = CpuEngine::new(&model, 256, cmf_kernels::KvDtype::F32).unwrap();
        let want = run(&mut cpu, &tok, &prompt, params);
        for inject in [u64::MAX, 6] {
            let g = GpuModel::load(&gpu, &model, 256, None).expect("the fake loads it");
            let mut dev = GpuEngine::new(&model, g, 256, cmf_kernels::KvDtype::F32);
            gpu.inject_refusal_after(inject);
            let got = run(&mut dev, &tok, &prompt, params);
            gpu.inject_refusal_after(u64::MAX);
            assert_eq!(dev.is_gpu(), inject == u64::MAX, "{params:?}");
            assert_eq!(got, want, "{params:?}, refusal after {inject} calls");
        }
        spread.insert(want);
    }
    assert_eq!(
        spread.len(),
        cases.len(),
        "the cases should generate different ids"
    );
}
