//! `cmf convert --model` on the transformers fixtures (fixtures/llm/*, scripts/make_llm_fixtures.py):
//! every tensor round-trips (f32: bit-exact; bf16 source in bf16: bit-exact; quantized: within the
//! codec's bound), tied/untied embeddings, sharded checkpoints, tokenizer/template/eos.

use std::path::{Path, PathBuf};

use cmf_convert::{hf, Options, Quant};
use cmf_format::{CmfFile, Dtype, LayerType};
use safetensors::SafeTensors;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/llm")
        .join(name)
}

/// All tensors of a fixture as f32 (the source of truth), from its safetensors files.
fn source_tensors(dir: &Path) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let p = entry.unwrap().path();
        let name = p.file_name().unwrap().to_str().unwrap().to_owned();
        if !name.starts_with("model") || !name.ends_with(".safetensors") {
            continue;
        }
        let bytes = std::fs::read(&p).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        for (n, t) in st.tensors() {
            let vals: Vec<f32> = match t.dtype() {
                safetensors::Dtype::F32 => t
                    .data()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                    .collect(),
                safetensors::Dtype::BF16 => t
                    .data()
                    .chunks_exact(2)
                    .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                    .collect(),
                d => panic!("fixture dtype {d:?}"),
            };
            out.push((n, t.shape().to_vec(), vals));
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn convert(name: &str, quant: Quant) -> (tempfile::TempDir, PathBuf, cmf_convert::Report) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join(format!("{name}.cmf"));
    let opts = Options {
        quant: Some(quant),
        measure_error: true,
        ..Default::default()
    };
    let report = hf::convert(&fixture(name), &out, &opts).unwrap();
    (dir, out, report)
}

#[test]
fn f32_round_trip_is_exact_for_every_fixture() {
    for name in [
        "llama-tiny",
        "qwen2-tiny",
        "qwen3-tiny",
        "mistral-tiny",
        "qwen3next-dense-tiny",
        "qwen3next-tiny",
        "qwen3-moe-tiny",
        "qwen2-moe-tiny",
    ] {
        let (_d, out, report) = convert(name, Quant::F32);
        let f = CmfFile::open(&out).unwrap();
        assert!(f.verify().is_ok(), "{name}: {:?}", f.verify());
        let src = source_tensors(&fixture(name));
        let tied = f.header().arch.tie_word_embeddings;
        let expected: Vec<_> = src
            .iter()
            .filter(|(n, ..)| !(tied && n == "lm_head.weight"))
            .collect();
        assert_eq!(f.len(), expected.len(), "{name}: tensor count");
        assert_eq!(report.tensors.len(), expected.len());
        for (n, shape, vals) in expected {
            let t = f.get(n).unwrap();
            assert_eq!(t.dtype, Dtype::F32, "{name} {n}");
            assert_eq!(t.shape.as_slice(), shape.as_slice(), "{name} {n}");
            let got = t.to_f32().unwrap();
            assert!(
                got.iter()
                    .zip(vals)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{name} {n}: values differ"
            );
        }
        assert_eq!(report.total.err_sq, 0.0);
    }
}

#[test]
fn bf16_source_to_bf16_is_exact() {
    let (_d, out, _) = convert("qwen3-tiny", Quant::Bf16);
    let f = CmfFile::open(&out).unwrap();
    for (n, _, vals) in source_tensors(&fixture("qwen3-tiny")) {
        let t = f.get(&n).unwrap();
        let want = if vals.len() == t.shape.as_slice().last().copied().unwrap_or(1)
            && t.shape.ndim() == 1
        {
            Dtype::F32
        } else {
            Dtype::Bf16
        };
        assert_eq!(t.dtype, want, "{n}");
        assert_eq!(t.to_f32().unwrap(), vals, "{n}");
    }
}

