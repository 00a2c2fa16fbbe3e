//! Hostile files and input through the built `cmf` binary: FIFOs where files belong, a closed
//! stdout, oversized stdin prompts and thread counts, tokenizers and chat templates that cannot
//! run, concurrent writers to one output. Each case ends within seconds, with exit 1 (bad input)
//! and a message naming the fault, or exits quietly.

mod common;
use common::{cmf, root, text};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use cmf_format::{Arch, CmfWriter, Dtype, Header, LayerType, QuantType, TokenizerConfig};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_cmf"))
}

/// Waits for `child` at most `secs` seconds; a hang is killed and fails the test.
fn wait_bounded(mut child: Child, secs: u64, what: &str) -> Output {
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > Duration::from_secs(secs) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what}: still running after {secs} s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

fn mkfifo(path: &Path) {
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
}

/// A tiny file with the given tokenizer and chat template (weights are not loaded by the
/// commands that use it).
fn small_file(dir: &Path, name: &str, tokenizer: &[u8], template: &str) -> PathBuf {
    let arch = Arch {
        arch_name: "qwen3".into(),
        hidden_size: 64,
        intermediate_size: 128,
        num_layers: 1,
        num_attention_heads: 4,
        num_kv_heads: 2,
        head_dim: 16,
        vocab_size: 8,
        layer_types: vec![LayerType::FullAttention],
        max_position_embeddings: 64,
        ..Arch::default()
    };
    let mut h = Header::new(arch, QuantType::F32);
    h.tokenizer_config = Some(TokenizerConfig {
        chat_template: Some(template.into()),
        ..Default::default()
    });
    let mut w = CmfWriter::create(dir.join(name), h).unwrap();
    w.add_f32("model.norm.weight", Dtype::F32, &[64], &[1.0; 64])
        .unwrap();
    w.set_vocab(tokenizer);
    w.finish().unwrap()
}

fn data(name: &str) -> Vec<u8> {
    std::fs::read(root().join("crates/cmf-cli/tests/data/hostile").join(name)).unwrap()
}

/// qwen3-tiny converted to f32 by the CLI, into `out`.
fn convert_to(out: &Path) -> Child {
    let src = root().join("fixtures/llm/qwen3-tiny");
    bin()
        .args([
            "convert",
            "--model",
            src.to_str().unwrap(),
            "--quant",
            "f32",
        ])
        .args(["--output", out.to_str().unwrap()])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

#[test]
fn fifos_are_refused_without_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("model.cmf");
    mkfifo(&fifo);
    let f = fifo.to_str().unwrap();
    for args in [
        vec!["info", f],
        vec!["verify", f],
        vec!["run", f, "-p", "hi"],
    ] {
        let child = bin()
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let o = wait_bounded(child, 20, &args.join(" "));
        assert_eq!(o.status.code(), Some(1), "{args:?}: {}", text(&o));
        assert!(text(&o).contains("not a regular file"), "{}", text(&o));
    }
    // A checkpoint directory whose config.json is a FIFO.
    let src = root().join("fixtures/llm/qwen3-tiny");
    let model = dir.path().join("model");
    std::fs::create_dir(&model).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, model.join(p.file_name().unwrap())).unwrap();
    }
    std::fs::remove_file(model.join("config.json")).unwrap();
    mkfifo(&model.join("config.json"));
    let out = dir.path().join("out.cmf");
    let child = bin()
        .args(["convert", "--model", model.to_str().unwrap()])
        .args(["--output", out.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let o = wait_bounded(child, 20, "convert");
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("config.json"), "{}", text(&o));
    assert!(!out.exists());
}

#[test]
fn a_closed_stdout_ends_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let file = small_file(dir.path(), "m.cmf", &data("tokenizer-ok.json"), "{{ 1 }}");
    for _ in 0..3 {
        let mut child = bin()
            .args(["info", file.to_str().unwrap()])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take()); // `| head` that has already exited
        let o = wait_bounded(child, 20, "info");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!err.contains("panicked"), "{err}");
        assert_eq!(o.status.code(), Some(0), "{err}");
    }
}

#[test]
fn too_many_threads_are_clamped_with_a_note() {
    let o = cmf(&[
        "run",
        "/nonexistent/m.cmf",
        "--threads",
        "100000",
        "-p",
        "x",
    ]);
    assert!(
        text(&o).contains("note: --threads 100000 is more than"),
        "{}",
        text(&o)
    );
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
}

