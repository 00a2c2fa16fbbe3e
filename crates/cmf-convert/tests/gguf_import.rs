//! `cmf import-gguf`: a GGUF written by llama.cpp's own converter from the HF llama fixture
//! (scripts/make_gguf_import_fixture.py) imports back to exactly the HF tensors (names, Q/K
//! un-permutation, untied lm_head), with a tokenizer that reproduces the fixture's token ids.
//! The demo model (SmolLM2 Q4_1) is exercised when `$CMF_CACHE` holds it. A `qwen3moe` GGUF in
//! llama.cpp's layout (scripts/make_gguf_moe_fixture.py) imports to the same file contents and
//! the same logits as `cmf convert` of the Hugging Face checkpoint it was made from; so does a
//! `qwen3next` GGUF (scripts/make_gguf_qwen3next_fixture.py) of the tiny Qwen3-Next checkpoint.

use std::path::{Path, PathBuf};

use cmf_convert::{import_gguf, Options, Quant};
use cmf_format::{CmfFile, Dtype};
use safetensors::SafeTensors;
use serde_json::Value;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn gguf_fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf/llama-tiny-f32.gguf")
}

fn hf_tensors() -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let dir = repo().join("fixtures/llm/llama-tiny");
    let mut out = Vec::new();
    for i in 1..=3 {
        let bytes = std::fs::read(dir.join(format!("model-0000{i}-of-00003.safetensors"))).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        for (n, t) in st.tensors() {
            let v = t
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            out.push((n, t.shape().to_vec(), v));
        }
    }
    out
}

fn import(path: &Path, quant: Option<Quant>) -> (tempfile::TempDir, PathBuf, cmf_convert::Report) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("m.cmf");
    let opts = Options {
        quant,
        measure_error: true,
        ..Default::default()
    };
    let r = import_gguf::import(path, &out, &opts).unwrap();
    (dir, out, r)
}

#[test]
fn llama_cpp_gguf_imports_back_to_the_hf_tensors() {
    let (_d, out, report) = import(&gguf_fixture(), None);
    let f = CmfFile::open(&out).unwrap();
    assert!(f.verify().is_ok());
    let hf = hf_tensors();
    assert_eq!(f.len(), hf.len());
    for (name, shape, vals) in &hf {
        let t = f.get(name).unwrap_or_else(|_| panic!("{name} missing"));
        assert_eq!(t.shape.as_slice(), shape.as_slice(), "{name}");
        assert_eq!(t.dtype, Dtype::F32, "{name}: F32 source keeps f32");
        assert_eq!(
            &t.to_f32().unwrap(),
            vals,
            "{name}: values differ (Q/K permutation?)"
        );
    }
    assert_eq!(report.total.err_sq, 0.0);
    let a = &f.header().arch;
    assert_eq!(
        (
            a.arch_name.as_str(),
            a.num_layers,
            a.num_attention_heads,
            a.num_kv_heads,
            a.head_dim
        ),
        ("llama", 2, 4, 2, 16)
    );
    assert_eq!(
        (
            a.hidden_size,
            a.intermediate_size,
            a.vocab_size,
            a.tie_word_embeddings
        ),
        (64, 128, 512, false)
    );
    assert_eq!(a.rope_theta, 10_000.0);
    assert_eq!(
        f.header().provenance.as_ref().unwrap()["qk_unpermuted"],
        true
    );
}

/// Without the un-permutation the q/k tensors would differ: make sure the test above can fail.
#[test]
fn q_and_k_really_are_permuted_in_the_gguf() {
    let g = cmf_convert::gguf::GgufFile::open(&gguf_fixture()).unwrap();
    let t = g.gguf.tensor("blk.0.attn_q.weight").unwrap();
    let gguf_q = g.dequantize(t).unwrap();
    let hf_q = hf_tensors()
        .into_iter()
        .find(|(n, ..)| n == "model.layers.0.self_attn.q_proj.weight")
        .unwrap()
        .2;
    assert_ne!(gguf_q, hf_q);
}

