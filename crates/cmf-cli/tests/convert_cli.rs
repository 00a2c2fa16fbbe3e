//! `cmf convert` / `import-gguf` / `synth` end to end: outputs verify, exit codes (0 ok, 1 bad
//! input file, 2 bad flag), no output left behind on failure.

use std::path::{Path, PathBuf};
use std::process::Command;

fn cmf(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_cmf"))
        .args(args)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), text)
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn synth_convert_and_import_write_verifiable_files() {
    let dir = tempfile::tempdir().unwrap();
    let synth = dir.path().join("tiny.cmf");
    let (code, text) = cmf(&[
        "synth",
        "--preset",
        "tiny",
        "--quant",
        "q4",
        "-o",
        s(&synth),
    ]);
    assert_eq!(code, 0, "{text}");
    assert_eq!(cmf(&["verify", s(&synth)]).0, 0);

    let conv = dir.path().join("qwen2.cmf");
    let model = repo().join("fixtures/llm/qwen2-tiny");
    let (code, text) = cmf(&[
        "convert",
        "--model",
        s(&model),
        "--quant",
        "q8",
        "-o",
        s(&conv),
        "--measure-error",
    ]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("relative RMS error"), "{text}");
    assert_eq!(cmf(&["verify", s(&conv)]).0, 0);

    let imp = dir.path().join("llama.cmf");
    let gguf = repo().join("crates/cmf-convert/tests/fixtures/gguf/llama-tiny-f32.gguf");
    let (code, text) = cmf(&["import-gguf", s(&gguf), "-o", s(&imp)]);
    assert_eq!(code, 0, "{text}");
    assert_eq!(cmf(&["verify", s(&imp)]).0, 0);
}

#[test]
fn errors_have_exit_codes_and_leave_no_output() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("o.cmf");
    let model = repo().join("fixtures/llm/qwen2-tiny");
    let (code, text) = cmf(&[
        "convert",
        "--model",
        s(&model),
        "--quant",
        "q9",
        "-o",
        s(&out),
    ]);
    assert_eq!(code, 2, "{text}");
    assert!(text.contains("--quant"));
    let (code, text) = cmf(&["synth", "--preset", "gpt5", "-o", s(&out)]);
    assert_eq!(code, 2, "{text}");
    assert!(text.contains("tiny"), "lists the presets: {text}");

    let bytes =
        std::fs::read(repo().join("crates/cmf-convert/tests/fixtures/gguf/llama-tiny-f32.gguf"))
            .unwrap();
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &bytes[..4000]).unwrap();
    let (code, text) = cmf(&["import-gguf", s(&cut), "-o", s(&out)]);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("cut.gguf") && text.contains("truncated"),
        "{text}"
    );
    assert!(std::fs::read_dir(dir.path()).unwrap().all(|e| !e
        .unwrap()
        .file_name()
        .to_string_lossy()
        .starts_with("o.cmf")));
}
