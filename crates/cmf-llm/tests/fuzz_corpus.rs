//! The committed corpora of the `text_assets` and `model_loader` fuzz targets (fuzz/corpus/),
//! seeds and regression reproducers, through the same functions the targets call: none may
//! panic, and each file is done within seconds.

use cmf_test_support::fuzz::{corpus, run_corpus};
use std::path::Path;

use cmf_format::{Arch, CmfWriter, Dtype, Header, LayerType, QuantType, TokenizerConfig};

#[test]
fn text_assets_corpus() {
    run_corpus("text_assets", 8, cmf_llm::fuzzing::text_assets);
}

#[test]
fn model_loader_corpus() {
    run_corpus("model_loader", 8, cmf_llm::fuzzing::model_loader);
    // The seed the mutations start from gets past the loader, and each hostile header is refused
    // there, naming its field.
    let load = |name: &str| {
        let f = cmf_format::CmfModel::open(corpus("model_loader").join(name)).unwrap();
        cmf_llm::Model::load(&f)
            .map(drop)
            .map_err(|e| e.to_string())
    };
    load("tiny-llama.cmf").unwrap();
    for (name, field) in [
        ("intermediate-2e40.cmf", "intermediate_size"),
        ("vocab-2e40.cmf", "vocab_size"),
        ("positions-2e40.cmf", "max_position_embeddings"),
        ("rms-eps-negative.cmf", "rms_norm_eps"),
        ("rope-theta-negative.cmf", "rope_theta"),
        ("head-dim-huge.cmf", "head_dim"),
    ] {
        let e = load(name).unwrap_err();
        assert!(e.contains(field), "{name}: {e}");
    }
}

const TOKENIZER: &str = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,"model":{"type":"WordLevel","vocab":{"[UNK]":0,"hello":1,"world":2,"!":3},"unk_token":"[UNK]"}}"#;

/// A complete tiny Llama (hidden 8, one layer, vocab 4) with `edit` applied to its header.
fn tiny_llama(path: &Path, tokenizer: &str, edit: impl FnOnce(&mut Header)) {
    let (h, ff, v) = (8usize, 16usize, 4usize);
    let arch = Arch {
        arch_name: "llama".into(),
        hidden_size: h,
        intermediate_size: ff,
        num_layers: 1,
        num_attention_heads: 2,
        num_kv_heads: 1,
        head_dim: 4,
        vocab_size: v,
        layer_types: vec![LayerType::FullAttention],
        max_position_embeddings: 32,
        ..Arch::default()
    };
    let mut header = Header::new(arch, QuantType::F32);
    header.tokenizer_config = Some(TokenizerConfig {
        chat_template: Some("{% for m in messages %}{{ m.content }}{% endfor %}".into()),
        eos_token_ids: vec![3],
        ..Default::default()
    });
    edit(&mut header);
    let mut w = CmfWriter::create(path, header).unwrap();
    let mut add = |name: &str, shape: &[usize]| {
        let n: usize = shape.iter().product();
        let vals: Vec<f32> = (0..n).map(|i| ((i * 7) % 11) as f32 / 11.0 - 0.5).collect();
        w.add_f32(name, Dtype::F32, shape, &vals).unwrap();
    };
    add("model.embed_tokens.weight", &[v, h]);
    add("model.norm.weight", &[h]);
    add("lm_head.weight", &[v, h]);
    let p = |s: &str| format!("model.layers.0.{s}");
    add(&p("input_layernorm.weight"), &[h]);
    add(&p("post_attention_layernorm.weight"), &[h]);
    add(&p("self_attn.q_proj.weight"), &[8, h]);
    add(&p("self_attn.k_proj.weight"), &[4, h]);
    add(&p("self_attn.v_proj.weight"), &[4, h]);
    add(&p("self_attn.o_proj.weight"), &[h, 8]);
    add(&p("mlp.gate_proj.weight"), &[ff, h]);
    add(&p("mlp.up_proj.weight"), &[ff, h]);
    add(&p("mlp.down_proj.weight"), &[h, ff]);
    w.set_vocab(tokenizer.as_bytes());
    w.finish().unwrap();
}

/// Writes the `model_loader` seeds: a tiny model that loads and runs, and one reproducer per
/// hostile header the loader must refuse. `cargo test --release -p cmf-llm --test fuzz_corpus
/// -- --ignored`.
#[test]
#[ignore]
fn write_model_loader_seeds() {
    let d = corpus("model_loader");
    std::fs::create_dir_all(&d).unwrap();
    let panic_tok = TOKENIZER.replace(
        r#""normalizer":null"#,
        r#""normalizer":{"type":"Precompiled","precompiled_charsmap":"BAAAAP////8="}"#,
    );
    type Edit = Box<dyn FnOnce(&mut Header)>;
    let cases: Vec<(&str, &str, Edit)> = vec![
        ("tiny-llama.cmf", TOKENIZER, Box::new(|_| {})),
        (
            "intermediate-2e40.cmf",
            TOKENIZER,
            Box::new(|h| h.arch.intermediate_size = 1 << 40),
        ),
        (
            "vocab-2e40.cmf",
            TOKENIZER,
            Box::new(|h| h.arch.vocab_size = 1 << 40),
        ),
        (
            "positions-2e40.cmf",
            TOKENIZER,
            Box::new(|h| h.arch.max_position_embeddings = 1 << 40),
        ),
        (
            "rms-eps-negative.cmf",
            TOKENIZER,
            Box::new(|h| h.arch.rms_norm_eps = -1e-5),
        ),
        (
            "rope-theta-negative.cmf",
            TOKENIZER,
            Box::new(|h| h.arch.rope_theta = -1.0),
        ),
        (
            "head-dim-huge.cmf",
            TOKENIZER,
            Box::new(|h| h.arch.head_dim = 1 << 30),
        ),
        ("tokenizer-panics.cmf", &panic_tok, Box::new(|_| {})),
        (
            "template-nested-loops.cmf",
            TOKENIZER,
            Box::new(|h| {
                h.tokenizer_config.as_mut().unwrap().chat_template = Some(
                    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
                        .into(),
                )
            }),
        ),
        (
            "template-tojson-indent.cmf",
            TOKENIZER,
            Box::new(|h| {
                h.tokenizer_config.as_mut().unwrap().chat_template =
                    Some("{{ messages | tojson(indent=100000000000) }}".into())
            }),
        ),
    ];
    for (name, tok, edit) in cases {
        tiny_llama(&d.join(name), tok, edit);
    }
}