#[test]
fn rebuilt_tokenizer_reproduces_the_fixture_ids() {
    let (_d, out, _) = import(&gguf_fixture(), Some(Quant::Q8));
    let f = CmfFile::open(&out).unwrap();
    let tok = tokenizers::Tokenizer::from_bytes(f.vocab().unwrap()).unwrap();
    let expected: Value = serde_json::from_slice(
        &std::fs::read(repo().join("fixtures/llm/llama-tiny/expected.json")).unwrap(),
    )
    .unwrap();
    let mut compared = 0;
    for case in expected["tokenization"]["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        // The HF fixture tokenizer applies NFC; GGUF has no normalizer and llama.cpp does not
        // normalize, so decomposed input legitimately differs (llama.cpp is the reference here).
        if text.contains('\u{301}') {
            continue;
        }
        let want: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let got = tok.encode(text, true).unwrap().get_ids().to_vec();
        assert_eq!(got, want, "{text:?}");
        compared += 1;
    }
    assert!(compared >= 14);
    let tc = f.header().tokenizer_config.clone().unwrap();
    assert_eq!(
        tc.eos_token_ids,
        vec![2, 0],
        "eos, then <|endoftext|> as llama.cpp's end-of-generation set"
    );
    assert!(tc.chat_template.unwrap().contains("<|im_start|>"));
}

fn demo_model() -> Option<PathBuf> {
    let cache = std::env::var_os("CMF_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/cmf")))?;
    let p = cache.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    p.is_file().then_some(p)
}

#[test]
fn demo_model_imports_with_default_requantization() {
    let Some(gguf) = demo_model() else {
        eprintln!("skipped: SmolLM2-135M-Instruct.Q4_1.gguf not in $CMF_CACHE (scripts/fetch-demo-model.sh)");
        return;
    };
    let (_d, out, report) = import(&gguf, None);
    let f = CmfFile::open(&out).unwrap();
    let a = &f.header().arch;
    assert_eq!(
        (
            a.num_layers,
            a.hidden_size,
            a.num_attention_heads,
            a.num_kv_heads,
            a.vocab_size
        ),
        (30, 576, 9, 3, 49152)
    );
    assert!(a.tie_word_embeddings);
    assert_eq!(f.len(), 272);
    // Measured (docs/convert.md): 0.0089 over all matrices, worst 0.0117 (the Q8_0 embedding,
    // whose per-32 scales become one scale per 576-wide row). Bounds with a little margin.
    let mut mats = cmf_convert::TensorStats::default();
    for (n, d, s) in &report.tensors {
        if *d == Dtype::Q8Row {
            assert!(
                s.relative_rms() < 0.015,
                "{n}: q8_row requantization error {}",
                s.relative_rms()
            );
            mats.add(*s);
        } else {
            assert_eq!(*d, Dtype::F32, "{n}");
            assert_eq!(s.err_sq, 0.0, "{n}: F32 norms are copied exactly");
        }
    }
    assert!(mats.relative_rms() < 0.01, "{}", mats.relative_rms());
    eprintln!(
        "demo model: q8_row requantization relative RMS over all tensors = {:.5}",
        report.total.relative_rms()
    );
    let tok = tokenizers::Tokenizer::from_bytes(f.vocab().unwrap()).unwrap();
    let ids = tok
        .encode(
            "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n",
            true,
        )
        .unwrap();
    assert_eq!(ids.get_ids()[0], 1);
    // llama.cpp's reference tokenization, when the reference-data fixture is present.
    let reference = repo().join("fixtures/llamacpp/tokenize.json");
    if reference.is_file() {
        check_llamacpp_tokenization(&tok, &reference);
    } else {
        eprintln!(
            "skipped llama.cpp id comparison: {} not present",
            reference.display()
        );
    }
}

/// fixtures/llamacpp/tokenize.json: llama-tokenize's ids for each text with special-token parsing
/// (`parse_special`, what `tokenizers` does by default) and without (`no_parse_special`, which
/// `tokenizers` does with `encode_special_tokens`).
fn check_llamacpp_tokenization(tok: &tokenizers::Tokenizer, path: &Path) {
    let doc: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let cases = doc
        .get("cases")
        .and_then(Value::as_array)
        .expect("tokenize.json: cases");
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let mut literal = tok.clone();
    literal.set_encode_special_tokens(true);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let got = tok.encode(text, true).unwrap().get_ids().to_vec();
        assert_eq!(got, ids(&case["parse_special"]), "parse_special {text:?}");
        let got = literal.encode(text, true).unwrap().get_ids().to_vec();
        assert_eq!(
            got,
            ids(&case["no_parse_special"]),
            "no_parse_special {text:?}"
        );
    }
    eprintln!(
        "{} strings tokenized as llama.cpp does, in both modes",
        cases.len()
    );
}

