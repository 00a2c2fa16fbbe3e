//! The committed corpora of the `gguf` and `safetensors_config` fuzz targets (fuzz/corpus/),
//! seeds and regression reproducers, through the same functions the targets call: none may
//! panic, and each file is done within seconds.

use std::path::PathBuf;
use std::time::{Duration, Instant};

fn run_corpus(target: &str, body: fn(&[u8])) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(
        files.len() >= 10,
        "{}: {} files",
        dir.display(),
        files.len()
    );
    for f in files {
        let bytes = std::fs::read(&f).unwrap();
        let start = Instant::now();
        body(&bytes);
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{}: {:?}",
            f.display(),
            start.elapsed()
        );
    }
}

#[test]
fn gguf_corpus() {
    run_corpus("gguf", cmf_convert::fuzzing::gguf);
}

#[test]
fn safetensors_config_corpus() {
    run_corpus(
        "safetensors_config",
        cmf_convert::fuzzing::safetensors_config,
    );
}