#[test]
fn verify_checks_the_tokenizer_and_the_template_and_exit_codes_follow_the_readme() {
    let dir = tempfile::tempdir().unwrap();
    let ok = small_file(dir.path(), "ok.cmf", &data("tokenizer-ok.json"), "{{ 1 }}");
    let o = cmf(&["verify", ok.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(
        text(&o).contains("tokenizer and chat template load"),
        "{}",
        text(&o)
    );

    // Hashes hold; the tokenizer panics inside the `tokenizers` crate.
    let bad = small_file(
        dir.path(),
        "tok.cmf",
        &data("tokenizer-precompiled-panic.json"),
        "{{ 1 }}",
    );
    let o = cmf(&["verify", bad.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("tokenizer"), "{}", text(&o));
    assert!(!text(&o).contains("panicked"), "{}", text(&o));
    let o = cmf(&["run", bad.to_str().unwrap(), "-p", "hi"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("tok.cmf"), "{}", text(&o));

    // A template that never ends: refused within the time limit, naming the file and limit.
    let src = String::from_utf8(data("template-nested-loops.jinja")).unwrap();
    let bad = small_file(dir.path(), "tmpl.cmf", &data("tokenizer-ok.json"), &src);
    let start = Instant::now();
    let o = cmf(&["verify", bad.to_str().unwrap()]);
    assert!(start.elapsed() < Duration::from_secs(20));
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("tmpl.cmf") && text(&o).contains("template limit"),
        "{}",
        text(&o)
    );

    // Malformed (truncated) is 1; a hash mismatch is 3.
    let bytes = std::fs::read(&ok).unwrap();
    let cut = dir.path().join("cut.cmf");
    std::fs::write(&cut, &bytes[..bytes.len() - 10]).unwrap();
    assert_eq!(
        cmf(&["verify", cut.to_str().unwrap()]).status.code(),
        Some(1)
    );
    let mut flipped = bytes.clone();
    let at = 4096 + 3; // inside the first tensor's data
    flipped[at] ^= 1;
    let bad_hash = dir.path().join("flip.cmf");
    std::fs::write(&bad_hash, &flipped).unwrap();
    assert_eq!(
        cmf(&["verify", bad_hash.to_str().unwrap()]).status.code(),
        Some(3)
    );
}

#[test]
fn a_huge_stdin_prompt_is_refused_after_reading_what_could_fit() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m.cmf");
    let o = wait_bounded(convert_to(&model), 120, "convert");
    assert!(o.status.success(), "{}", text(&o));
    let mut child = bin()
        .args(["run", model.to_str().unwrap(), "--ctx", "64", "-n", "1"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let feeder = std::thread::spawn(move || {
        let chunk = vec![b'a'; 1 << 20];
        for _ in 0..50 {
            if stdin.write_all(&chunk).is_err() {
                break; // cmf stopped reading, as it should
            }
        }
    });
    let o = wait_bounded(child, 30, "run");
    feeder.join().unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("longer than"), "{}", text(&o));
}

#[test]
fn concurrent_converts_to_one_output_leave_a_valid_file() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.cmf");
    // A stale temp file from a killed run under the old fixed name.
    std::fs::write(dir.path().join("x.cmf.tmp"), b"stale").unwrap();
    let (a, b) = (convert_to(&out), convert_to(&out));
    let (a, b) = (wait_bounded(a, 120, "a"), wait_bounded(b, 120, "b"));
    assert!(a.status.success(), "{}", text(&a));
    assert!(b.status.success(), "{}", text(&b));
    let o = cmf(&["verify", out.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp") && n != "x.cmf.tmp")
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

/// A template whose intermediate values outgrow memory (minijinja bounds neither `~` nor
/// `namespace` strings) ends its render worker only: exit 1 with the file and the cap named,
/// never a crash, whether `convert` or `run` meets it.
#[test]
fn a_template_that_exhausts_memory_is_an_error_not_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let out = |o: &Output| {
        let t = text(o);
        assert!(
            !t.contains("panicked") && !t.contains("memory allocation of"),
            "{t}"
        );
        t
    };
    // Runaway only for one conversation: the file converts, and `cmf run` meets it.
    let hf = common::checkpoint_with_template(dir.path(), "qwen3-tiny", "boom", |t| {
        format!(
            "{{% if messages[-1].content == 'boom' %}}{}{{% endif %}}{t}",
            common::DOUBLING_TEMPLATE
        )
    });
    let model = dir.path().join("boom.cmf");
    let o = cmf(&[
        "convert",
        "--model",
        hf.to_str().unwrap(),
        "--quant",
        "f32",
        "-o",
        model.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", out(&o));
    let started = Instant::now();
    let o = cmf(&["run", model.to_str().unwrap(), "-p", "boom", "-n", "2"]);
    assert!(started.elapsed() < Duration::from_secs(30));
    assert_eq!(o.status.code(), Some(1), "{}", out(&o));
    let want = format!(
        "chat template of {}: render exceeded its memory limit (1024 MiB)",
        model.display()
    );
    assert!(out(&o).contains(&want), "{}", out(&o));
    let o = cmf(&["run", model.to_str().unwrap(), "-p", "hello", "-n", "2"]);
    assert!(o.status.success(), "{}", out(&o));

    // Runaway for every conversation: refused when converting, nothing written.
    let hf = common::checkpoint_with_template(dir.path(), "qwen3-tiny", "always", |_| {
        common::DOUBLING_TEMPLATE.to_string()
    });
    let model = dir.path().join("always.cmf");
    let o = cmf(&[
        "convert",
        "--model",
        hf.to_str().unwrap(),
        "--quant",
        "f32",
        "-o",
        model.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", out(&o));
    assert!(
        out(&o).contains("render exceeded its memory limit (1024 MiB)"),
        "{}",
        out(&o)
    );
    assert!(!model.exists());
}
