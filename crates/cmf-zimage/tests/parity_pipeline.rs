//! The text encoder and the whole pipeline against diffusers, through a pack written by our
//! converter from the fixture tree (f32 codecs: `--dit-quant f32 --te-quant f32`).
//! Tolerances: caption features 1e-4 relative (as the model parts); images within 1/255 on at
//! least 99.9 % of the pixels (the rounding to u8 turns sub-1e-4 differences into ±1 on the few
//! values that sit at a rounding boundary).

mod common;

use cmf_convert::zimage::Codec;
use cmf_zimage::pipeline::{generate, Plan, Request, ZimagePack};
use common::*;
use std::path::PathBuf;
use std::sync::OnceLock;

/// One f32 pack of the fixture tree per test binary.
fn f32_pack() -> &'static PathBuf {
    static PACK: OnceLock<PathBuf> = OnceLock::new();
    PACK.get_or_init(|| {
        let dir = scratch_dir("parity_pipeline");
        convert_tiny(&dir, "tiny-f32.cmf", Codec::F32, Codec::F32)
    })
}

#[test]
fn text_encoder_matches_transformers() {
    let pack = ZimagePack::open(f32_pack()).unwrap();
    let te = pack.text_encoder().unwrap();
    let e = Expected::load("te.safetensors");
    let cases: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixtures().join("expected/cases.json")).unwrap())
            .unwrap();
    for key in ["fox", "unicode", "empty"] {
        let prompt = cases["prompts"][key].as_str().unwrap();
        assert_eq!(
            te.templated(prompt).unwrap(),
            cases["templated"][key].as_str().unwrap(),
            "template {key}"
        );
        let toks = te.tokenize(prompt, 512).unwrap();
        let want: Vec<u32> = e
            .i32(&format!("ids.{key}"))
            .into_iter()
            .map(|x| x as u32)
            .collect();
        assert_eq!(toks.ids, want, "ids {key}");
        assert!(!toks.truncated());
        let h = te.encode(&toks.ids).unwrap();
        let err = rel_err(&h, &e.f32(&format!("hidden.{key}")));
        assert!(err < 1e-4, "{key}: rel err {err}");
    }
    // Over the limit: the first 512 templated tokens, as diffusers truncates.
    let long = te
        .tokenize(cases["long_prompt"].as_str().unwrap(), 512)
        .unwrap();
    assert!(long.truncated());
    assert_eq!(
        long.full_len as u64,
        cases["long_prompt_full_tokens"].as_u64().unwrap()
    );
    let want: Vec<u32> = e.i32("ids.long").into_iter().map(|x| x as u32).collect();
    assert_eq!(long.ids, want);
}

/// Runs a fixture recipe with its injected latents and compares the image.
fn pipeline_case(name: &str) {
    let pack = ZimagePack::open(f32_pack()).unwrap();
    let e = Expected::load("pipeline.safetensors");
    let cases: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixtures().join("expected/cases.json")).unwrap())
            .unwrap();
    let r = &cases["recipes"][name];
    let dir = tempfile::tempdir().unwrap();
    let lat_path = dir.path().join("latents.f32");
    let lat: Vec<u8> = e
        .f32(&format!("{name}.latents"))
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    std::fs::write(&lat_path, lat).unwrap();
    let req = Request {
        prompt: r["prompt"].as_str().unwrap().into(),
        negative_prompt: r["negative_prompt"].as_str().map(String::from),
        width: Some(r["width"].as_u64().unwrap() as usize),
        height: Some(r["height"].as_u64().unwrap() as usize),
        steps: Some(r["num_inference_steps"].as_u64().unwrap() as usize),
        guidance: Some(r["guidance_scale"].as_f64().unwrap() as f32),
        seed: 0,
        latents: Some(lat_path),
        ..Default::default()
    };
    let plan = Plan::new(&req, &pack.recipe).unwrap();
    let out = generate(&pack, &plan, &cmf_gpu::Gpu::cpu_only(), &mut |_| {}).unwrap();
    let err = rel_err(&out.final_latents, &e.f32(&format!("{name}.final_latents")));
    assert!(err < 1e-4, "{name}: final latents rel err {err}");
    let want = e.u8(&format!("{name}.image"));
    assert_eq!(out.rgb.len(), want.len());
    let off = out
        .rgb
        .iter()
        .zip(&want)
        .filter(|(a, b)| a.abs_diff(**b) > 1)
        .count();
    let max = out
        .rgb
        .iter()
        .zip(&want)
        .map(|(a, b)| a.abs_diff(*b))
        .max()
        .unwrap();
    let exact = out.rgb.iter().zip(&want).filter(|(a, b)| a == b).count();
    eprintln!(
        "{name}: {exact}/{} values exact, max diff {max}",
        want.len()
    );
    assert!(
        (off as f64) <= 0.001 * want.len() as f64,
        "{name}: {off} values off by more than 1/255 (max {max})"
    );
}

#[test]
fn turbo_pipeline_matches_diffusers() {
    pipeline_case("turbo");
}

#[test]
fn cfg_pipeline_matches_diffusers() {
    pipeline_case("cfg");
}

#[test]
fn released_pages_read_back_the_same() {
    let pack = ZimagePack::open(f32_pack()).unwrap();
    let name = "dit.layers.0.feed_forward.w1.weight";
    let before = pack.model.get(name).unwrap().data.to_vec();
    pack.model.release_pages("dit.");
    assert_eq!(pack.model.get(name).unwrap().data, &before[..]);
}
