//! RoPE frequencies of every rope type against transformers' `ROPE_INIT_FUNCTIONS`
//! (`tests/data/rope_reference.json`, made by `scripts/make_rope_reference.py`): default, linear,
//! dynamic (below and past the maximum positions), llama3, yarn (default betas, mscale /
//! mscale_all_dim with custom betas, explicit attention_factor without truncation). Relative
//! error ≤ 1e-6 per inverse frequency and on the attention scaling (both are f32 in transformers).

mod common;
use cmf_llm::ModelConfig;
use serde_json::json;

#[test]
fn rope_parameters_match_transformers() {
    let data = common::read_json(
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/rope_reference.json"),
    );
    for case in data["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let cfg = json!({"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 1,
            "num_attention_heads": 4, "head_dim": 64, "vocab_size": 16, "max_position_embeddings": 128,
            "rope_parameters": case["config"]["rope_parameters"]});
        let config = ModelConfig::from_json(&cfg).unwrap_or_else(|e| panic!("{name}: {e}"));
        let rope = cmf_llm::model::rope::Rope::new(&config.rope);
        let seq_len = case["seq_len"].as_u64().map_or(1, |s| s as usize);
        let got = rope.inv_freq_for(seq_len);
        let want: Vec<f64> = case["inv_freq"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert_eq!(got.len(), want.len(), "{name}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                ((*g as f64) - w).abs() <= 1e-6 * w.abs(),
                "{name}: inv_freq[{i}] {g} vs {w}"
            );
        }
        let scale = case["attention_scaling"].as_f64().unwrap();
        assert!(
            (rope.attention_scaling() as f64 - scale).abs() <= 1e-6 * scale,
            "{name}: scaling {} vs {scale}",
            rope.attention_scaling()
        );
    }
}