#[test]
fn bad_gguf_errors_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(gguf_fixture()).unwrap();
    let p = dir.path().join("cut.gguf");
    std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    let out = dir.path().join("o.cmf");
    let e = import_gguf::import(&p, &out, &Options::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("cut.gguf") && e.contains("truncated"), "{e}");
    assert!(!out.exists());
}

/// SentencePiece BPE with byte fallback: a vocab-only GGUF written by llama.cpp's converter from a
/// trained `tokenizer.model` (scripts/make_spm_tokenizer_fixture.py), and llama-tokenize's ids.
#[test]
fn sentencepiece_tokenizer_matches_llama_cpp() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf");
    let g = cmf_convert::gguf::GgufFile::open(&dir.join("spm-vocab.gguf")).unwrap();
    let rebuilt = import_gguf::tokenizer::rebuild(&g.gguf).unwrap();
    assert_eq!(
        (
            rebuilt.model.as_str(),
            rebuilt.add_bos,
            rebuilt.bos_token_id
        ),
        ("llama", true, Some(1))
    );
    let tok =
        tokenizers::Tokenizer::from_bytes(serde_json::to_vec(&rebuilt.json).unwrap()).unwrap();
    let doc: Value =
        serde_json::from_slice(&std::fs::read(dir.join("spm-tokenize.json")).unwrap()).unwrap();
    let cases = doc["cases"].as_array().unwrap();
    assert!(cases.len() >= 15);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let got = tok.encode(text, true).unwrap().get_ids().to_vec();
        assert_eq!(got, want, "{text:?}");
    }
}

