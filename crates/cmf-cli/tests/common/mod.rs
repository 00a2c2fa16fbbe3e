//! Helpers shared by the CLI's integration tests: run the built `cmf` binary and read its output.
#![allow(dead_code)] // each test binary uses a subset

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Runs the `cmf` binary built for these tests with `args`.
pub fn cmf(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cmf"))
        .args(args)
        .output()
        .expect("run cmf")
}

/// stdout followed by stderr, lossily decoded.
pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The repository root (fixtures live under it).
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// qwen3-tiny converted to f32 CMF by the CLI, in `dir`.
pub fn converted(dir: &Path) -> PathBuf {
    let out = dir.join("qwen3-tiny.cmf");
    let src = root().join("fixtures/llm/qwen3-tiny");
    let o = cmf(&[
        "convert",
        "--model",
        src.to_str().unwrap(),
        "--quant",
        "f32",
        "--output",
        out.to_str().unwrap(),
    ]);
    assert!(
        o.status.success(),
        "convert: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    out
}
