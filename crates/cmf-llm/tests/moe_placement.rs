//! A mixture-of-experts model is declined by the GPU hook before the device is asked for
//! anything (the device graph has no expert kernels yet), so generation runs it on the CPU; a
//! dense model on the same device still loads.

mod common;
use cmf_gpu::facade::fake::FakeBackend;
use cmf_gpu::facade::{Gpu, GpuMode};
use cmf_llm::gpu::{cpu_only, describe, GpuModel, MOE_ON_CPU};
use cmf_llm::{Model, ModelConfig};
use common::*;
use std::sync::atomic::Ordering;
use std::sync::Arc;

#[test]
fn moe_models_stay_on_the_cpu_without_touching_the_device() {
    let backend = Arc::new(FakeBackend::new(1 << 40));
    let faults = backend.faults.clone();
    let gpu = Gpu::with_backend(GpuMode::Auto, backend);
    // Any call into the backend would now panic (and retire the device): none may happen.
    faults.panic_next.store(true, Ordering::SeqCst);

    for name in ["qwen3-moe-tiny", "qwen2-moe-tiny"] {
        let dir = fixture_dir(name);
        let files = read_weight_files(&dir);
        let source = SafetensorsSource::new(&files);
        let config = ModelConfig::from_json(&read_json(dir.join("config.json"))).unwrap();
        let model = Model::from_source(&source, config, "").unwrap();
        assert_eq!(cpu_only(&model), Some(MOE_ON_CPU), "{name}");
        assert_eq!(describe(&model, 64).err().as_deref(), Some(MOE_ON_CPU));
        assert!(GpuModel::load(&gpu, &model, 64, None).is_none(), "{name}");
    }
    assert!(
        faults.panic_next.load(Ordering::SeqCst),
        "the device was called for a MoE model"
    );
    assert!(gpu.is_active());

    faults.panic_next.store(false, Ordering::SeqCst);
    let dir = fixture_dir("qwen3-tiny");
    let files = read_weight_files(&dir);
    let source = SafetensorsSource::new(&files);
    let config = ModelConfig::from_json(&read_json(dir.join("config.json"))).unwrap();
    let dense = Model::from_source(&source, config, "").unwrap();
    assert_eq!(cpu_only(&dense), None);
    assert!(GpuModel::load(&gpu, &dense, 64, None).is_some());
}
