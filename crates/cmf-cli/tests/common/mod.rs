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

/// Doubles a string forty times in a chat template: a terabyte, in a handful of instructions.
pub const DOUBLING_TEMPLATE: &str = "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}";

/// The checkpoint `fixtures/llm/<fixture>` copied to `dir/<name>` with its chat template replaced
/// by `template(original)`.
pub fn checkpoint_with_template(
    dir: &Path,
    fixture: &str,
    name: &str,
    template: impl FnOnce(&str) -> String,
) -> PathBuf {
    let src = root().join("fixtures/llm").join(fixture);
    let out = dir.join(name);
    std::fs::create_dir_all(&out).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), out.join(e.file_name())).unwrap();
    }
    let cfg_path = out.join("tokenizer_config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&cfg_path).unwrap()).unwrap();
    let new = template(cfg["chat_template"].as_str().unwrap());
    cfg["chat_template"] = serde_json::Value::String(new);
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    out
}
