//! Bodies of the fuzz targets in `fuzz/` (cargo-fuzz, nightly) as plain functions, so that the
//! committed corpus also runs under `cargo test` on stable (`tests/fuzz_corpus.rs`). Each takes
//! arbitrary bytes; any panic, abort or runaway allocation is a bug. Errors are expected.

use std::path::Path;

use crate::{gguf::Gguf, hf, import_gguf, Options, Quant};

/// A tokenizer that loads, for inputs that need one beside the fuzzed files.
pub const SMALL_TOKENIZER: &str = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,"model":{"type":"WordLevel","vocab":{"[UNK]":0,"hello":1},"unk_token":"[UNK]"}}"#;

/// `gguf`: the bytes as a GGUF file: parse, rebuild the tokenizer, then the whole import
/// (architecture, tokenizer and template checks, dequantization, writing).
pub fn gguf(data: &[u8]) {
    let Ok(g) = Gguf::parse(data) else {
        return;
    };
    for (_, v) in &g.metadata {
        let _ = v.summary();
    }
    let _ = import_gguf::tokenizer::rebuild(&g);
    let Ok(dir) = tempfile::tempdir() else {
        return;
    };
    let src = dir.path().join("fuzz.gguf");
    if std::fs::write(&src, data).is_err() {
        return;
    }
    let opts = Options {
        quant: Some(Quant::F32),
        ..Options::default()
    };
    if import_gguf::import(&src, &dir.path().join("out.cmf"), &opts).is_ok() {
        check_output(&dir.path().join("out.cmf"));
    }
}

/// `safetensors_config`: `config.json`, a NUL byte, then a `model.safetensors` (no NUL: the
/// whole input is the config). Converted with a small tokenizer beside them.
pub fn safetensors_config(data: &[u8]) {
    let (config, weights) = match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    if let Ok(json) = serde_json::from_slice(config) {
        let _ = hf::config::parse_config(Path::new("config.json"), &json);
    }
    let Ok(dir) = tempfile::tempdir() else {
        return;
    };
    let d = dir.path();
    let written = std::fs::write(d.join("config.json"), config)
        .and_then(|_| std::fs::write(d.join("model.safetensors"), weights))
        .and_then(|_| std::fs::write(d.join("tokenizer.json"), SMALL_TOKENIZER));
    if written.is_err() {
        return;
    }
    let opts = Options {
        quant: Some(Quant::F32),
        ..Options::default()
    };
    if hf::convert(d, &d.join("out.cmf"), &opts).is_ok() {
        check_output(&d.join("out.cmf"));
    }
}

/// What an importer wrote must open and verify.
fn check_output(path: &Path) {
    let f = cmf_format::CmfFile::open(path).expect("an imported file opens");
    assert!(f.verify().is_ok(), "an imported file verifies");
}
