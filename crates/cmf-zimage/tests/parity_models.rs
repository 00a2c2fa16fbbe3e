//! The model parts against diffusers on the tiny random-weight fixtures (f32 weights, f32 math).
//! Tolerance 1e-4 relative (max |Δ| / max |reference|): f32 round-off through a few layers, with
//! summation orders that differ from torch's, stays around 1e-6; a wrong op is off by > 1e-2.

mod common;

use cmf_zimage::scheduler::Schedule;
use cmf_zimage::tensors::{Loader, MemTensors};
use cmf_zimage::transformer::{DitConfig, DitItem, ZImageDit};
use cmf_zimage::vae::{VaeConfig, VaeDecoder};
use common::*;

#[test]
fn scheduler_sequences_equal_diffusers() {
    let e = Expected::load("scheduler.safetensors");
    let mut checked = 0;
    for shift in [3.0f32, 6.0] {
        for n in [1usize, 2, 3, 4, 8, 9, 20, 28, 50] {
            let key = format!("s{shift}.n{n}");
            let s = Schedule::new(n, shift);
            assert_eq!(s.sigmas, e.f32(&format!("sigmas.{key}")), "sigmas {key}");
            assert_eq!(
                s.timesteps,
                e.f32(&format!("timesteps.{key}")),
                "timesteps {key}"
            );
            assert_eq!(s.model_t, e.f32(&format!("tmodel.{key}")), "model t {key}");
            checked += 1;
        }
    }
    assert_eq!(checked, 18);
}

fn dit_source() -> MemTensors {
    let mut m = MemTensors::new("fixtures/zimage/tiny/transformer");
    load_component("transformer", "dit.", &mut m);
    m
}

#[test]
fn dit_forward_matches_diffusers() {
    let src = dit_source();
    let ld = Loader::new(&src, "dit.");
    let cfg = DitConfig::from_json(&config("transformer", "config.json"), "fixture").unwrap();
    let dit = ZImageDit::load(&ld, cfg).unwrap();
    let e = Expected::load("dit.safetensors");
    for case in ["pad", "exact"] {
        let p = format!("{case}.0");
        let shape = e.shape(&format!("{p}.x"));
        let (h, w) = (shape[1], shape[2]);
        let cap = e.f32(&format!("{p}.cap"));
        let out = dit.forward(
            &e.f32(&format!("{p}.x")),
            h,
            w,
            e.f32(&format!("{p}.t"))[0],
            &cap,
            cap.len() / 64,
        );
        let err = rel_err(&out, &e.f32(&format!("{p}.out")));
        assert!(err < 1e-4, "{case}: rel err {err}");
    }
}

#[test]
fn dit_batch_of_two_matches_diffusers_masked_batch() {
    let src = dit_source();
    let ld = Loader::new(&src, "dit.");
    let cfg = DitConfig::from_json(&config("transformer", "config.json"), "fixture").unwrap();
    let dit = ZImageDit::load(&ld, cfg).unwrap();
    let e = Expected::load("dit.safetensors");
    let caps: Vec<Vec<f32>> = (0..2).map(|i| e.f32(&format!("batch2.{i}.cap"))).collect();
    let conds: Vec<_> = caps
        .iter()
        .map(|c| dit.condition(c, c.len() / 64))
        .collect();
    let xs: Vec<Vec<f32>> = (0..2).map(|i| e.f32(&format!("batch2.{i}.x"))).collect();
    let items: Vec<DitItem> = (0..2)
        .map(|i| DitItem {
            latents: &xs[i],
            cond: &conds[i],
            t: e.f32(&format!("batch2.{i}.t"))[0],
        })
        .collect();
    let outs = dit.velocity(&items, 4, 4);
    for (i, out) in outs.iter().enumerate() {
        let err = rel_err(out, &e.f32(&format!("batch2.{i}.out")));
        assert!(err < 1e-4, "item {i}: rel err {err}");
    }
}

#[test]
fn vae_decode_matches_diffusers() {
    let mut src = MemTensors::new("fixtures/zimage/tiny/vae");
    load_component("vae", "vae.", &mut src);
    let ld = Loader::new(&src, "vae.");
    let cfg = VaeConfig::from_json(&config("vae", "config.json"), "fixture").unwrap();
    let vae = VaeDecoder::load(&ld, cfg).unwrap();
    let e = Expected::load("vae.safetensors");
    for case in ["square", "wide"] {
        let shape = e.shape(&format!("{case}.z"));
        let img = vae.decode(&e.f32(&format!("{case}.z")), shape[1], shape[2]);
        assert_eq!((img.c, img.h, img.w), (3, shape[1] * 8, shape[2] * 8));
        let err = rel_err(&img.data, &e.f32(&format!("{case}.image")));
        assert!(err < 1e-4, "{case}: rel err {err}");
    }
}