/// Per-tensor relative RMS bounds: q8_row ≤ 1/127 of a row's absmax per element, which for
/// Gaussian-like rows is ≈ 0.6 % of the RMS; q4_tiled ≈ 8–10 %; bound with margin.
#[test]
fn quantized_codecs_stay_within_bounds() {
    for (quant, dtype, bound) in [
        (Quant::Q8, Dtype::Q8Row, 0.012),
        (Quant::Q8_2f, Dtype::Q8_2f, 0.03),
        (Quant::Q4, Dtype::Q4Tiled, 0.15),
    ] {
        let (_d, out, report) = convert("llama-tiny", quant);
        let f = CmfFile::open(&out).unwrap();
        for (n, d, s) in &report.tensors {
            let t = f.get(n).unwrap();
            assert_eq!(t.dtype, *d);
            if t.shape.ndim() == 1 {
                assert_eq!(*d, Dtype::F32, "{n}: vectors stay f32");
                assert_eq!(s.err_sq, 0.0);
            } else {
                assert_eq!(*d, dtype, "{n}");
                assert!(
                    s.relative_rms() < bound,
                    "{quant} {n}: relative RMS {}",
                    s.relative_rms()
                );
                assert!(
                    s.relative_rms() > 0.0,
                    "{quant} {n}: lossless? the measurement is not running"
                );
            }
        }
    }
}

#[test]
fn header_carries_arch_tokenizer_and_provenance() {
    let (_d, out, _) = convert("qwen3-tiny", Quant::Q8);
    let f = CmfFile::open(&out).unwrap();
    let h = f.header();
    let a = &h.arch;
    assert_eq!(
        (
            a.arch_name.as_str(),
            a.num_layers,
            a.num_attention_heads,
            a.num_kv_heads,
            a.head_dim
        ),
        ("qwen3", 2, 4, 2, 32)
    );
    assert_eq!(
        (a.vocab_size, a.rope_theta, a.tie_word_embeddings),
        (544, 1e6, true)
    );
    assert!(f.tensor("lm_head.weight").is_none());
    let tc = h.tokenizer_config.as_ref().unwrap();
    assert_eq!(tc.eos_token_ids, vec![2, 0]);
    assert_eq!(tc.pad_token_id, Some(0));
    assert!(tc.chat_template.as_ref().unwrap().contains("tools"));
    assert_eq!(
        f.vocab().unwrap(),
        std::fs::read(fixture("qwen3-tiny").join("tokenizer.json"))
            .unwrap()
            .as_slice()
    );
    let p = h.provenance.as_ref().unwrap();
    assert_eq!(p["quant"], "q8");
    assert_eq!(p["source"]["dtypes"][0], "bf16");
    // The source's directory name, not its absolute path.
    assert_eq!(p["source"]["name"], "qwen3-tiny");
    let text = serde_json::to_string(p).unwrap();
    assert!(!text.contains(env!("CARGO_MANIFEST_DIR")), "{text}");

    let (_d, out, _) = convert("mistral-tiny", Quant::Q8);
    let h = CmfFile::open(&out).unwrap().header().clone();
    assert_eq!(h.arch.sliding_window, Some(16));
    assert_eq!(h.arch.layer_types, vec![LayerType::SlidingAttention; 2]);
    assert_eq!(h.tokenizer_config.unwrap().bos_token_id, Some(0));

    let (_d, out, _) = convert("llama-tiny", Quant::Q8);
    let h = CmfFile::open(&out).unwrap().header().clone();
    assert_eq!(h.arch.extra["rope_scaling"]["rope_type"], "llama3");
    assert_eq!(
        h.arch.extra["rope_scaling"]["original_max_position_embeddings"],
        32
    );
    assert!(!h.arch.tie_word_embeddings);

    let (_d, out, _) = convert("qwen2-tiny", Quant::Q8);
    let f = CmfFile::open(&out).unwrap();
    assert_eq!(f.header().arch.extra["attention_bias"], true);
    assert_eq!(
        f.get("model.layers.2.self_attn.k_proj.bias").unwrap().dtype,
        Dtype::F32
    );
}

fn copy_fixture(name: &str) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, d.path().join(p.file_name().unwrap())).unwrap();
    }
    d
}

