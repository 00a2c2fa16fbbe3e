//! The decoder against transformers on the committed tiny fixtures (`fixtures/llm`, made by
//! `scripts/make_llm_fixtures.py`), weights read straight from the fixtures' safetensors: f32
//! logits of every prompt position and of every KV-cache decode step within 1e-4 relative
//! (max |Δ| / max |logit| per row, the fixtures README's norm), and the 24-token greedy
//! continuation identical.
//!
//! The MoE fixtures use the same bound: their routers' k-th and (k+1)-th expert probabilities
//! differ by at least 1e-4 at every token (checked by the fixture script, the actual minimum is
//! in `expected.json`), far above f32 rounding, so the same experts are chosen and only
//! summation order separates the results.

mod common;
use cmf_llm::{Model, ModelConfig};
use common::*;

const TOL: f32 = 1e-4;

fn check_fixture(name: &str) {
    let dir = fixture_dir(name);
    let files = read_weight_files(&dir);
    let source = SafetensorsSource::new(&files);
    let config = ModelConfig::from_json(&read_json(dir.join("config.json"))).unwrap();
    let model = Model::from_source(&source, config, "").unwrap();
    let c = compare(&model, name);
    println!(
        "{name}: prompt logits {:.2e}, decode logits {:.2e}",
        c.prompt_err, c.decode_err
    );
    assert!(c.prompt_err < TOL && c.decode_err < TOL, "{name}: {c:?}");
    assert_eq!(
        c.greedy, c.want_greedy,
        "{name}: greedy continuation differs"
    );
}

#[test]
fn llama_tiny_matches_transformers() {
    check_fixture("llama-tiny");
}

#[test]
fn mistral_tiny_matches_transformers() {
    check_fixture("mistral-tiny");
}

#[test]
fn qwen2_tiny_matches_transformers() {
    check_fixture("qwen2-tiny");
}

#[test]
fn qwen3_tiny_matches_transformers() {
    check_fixture("qwen3-tiny");
}

#[test]
fn qwen3_moe_tiny_matches_transformers() {
    check_fixture("qwen3-moe-tiny");
}

#[test]
fn qwen3_moe_unnormalised_routing_matches_transformers() {
    check_fixture("qwen3-moe-unnorm-tiny");
}

#[test]
fn qwen2_moe_shared_expert_matches_transformers() {
    check_fixture("qwen2-moe-tiny");
}

/// The MoE fixtures bind the layer kinds their configs ask for: a dense MLP where
/// `mlp_only_layers` says so, routed experts (with a shared expert for Qwen2-MoE) elsewhere.
#[test]
fn moe_layers_follow_mlp_only_layers() {
    for (name, dense_layer, shared) in [("qwen3-moe-tiny", 1, false), ("qwen2-moe-tiny", 0, true)] {
        let dir = fixture_dir(name);
        let files = read_weight_files(&dir);
        let source = SafetensorsSource::new(&files);
        let config = ModelConfig::from_json(&read_json(dir.join("config.json"))).unwrap();
        let model = Model::from_source(&source, config, "").unwrap();
        for (i, l) in model.weights.layers.iter().enumerate() {
            match &l.ffn {
                cmf_llm::model::Ffn::Dense(_) => assert_eq!(i, dense_layer, "{name}"),
                cmf_llm::model::Ffn::Moe(m) => {
                    assert_ne!(i, dense_layer, "{name}");
                    assert_eq!((m.experts.len(), m.shared.is_some()), (8, shared));
                }
            }
        }
    }
}

/// `hidden_states(tokens, L)` followed by the final norm and lm_head gives the model's logits,
/// and stopping after k < L layers matches a model bound with only k layers.
#[test]
fn hidden_states_are_the_pre_norm_residual() {
    let dir = fixture_dir("qwen3-tiny");
    let files = read_weight_files(&dir);
    let source = SafetensorsSource::new(&files);
    let config = ModelConfig::from_json(&read_json(dir.join("config.json"))).unwrap();
    let model = Model::from_source(&source, config.clone(), "").unwrap();
    let prompt = ids(&read_json(dir.join("expected.json"))["prompt_ids"]);
    let h = model.config.hidden_size;

    let all = model
        .hidden_states(&prompt, model.config.num_layers)
        .unwrap();
    assert_eq!(all.len(), prompt.len() * h);
    let (want, vocab) = expected_matrix(&dir, "logits");
    let last = &all[(prompt.len() - 1) * h..];
    let mut xn = vec![0f32; h];
    let norm = &model.weights.final_norm;
    cmf_kernels::ops::rms_norm(
        last,
        h,
        Some(norm),
        model.config.rms_norm_eps,
        cmf_kernels::NormStyle::Plain,
        &mut xn,
    );
    let mut logits = vec![0f32; vocab];
    cmf_kernels::matvec(&model.weights.lm_head, &xn, &mut logits);
    let row = prompt.len() - 1;
    assert!(rel_err(&logits, &want[row * vocab..(row + 1) * vocab]) < TOL);

    let first = Model::from_source_layers(&source, config, "", 1).unwrap();
    let one = first.hidden_states(&prompt, 1).unwrap();
    assert_eq!(one, model.hidden_states(&prompt, 1).unwrap());
    assert!(first.hidden_states(&prompt, 2).is_err());
    assert!(
        first
            .prefill(&mut first.new_state(64).unwrap(), &prompt)
            .is_err(),
        "a partial model must refuse logits"
    );
}