/// qwen2 architecture (no permutation), q/k/v biases, tied embeddings, Q8_0 matrices: every tensor
/// is within Q8_0's rounding of the Hugging Face source (a misplaced row would be off by ~100 %).
#[test]
fn qwen2_q8_0_gguf_imports_within_q8_0_rounding() {
    let gguf =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf/qwen2-tiny-q8_0.gguf");
    let (_d, out, _) = import(&gguf, Some(Quant::F32));
    let f = CmfFile::open(&out).unwrap();
    let a = &f.header().arch;
    assert_eq!(
        (a.arch_name.as_str(), a.num_layers, a.tie_word_embeddings),
        ("qwen2", 3, true)
    );
    assert_eq!(a.rope_theta, 1e6);
    assert_eq!(a.extra["attention_bias"], true);
    assert_eq!(
        f.header().provenance.as_ref().unwrap()["qk_unpermuted"],
        false
    );
    let bytes = std::fs::read(repo().join("fixtures/llm/qwen2-tiny/model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(f.len(), st.len());
    for (name, t) in st.tensors() {
        let want: Vec<f32> = t
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let got = f.get(&name).unwrap().to_f32().unwrap();
        assert_eq!(got.len(), want.len(), "{name}");
        let err: f64 = got
            .iter()
            .zip(&want)
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum();
        let norm: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
        let rel = (err / norm).sqrt();
        if t.shape().len() == 1 {
            assert_eq!(rel, 0.0, "{name}: 1-D tensors are F32 in the GGUF");
        } else {
            assert!(rel < 0.01, "{name}: relative RMS {rel}");
        }
    }
}

/// `bytes` with the value of metadata `key` (of `old.len()` bytes, right after the key and its
/// type id) replaced by `new`.
fn patch_value(bytes: &[u8], key: &str, new: &[u8]) -> Vec<u8> {
    let mut needle = (key.len() as u64).to_le_bytes().to_vec();
    needle.extend(key.as_bytes());
    let at = bytes
        .windows(needle.len())
        .position(|w| w == needle.as_slice())
        .unwrap_or_else(|| panic!("{key} not in the fixture"))
        + needle.len()
        + 4;
    let mut out = bytes.to_vec();
    out[at..at + new.len()].copy_from_slice(new);
    out
}

#[test]
fn hostile_metadata_is_refused_before_allocating() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(gguf_fixture()).unwrap();
    let g = cmf_convert::gguf::Gguf::parse(&bytes).unwrap();
    let arch = g.architecture().unwrap().to_owned();
    for (key, value, ty) in [
        ("block_count", u32::MAX.to_le_bytes().to_vec(), "u32"),
        (
            "attention.layer_norm_rms_epsilon",
            f32::NAN.to_le_bytes().to_vec(),
            "f32",
        ),
        (
            "attention.layer_norm_rms_epsilon",
            (-1e-5f32).to_le_bytes().to_vec(),
            "f32",
        ),
        ("rope.freq_base", f32::NAN.to_le_bytes().to_vec(), "f32"),
    ] {
        let key = format!("{arch}.{key}");
        let ty_id = g.get(&key).map(|v| v.value_type().name());
        assert_eq!(
            ty_id,
            Some(if ty == "u32" { "uint32" } else { "float32" }),
            "{key}"
        );
        let p = dir.path().join("hostile.gguf");
        std::fs::write(&p, patch_value(&bytes, &key, &value)).unwrap();
        let out = dir.path().join("o.cmf");
        let start = std::time::Instant::now();
        let e = import_gguf::import(&p, &out, &Options::default())
            .unwrap_err()
            .to_string();
        assert!(start.elapsed().as_secs() < 10, "{key}: {e}");
        assert!(e.contains("hostile.gguf") && e.contains(&key), "{key}: {e}");
        assert!(!out.exists());
    }
}

#[test]
fn merges_naming_unknown_tokens_are_refused_at_import() {
    let dir = tempfile::tempdir().unwrap();
    let mut bytes = std::fs::read(gguf_fixture()).unwrap();
    let key = b"tokenizer.ggml.merges";
    let at = bytes
        .windows(key.len())
        .position(|w| w == key)
        .expect("the fixture has merges")
        + key.len();
    // key, then type id (4), element type (4), count (8), first merge's length (8) and text.
    let len_at = at + 4 + 4 + 8;
    let len = u64::from_le_bytes(bytes[len_at..len_at + 8].try_into().unwrap()) as usize;
    let last = len_at + 8 + len - 1;
    bytes[last] = 0x7f; // a raw DEL byte: never a byte-level BPE vocabulary entry
    let p = dir.path().join("merges.gguf");
    std::fs::write(&p, &bytes).unwrap();
    let out = dir.path().join("o.cmf");
    let e = import_gguf::import(&p, &out, &Options::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("merges.gguf") && e.contains("out of vocabulary"),
        "{e}"
    );
    assert!(!out.exists());
}

/// llama.cpp's stacked expert tensors are split back into the hub's per-expert tensors: the
/// imported file holds exactly the tensors (bit for bit) and MoE descriptor of the Hugging Face
/// conversion, and the model computes identical logits from both.
#[test]
fn qwen3moe_gguf_imports_like_the_hf_conversion() {
    let gguf = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/gguf/qwen3-moe-tiny-f32.gguf");
    let (_d, imported, _) = import(&gguf, None);
    let (_dir, converted) = convert_f32("qwen3-moe-tiny");

    let a = assert_same_moe_model(&imported, &converted);
    assert!(tensor_names(&a).contains(&"model.layers.2.mlp.experts.7.down_proj.weight".to_string()));
}

/// The two files hold the same qwen3_moe header, tensors (bit for bit) and logits; returns the
/// first.
fn assert_same_moe_model(imported: &Path, converted: &Path) -> cmf_format::CmfModel {
    let (a, b) = (
        cmf_format::CmfModel::open(imported).unwrap(),
        cmf_format::CmfModel::open(converted).unwrap(),
    );
    assert_eq!(a.header().arch.arch_name, "qwen3_moe");
    assert_eq!(a.header().arch.moe, b.header().arch.moe);
    assert_eq!(tensor_names(&a), tensor_names(&b));
    for n in tensor_names(&b) {
        let (x, y) = (a.tensor(&n).unwrap(), b.tensor(&n).unwrap());
        assert_eq!(
            (x.dtype, x.shape.as_slice()),
            (y.dtype, y.shape.as_slice()),
            "{n}"
        );
        assert!(x.data == y.data, "{n}: values differ");
    }
    let prompt: Vec<u32> = (3..40).collect();
    let (la, lb) = (prefill_logits(&a, &prompt), prefill_logits(&b, &prompt));
    assert_eq!(la.len(), 512);
    assert!(la.iter().zip(&lb).all(|(x, y)| x.to_bits() == y.to_bits()));
    a
}

/// llama.cpp's own converter (`convert_hf_to_gguf.py`, scripts/make_gguf_import_fixture.py) on
/// an all-sparse tiny Qwen3-MoE with `norm_topk_prob` true (the only kind its qwen3moe graph
/// runs): the import holds the tensors of `cmf convert` on the same checkpoint, bit for bit, and
/// computes the same logits.
#[test]
fn llama_cpp_converted_qwen3moe_imports_like_the_hf_conversion() {
    let gguf = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/gguf/qwen3-moe-sparse-tiny-f32.gguf");
    let (_d, imported, _) = import(&gguf, None);
    // The checkpoint the GGUF was made from: the unnormalised fixture with the one edit.
    let src = tempfile::tempdir().unwrap();
    let fixture = repo().join("fixtures/llm/qwen3-moe-unnorm-tiny");
    for e in std::fs::read_dir(&fixture).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), src.path().join(e.file_name())).unwrap();
    }
    let cfg_path = src.path().join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&cfg_path).unwrap()).unwrap();
    cfg["norm_topk_prob"] = serde_json::Value::Bool(true);
    std::fs::write(&cfg_path, serde_json::to_vec(&cfg).unwrap()).unwrap();
    let (_dir, converted) = convert_f32_dir(src.path());
    let a = assert_same_moe_model(&imported, &converted);
    assert!(a
        .header()
        .arch
        .moe
        .as_ref()
        .is_some_and(|m| m.norm_topk_prob));
}

