//! The committed corpora of the `gguf` and `safetensors_config` fuzz targets (fuzz/corpus/),
//! seeds and regression reproducers, through the same functions the targets call: none may
//! panic, and each file is done within seconds.

use cmf_test_support::fuzz::run_corpus;

#[test]
fn gguf_corpus() {
    run_corpus("gguf", 10, cmf_convert::fuzzing::gguf);
}

#[test]
fn safetensors_config_corpus() {
    run_corpus(
        "safetensors_config",
        10,
        cmf_convert::fuzzing::safetensors_config,
    );
}
