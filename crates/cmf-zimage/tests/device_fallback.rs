//! The device plumbing of the pipeline and its CPU fallbacks, on machines without a GPU: cmf-gpu's
//! fake backend stands in for the device. Its DiT checks what it is handed as the CUDA DiT does
//! (caption and RoPE sizes, prepared items, output sizes) and returns each item's patches as the
//! velocity; its VAE writes zeros; its LLM runs the CPU reference. So these tests pin down the
//! wiring (what goes to the device, what comes back, when the CPU takes over), and the CUDA tests
//! (`gpu_dit.rs`, `gpu_vae.rs`) the numerics.

mod common;

use cmf_convert::zimage::Codec;
use cmf_format::Dtype;
use cmf_gpu::facade::fake::FakeBackend;
use cmf_gpu::{cpu_scope, pause_gpu, Gpu, GpuMode};
use cmf_zimage::denoiser::Denoiser;
use cmf_zimage::pipeline::{generate, generate_with, Plan, Request, Resident, ZimagePack};
use cmf_zimage::tensors::{Loader, MemTensors};
use cmf_zimage::transformer::{DitConfig, DitItem, ZImageDit};
use common::*;
use std::sync::{Arc, Mutex};

/// `pause_gpu` is process-wide: the tests of this file take turns.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn fake_gpu() -> Gpu {
    Gpu::with_backend(GpuMode::Auto, Arc::new(FakeBackend::new(1 << 40)))
}

fn fixture_dit() -> (MemTensors, DitConfig) {
    let mut m = MemTensors::new("fixtures/zimage/tiny/transformer");
    load_component("transformer", "dit.", &mut m);
    let cfg = DitConfig::from_json(&config("transformer", "config.json"), "fixture").unwrap();
    (m, cfg)
}

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 1000) as f32 / 500.0 - 1.0
        })
        .collect()
}

fn cpu_velocity(
    dit: &ZImageDit,
    caps: &[(Vec<f32>, usize)],
    lat: &[f32],
    t: f32,
    items: &[usize],
    h: usize,
    w: usize,
) -> Vec<Vec<f32>> {
    let conds: Vec<_> = caps.iter().map(|(c, n)| dit.condition(c, *n)).collect();
    let batch: Vec<DitItem> = items
        .iter()
        .map(|&i| DitItem {
            latents: lat,
            cond: &conds[i],
            t,
        })
        .collect();
    dit.velocity(&batch, h, w)
}

/// The timestep embeddings made ahead of the device steps (in parallel, before the loop) are
/// the ones a step would make itself, keyed by the exact model time; other times are made on
/// demand, and the CPU path makes none ahead.
#[test]
fn precomputed_timestep_embeddings_equal_the_ones_made_per_step() {
    let _serial = serial();
    let (src, cfg) = fixture_dit();
    let dit = ZImageDit::load(&Loader::new(&src, "dit."), cfg.clone()).unwrap();
    let caps = vec![(values(5 * 64, 2), 5)];
    let sched = cmf_zimage::scheduler::Schedule::new(4, 3.0);
    let gpu = fake_gpu();
    let mut den = Denoiser::new(&dit, &gpu, caps.clone(), 6, 10);
    assert!(den.on_device());
    den.precompute_t_embeds(&sched.model_t);
    for &t in sched.model_t.iter().chain(&[0.123f32]) {
        let want = dit.t_embed(t * cfg.t_scale);
        let got = den.t_embedding(t);
        assert!(got.as_ref() == want.as_slice(), "t = {t}");
        let made_ahead = matches!(got, std::borrow::Cow::Borrowed(_));
        assert_eq!(made_ahead, t != 0.123, "t = {t}");
    }
    let cpu = Gpu::cpu_only();
    let mut den = Denoiser::new(&dit, &cpu, caps, 6, 10);
    den.precompute_t_embeds(&sched.model_t);
    assert!(matches!(
        den.t_embedding(sched.model_t[1]),
        std::borrow::Cow::Owned(_)
    ));
}

/// Two captions of different padded lengths, an odd-sized latent: the sizes the denoiser hands
/// the device pass its checks, and each item's output is its own (unpatchified) input.
#[test]
fn device_steps_get_consistent_inputs_and_come_back_per_item() {
    let _serial = serial();
    let (src, cfg) = fixture_dit();
    let dit = ZImageDit::load(&Loader::new(&src, "dit."), cfg.clone()).unwrap();
    let caps = vec![(values(40 * 64, 1), 40), (values(5 * 64, 2), 5)];
    let (h, w) = (6, 10);
    let lat = values(16 * h * w, 3);
    let gpu = fake_gpu();
    let mut den = Denoiser::new(&dit, &gpu, caps, h, w);
    assert!(den.on_device(), "the fake device refused the setup");
    for items in [vec![0, 1], vec![0], vec![1]] {
        let out = den.velocity(&lat, 0.5, &items);
        assert!(den.on_device());
        assert_eq!(out.len(), items.len());
        for o in &out {
            assert_eq!(
                o, &lat,
                "patchify → device → unpatchify is not the identity"
            );
        }
    }
}

