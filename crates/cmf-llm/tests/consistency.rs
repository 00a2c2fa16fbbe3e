//! The same sequence computed in different splits gives the same logits: one pass of every
//! position (prefill chunks of 256), versus irregular prefill pieces followed by one-token
//! decode steps — across chunk boundaries, the cached RoPE table's 256-position spans, the
//! sliding window (mistral-tiny, window 16), the MoE blocks' grouped prefill against their
//! per-token decode, and past the fixtures' trained 256 positions.

mod common;
use cmf_kernels::KvDtype;
use cmf_llm::{Model, ModelConfig};
use common::*;

fn check(name: &str) {
    let dir = fixture_dir(name);
    let files = read_weight_files(&dir);
    let source = SafetensorsSource::new(&files);
    let mut cfg_json = read_json(dir.join("config.json"));
    cfg_json["max_position_embeddings"] = 1024.into();
    let model =
        Model::from_source(&source, ModelConfig::from_json(&cfg_json).unwrap(), "").unwrap();
    let vocab = model.config.vocab_size;
    let tokens: Vec<u32> = (0..600u32).map(|i| (i * 7919 + 13) % 500 + 3).collect();

    let mut all = vec![0f32; tokens.len() * vocab];
    let mut st = model.new_state(1024).unwrap();
    model
        .forward_scored(&mut st, &tokens, 0, |i, l| {
            all[i * vocab..(i + 1) * vocab].copy_from_slice(l)
        })
        .unwrap();

    let mut st = model.new_state_with(1024, KvDtype::F32).unwrap();
    let mut pos = 0;
    let mut worst = 0f32;
    for piece in [100usize, 1, 250, 7, 2] {
        let l = model.prefill(&mut st, &tokens[pos..pos + piece]).unwrap();
        pos += piece;
        worst = worst.max(rel_err(l, &all[(pos - 1) * vocab..pos * vocab]));
    }
    while pos < tokens.len() {
        let l = model.decode(&mut st, tokens[pos]).unwrap();
        pos += 1;
        worst = worst.max(rel_err(l, &all[(pos - 1) * vocab..pos * vocab]));
    }
    println!("{name}: worst relative difference {worst:.2e}");
    assert!(worst < 1e-5, "{name}: {worst}");
}

#[test]
fn splits_agree_qwen3() {
    check("qwen3-tiny");
}

/// MoE: prefill runs experts as GEMMs over the rows routed to them, decode as matvecs.
#[test]
fn splits_agree_qwen3_moe() {
    check("qwen3-moe-tiny");
}

#[test]
fn splits_agree_qwen2_moe_shared_expert() {
    check("qwen2-moe-tiny");
}

#[test]
fn splits_agree_mistral_sliding_window() {
    check("mistral-tiny");
}

/// The f16 KV cache (the CLI default) against the exact f32 one on the fixtures' 48-token prompt
/// and 24 greedy steps: measured worst relative logit difference 3.3e-4 to 8.1e-4
/// (qwen3-tiny); bound 2e-3.
#[test]
fn f16_kv_cache_close_to_f32() {
    for name in FIXTURES {
        let dir = fixture_dir(name);
        let files = read_weight_files(&dir);
        let source = SafetensorsSource::new(&files);
        let model = Model::from_source(
            &source,
            ModelConfig::from_json(&read_json(dir.join("config.json"))).unwrap(),
            "",
        )
        .unwrap();
        let prompt = ids(&read_json(dir.join("expected.json"))["prompt_ids"]);
        let (mut a, mut b) = (
            model.new_state_with(128, KvDtype::F32).unwrap(),
            model.new_state_with(128, KvDtype::F16).unwrap(),
        );
        let mut la = model.prefill(&mut a, &prompt).unwrap().to_vec();
        let mut worst = rel_err(model.prefill(&mut b, &prompt).unwrap(), &la);
        for _ in 0..24 {
            let t = argmax(&la);
            la = model.decode(&mut a, t).unwrap().to_vec();
            worst = worst.max(rel_err(model.decode(&mut b, t).unwrap(), &la));
        }
        println!("{name}: f16 KV worst relative difference {worst:.2e}");
        assert!(worst < 2e-3, "{name}: {worst}");
    }
}