#[test]
fn bad_inputs_name_the_file_and_field() {
    let run = |dir: &Path| {
        let out = dir.join("out.cmf");
        let e = hf::convert(dir, &out, &Options::default())
            .unwrap_err()
            .to_string();
        assert!(!out.exists(), "no output on error");
        e
    };
    let d = copy_fixture("qwen2-tiny");
    let cfg = d.path().join("config.json");
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(
        &cfg,
        text.replace("\"num_attention_heads\": 4", "\"num_attention_heads\": 8"),
    )
    .unwrap();
    let e = run(d.path());
    assert!(
        e.contains("_proj.weight") && e.contains("does not match config.json"),
        "{e}"
    );
    std::fs::write(&cfg, text.replace("\"qwen2\"", "\"gpt_neox\"")).unwrap();
    let e = run(d.path());
    assert!(e.contains("config.json") && e.contains("gpt_neox"), "{e}");
    std::fs::write(&cfg, &text).unwrap();
    std::fs::remove_file(d.path().join("tokenizer.json")).unwrap();
    assert!(run(d.path()).contains("tokenizer.json"));

    let d = copy_fixture("llama-tiny");
    std::fs::remove_file(d.path().join("model-00002-of-00003.safetensors")).unwrap();
    let e = run(d.path());
    assert!(e.contains("model-00002-of-00003.safetensors"), "{e}");
    let d = copy_fixture("mistral-tiny");
    let st = d.path().join("model.safetensors");
    let bytes = std::fs::read(&st).unwrap();
    std::fs::write(&st, &bytes[..bytes.len() - 100]).unwrap();
    let e = run(d.path());
    assert!(
        e.contains("model.safetensors") && e.contains("not a valid safetensors"),
        "{e}"
    );
}

/// A MoE config whose layer plan or expert count disagrees with the checkpoint names the
/// missing per-expert tensor; MoE fields are checked like the others.
#[test]
fn moe_checkpoints_are_checked_against_their_config() {
    let run = |dir: &Path| {
        let out = dir.join("out.cmf");
        let e = hf::convert(dir, &out, &Options::default())
            .unwrap_err()
            .to_string();
        assert!(!out.exists(), "no output on error");
        e
    };
    let d = copy_fixture("qwen3-moe-tiny");
    edit_json(d.path(), "config.json", |v| {
        v["num_local_experts"] = 9.into()
    });
    let e = run(d.path());
    assert!(e.contains("model.layers.0.mlp.gate.weight"), "{e}");
    edit_json(d.path(), "config.json", |v| {
        v["num_local_experts"] = 8.into();
        v["mlp_only_layers"] = serde_json::json!([]);
    });
    let e = run(d.path());
    assert!(e.contains("model.layers.1.mlp.gate.weight"), "{e}");
    edit_json(d.path(), "config.json", |v| {
        v["num_experts_per_tok"] = 9.into()
    });
    let e = run(d.path());
    assert!(e.contains("num_experts_per_tok"), "{e}");
    let d = copy_fixture("qwen2-moe-tiny");
    edit_json(d.path(), "config.json", |v| {
        v.as_object_mut()
            .unwrap()
            .remove("shared_expert_intermediate_size");
    });
    let e = run(d.path());
    assert!(e.contains("shared_expert_intermediate_size"), "{e}");
}

/// Edits `file` of a fixture copy as JSON.
fn edit_json(dir: &Path, file: &str, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join(file);
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, serde_json::to_vec(&v).unwrap()).unwrap();
}

#[test]
fn hostile_sources_are_refused_before_writing() {
    let run = |dir: &Path| {
        let out = dir.join("out.cmf");
        let started = std::time::Instant::now();
        let e = hf::convert(dir, &out, &Options::default())
            .unwrap_err()
            .to_string();
        assert!(started.elapsed().as_secs() < 20, "{e}");
        assert!(!out.exists(), "no output on error");
        e
    };
    // A tokenizer the `tokenizers` crate panics on (a precompiled charsmap pointing past its end).
    let d = copy_fixture("qwen2-tiny");
    edit_json(
        d.path(),
        "tokenizer.json",
        |v| {
            v["normalizer"] =
                serde_json::json!({"type": "Precompiled", "precompiled_charsmap": "BAAAAP////8="})
        },
    );
    let e = run(d.path());
    assert!(e.contains("tokenizer"), "{e}");
    // A chat template that never ends.
    let d = copy_fixture("qwen2-tiny");
    edit_json(d.path(), "tokenizer_config.json", |v| {
        v["chat_template"] =
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
                .into()
    });
    let e = run(d.path());
    assert!(e.contains("template limit"), "{e}");
    // Sizes and floats.
    for (key, val) in [
        ("num_hidden_layers", serde_json::json!(1u64 << 40)),
        ("vocab_size", serde_json::json!(1u64 << 40)),
        ("rms_norm_eps", serde_json::json!(-1e-6)),
        ("rope_theta", serde_json::json!(-1.0)),
    ] {
        let d = copy_fixture("qwen2-tiny");
        edit_json(d.path(), "config.json", |v| v[key] = val.clone());
        let e = run(d.path());
        assert!(e.contains("config.json") && e.contains(key), "{key}: {e}");
    }
}