/// A refusal at any step hands that step and the rest to the CPU, bit-equal to the CPU path.
#[test]
fn refusal_mid_run_continues_on_the_cpu() {
    let _serial = serial();
    let (src, cfg) = fixture_dit();
    let dit = ZImageDit::load(&Loader::new(&src, "dit."), cfg.clone()).unwrap();
    let caps = vec![(values(9 * 64, 4), 9)];
    let lat = values(16 * 8 * 8, 5);
    let gpu = fake_gpu();
    let mut den = Denoiser::new(&dit, &gpu, caps.clone(), 8, 8);
    assert_eq!(den.velocity(&lat, 0.3, &[0])[0], lat);
    gpu.inject_refusal_after(0);
    let got = den.velocity(&lat, 0.7, &[0]);
    assert!(!den.on_device());
    assert_eq!(got, cpu_velocity(&dit, &caps, &lat, 0.7, &[0], 8, 8));
    // Later steps stay on the CPU.
    let got = den.velocity(&lat, 0.9, &[0]);
    assert_eq!(got, cpu_velocity(&dit, &caps, &lat, 0.9, &[0], 8, 8));
}

/// `pause_gpu` and `cpu_scope` keep the DiT on the CPU from the start.
#[test]
fn pause_and_cpu_scope_keep_the_dit_on_the_cpu() {
    let _serial = serial();
    let (src, cfg) = fixture_dit();
    let dit = ZImageDit::load(&Loader::new(&src, "dit."), cfg.clone()).unwrap();
    let caps = vec![(values(3 * 64, 6), 3)];
    let lat = values(16 * 4 * 4, 7);
    let gpu = fake_gpu();
    {
        let _p = pause_gpu();
        let mut den = Denoiser::new(&dit, &gpu, caps.clone(), 4, 4);
        assert!(!den.on_device());
        assert_eq!(
            den.velocity(&lat, 0.5, &[0]),
            cpu_velocity(&dit, &caps, &lat, 0.5, &[0], 4, 4)
        );
    }
    {
        let _s = cpu_scope();
        assert!(!Denoiser::new(&dit, &gpu, caps.clone(), 4, 4).on_device());
    }
    assert!(Denoiser::new(&dit, &gpu, caps, 4, 4).on_device());
}

fn tiny_pack() -> (tempfile::TempDir, ZimagePack) {
    let dir = tempfile::tempdir().unwrap();
    let out = convert_tiny(
        dir.path(),
        "tiny.cmf",
        Codec::Quant(Dtype::Q8_2f),
        Codec::F32,
    );
    let pack = ZimagePack::open(&out).unwrap();
    (dir, pack)
}

fn plan(pack: &ZimagePack) -> Plan {
    let req = Request {
        prompt: "a red fox".into(),
        width: Some(32),
        height: Some(48),
        steps: Some(2),
        seed: 3,
        ..Default::default()
    };
    Plan::new(&req, &pack.recipe).unwrap()
}

/// Every stage goes to the device when it answers (the fake VAE's zeros make a mid-gray image),
/// models stay resident across runs, and a refusal from the start gives the CPU image exactly.
#[test]
fn pipeline_stages_use_the_device_and_fall_back_to_the_cpu_image() {
    let _serial = serial();
    let (_dir, pack) = tiny_pack();
    let plan = plan(&pack);
    let gpu = fake_gpu();
    let mut resident = Resident::default();
    for run in 0..2 {
        let out = generate_with(&pack, &plan, &gpu, &mut resident, &mut |_| {}).unwrap();
        let t = &out.timings;
        assert!(
            t.te_on_device && t.dit_on_device && t.vae_on_device,
            "run {run}: {t:?}"
        );
        assert!(
            out.rgb.iter().all(|&v| v == 128),
            "run {run}: the fake VAE's zeros are mid-gray"
        );
    }
    let cpu = generate(&pack, &plan, &Gpu::cpu_only(), &mut |_| {}).unwrap();
    gpu.inject_refusal_after(0);
    let refused = generate(&pack, &plan, &gpu, &mut |_| {}).unwrap();
    let t = &refused.timings;
    assert!(!t.te_on_device && !t.dit_on_device && !t.vae_on_device);
    assert_eq!(refused.rgb, cpu.rgb);
    assert_eq!(refused.final_latents, cpu.final_latents);
}
