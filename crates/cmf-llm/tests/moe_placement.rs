//! Mixture-of-experts models on the device path, through the fake backend (which runs
//! cmf-gpu's reference forward, `llm::reference`, on the neutral description `cmf_llm::gpu`
//! builds): the logits equal the CPU model's and greedy ids are identical; a model whose
//! experts do not fit the VRAM budget stays on the CPU with a reason that says so (hybrid
//! linear-attention models are declined from their config: tests/qwen3_next.rs).

mod common;
use cmf_gpu::facade::fake::FakeBackend;
use cmf_gpu::facade::{Backend, Gpu, GpuMode};
use cmf_gpu::llm::{Ffn, LlmOptions};
use cmf_llm::engine::{CpuEngine, Engine};
use cmf_llm::gpu::{cpu_only, describe, GpuEngine, GpuModel};
use cmf_llm::{Model, ModelConfig};
use common::*;
use std::sync::Arc;

const MOE_FIXTURES: [&str; 3] = ["qwen3-moe-tiny", "qwen3-moe-unnorm-tiny", "qwen2-moe-tiny"];

fn fake_gpu(total: u64) -> Gpu {
    Gpu::with_backend(GpuMode::Auto, Arc::new(FakeBackend::new(total)))
}

/// The fixture's model, from its files (kept alive by the caller).
fn with_fixture(name: &str, f: impl FnOnce(&Model)) {
    let dir = fixture_dir(name);
    let files = read_weight_files(&dir);
    let source = SafetensorsSource::new(&files);
    let config = ModelConfig::from_json(&read_json(dir.join("config.json"))).unwrap();
    let model = Model::from_source(&source, config, "").unwrap();
    f(&model)
}

/// Prefill of the fixture's 48-token prompt, then greedy decode: the device engine (fake
/// backend) against the CPU engine. Both compute in f32 (the fixtures are f32), only the
/// summation order differs: 1e-4 of the largest logit per row, ids identical.
#[test]
fn moe_models_on_the_fake_device_equal_the_cpu_model() {
    for name in MOE_FIXTURES {
        with_fixture(name, |model| {
            assert_eq!(cpu_only(model), None, "{name}");
            let desc = describe(model, 128).unwrap();
            let moe_layers = desc
                .layers
                .iter()
                .filter(|l| matches!(l.ffn, Ffn::Moe(_)))
                .count();
            assert!(moe_layers > 0, "{name}: no MoE layer described");
            let gpu = fake_gpu(1 << 40);
            let g = GpuModel::load(&gpu, model, 128, None).expect("the fake loads it");
            let mut dev = GpuEngine::new(model, g, 128, cmf_kernels::KvDtype::F32);
            let mut cpu = CpuEngine::new(model, 128, cmf_kernels::KvDtype::F32).unwrap();
            let prompt = ids(&read_json(fixture_dir(name).join("expected.json"))["prompt_ids"]);
            assert!(prompt.len() >= 40);
            let mut logits_dev = dev.prefill(&prompt).unwrap().to_vec();
            let mut logits_cpu = cpu.prefill(&prompt).unwrap().to_vec();
            let mut worst = rel_err(&logits_dev, &logits_cpu);
            let (mut got, mut want) = (Vec::new(), Vec::new());
            for _ in 0..12 {
                got.push(argmax(&logits_dev));
                want.push(argmax(&logits_cpu));
                let t = *want.last().unwrap();
                logits_dev = dev.decode(t).unwrap().to_vec();
                logits_cpu = cpu.decode(t).unwrap().to_vec();
                worst = worst.max(rel_err(&logits_dev, &logits_cpu));
            }
            assert!(dev.is_gpu(), "{name}: the device engine fell back");
            println!("{name}: logits {worst:.2e}, greedy {got:?}");
            assert!(worst < 1e-4, "{name}: logits off by {worst:.2e}");
            assert_eq!(got, want, "{name}: greedy ids differ");
        });
    }
}

/// A model whose layers do not all fit the budget stays on the CPU, and the reason names the
/// experts; with room it loads.
#[test]
fn moe_model_whose_experts_do_not_fit_stays_on_the_cpu() {
    with_fixture("qwen2-moe-tiny", |model| {
        let desc = describe(model, 64).unwrap();
        let opts = LlmOptions {
            max_context: 64,
            ..LlmOptions::default()
        };
        let fp = FakeBackend::new(0).llm_footprint(&desc, &opts).unwrap();
        let layers: u64 = fp.layer_bytes.iter().sum();
        // A budget (0.9 of free memory less 512 MiB) of about half the layers.
        let total = ((layers / 2 + (512 << 20)) as f64 / 0.9) as u64;
        let small = fake_gpu(total);
        assert!(small.vram_budget() < layers);
        let why = GpuModel::try_load(&small, model, 64, None)
            .err()
            .expect("only part of the model fits");
        assert!(why.contains("experts do not fit"), "{why}");
        assert!(GpuModel::load(&small, model, 64, None).is_none());
        assert!(GpuModel::load(&fake_gpu(1 << 40), model, 64, None).is_some());
    });
}