/// `cmf convert --quant f32` of the Hugging Face fixture `name` into a scratch directory.
fn convert_f32(name: &str) -> (tempfile::TempDir, PathBuf) {
    convert_f32_dir(&repo().join("fixtures/llm").join(name))
}

/// `cmf convert --quant f32` of the checkpoint in `src` into a scratch directory.
fn convert_f32_dir(src: &Path) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("hf.cmf");
    let opts = Options {
        quant: Some(Quant::F32),
        ..Default::default()
    };
    cmf_convert::hf::convert(src, &out, &opts).unwrap();
    (dir, out)
}

fn qwen3next_gguf() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf/qwen3next-tiny-f32.gguf")
}

/// Sorted tensor names of a CMF model.
fn tensor_names(m: &cmf_format::CmfModel) -> Vec<String> {
    let mut v: Vec<String> = m.tensors().map(|t| t.name.to_string()).collect();
    v.sort();
    v
}

fn prefill_logits(m: &cmf_format::CmfModel, prompt: &[u32]) -> Vec<f32> {
    let model = cmf_llm::Model::load(m).unwrap();
    let mut st = model.new_state(128).unwrap();
    model.prefill(&mut st, prompt).unwrap().to_vec()
}

/// llama.cpp's `qwen3next` layout (scripts/make_gguf_qwen3next_fixture.py: −exp(A_log), 1 + w
/// norms, in_proj_qkvz regrouped into attn_qkv + attn_gate, squeezed conv, stacked experts) imports
/// to the tensors and header of `cmf convert` on the Hugging Face checkpoint, and the two files
/// compute the same logits bit for bit.
#[test]
fn qwen3next_gguf_imports_like_the_hf_conversion() {
    let (_d, imported, report) = import(&qwen3next_gguf(), None);
    let (_dir, converted) = convert_f32("qwen3next-tiny");
    let (a, b) = (
        cmf_format::CmfModel::open(&imported).unwrap(),
        cmf_format::CmfModel::open(&converted).unwrap(),
    );
    let (ha, hb) = (&a.header().arch, &b.header().arch);
    assert_eq!(ha.arch_name, "qwen3_next");
    assert_eq!(ha.layer_types, hb.layer_types);
    assert_eq!(ha.norm_style, hb.norm_style);
    assert_eq!(ha.moe, hb.moe);
    assert_eq!(ha.extra, hb.extra);
    assert_eq!(ha.partial_rotary_factor, hb.partial_rotary_factor);
    assert_eq!(
        (ha.hidden_size, ha.head_dim, ha.num_kv_heads, ha.vocab_size),
        (hb.hidden_size, hb.head_dim, hb.num_kv_heads, hb.vocab_size)
    );
    assert_eq!(tensor_names(&a), tensor_names(&b));
    assert!(report.notes.iter().any(|n| n.contains("qwen3next")));

    // Bit-identical except where llama.cpp's arithmetic rounded: w + 1 loses w's bits below
    // 2^-24, and −exp(A_log) may have several preimages. There the model's own use of the value,
    // f32 (1 + w) and exp(A_log), must be exactly the converter's.
    let (mut exact, mut rounded) = (0, 0);
    for n in tensor_names(&b) {
        let (x, y) = (a.tensor(&n).unwrap(), b.tensor(&n).unwrap());
        assert_eq!(
            (x.dtype, x.shape.as_slice()),
            (y.dtype, y.shape.as_slice()),
            "{n}"
        );
        if x.data == y.data {
            exact += 1;
            continue;
        }
        rounded += 1;
        let (xv, yv) = (x.to_f32().unwrap(), y.to_f32().unwrap());
        let same_use = |f: fn(f32) -> f32| xv.iter().zip(&yv).all(|(p, q)| f(*p) == f(*q));
        if n.ends_with("A_log") {
            assert!(same_use(f32::exp), "{n}: exp(A_log) differs");
        } else {
            assert!(
                n.ends_with("norm.weight") && !n.contains("linear_attn"),
                "{n}: values differ"
            );
            assert!(same_use(|w| 1.0 + w), "{n}: 1 + w differs");
        }
    }
    eprintln!("qwen3next import: {exact} tensors bit-identical, {rounded} equal in use");
    assert!(
        exact > 50 && exact > 4 * rounded,
        "{exact} exact, {rounded} rounded"
    );
    assert!(names_hold(
        &a,
        "model.layers.0.linear_attn.in_proj_qkvz.weight"
    ));
    assert!(names_hold(
        &a,
        "model.layers.3.mlp.experts.3.down_proj.weight"
    ));

    let prompt: Vec<u32> = (3..83).collect();
    let (la, lb) = (prefill_logits(&a, &prompt), prefill_logits(&b, &prompt));
    assert_eq!(la.len(), 512);
    assert!(la.iter().zip(&lb).all(|(x, y)| x.to_bits() == y.to_bits()));
}

fn names_hold(m: &cmf_format::CmfModel, name: &str) -> bool {
    m.tensor(name).is_some()
}

/// The fixture really carries llama.cpp's transformations (so the test above can fail): ssm_a is
/// negative, the norms are offset by one and attn_qkv is not the first rows of in_proj_qkvz.
#[test]
fn qwen3next_gguf_holds_llama_cpp_transformations() {
    let g = cmf_convert::gguf::GgufFile::open(&qwen3next_gguf()).unwrap();
    let t = |n: &str| g.dequantize(g.gguf.tensor(n).unwrap()).unwrap();
    assert!(t("blk.0.ssm_a").iter().all(|&a| a < 0.0));
    let st_bytes =
        std::fs::read(repo().join("fixtures/llm/qwen3next-tiny/model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&st_bytes).unwrap();
    let hf = |n: &str| -> Vec<f32> {
        st.tensor(n)
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    let norm = t("blk.1.attn_norm.weight");
    let want = hf("model.layers.1.input_layernorm.weight");
    assert!(norm.iter().zip(&want).all(|(g, w)| *g == 1.0 + *w));
    let qkv = t("blk.0.attn_qkv.weight");
    let qkvz = hf("model.layers.0.linear_attn.in_proj_qkvz.weight");
    assert_ne!(qkv[..], qkvz[..qkv.len()]);
}

#[test]
fn qwen3next_gguf_without_its_gate_half_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut bytes = std::fs::read(qwen3next_gguf()).unwrap();
    let name = b"blk.2.attn_gate.weight";
    let at = bytes
        .windows(name.len())
        .position(|w| w == name)
        .expect("the fixture has blk.2.attn_gate");
    bytes[at + 14] = b'X'; // blk.2.attn_gatX.weight
    let p = dir.path().join("nogate.gguf");
    std::fs::write(&p, &bytes).unwrap();
    let out = dir.path().join("o.cmf");
    let e = import_gguf::import(&p, &out, &Options::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("nogate.gguf") && e.contains("blk.2.attn_gate.weight is missing"),
        "{e}"
    );
    assert!(!out.exists());
}
