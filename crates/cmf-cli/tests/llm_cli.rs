//! `cmf run`, `cmf bench`, `cmf ppl` end to end on a fixture converted with `cmf convert`:
//! output equals the library's greedy generation, seeded sampling repeats, JSON outputs parse,
//! and bad input exits with 1 (runtime) or 2 (usage) and a message naming the fault.

mod common;
use common::{cmf, converted, root};
use std::process::{Command, Output, Stdio};

use cmf_format::CmfModel;
use cmf_llm::chat::{ChatSession, TextAssets};
use cmf_llm::generate::GenerationConfig;
use cmf_llm::Model;

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

const SYSTEM: &str = "You are a helpful assistant.";
const USER: &str = "What is the capital of France?";

#[test]
fn run_prints_the_greedy_chat_answer() {
    let tmp = tempfile::tempdir().unwrap();
    let file = converted(tmp.path());
    let o = cmf(&[
        "run",
        file.to_str().unwrap(),
        "--system",
        SYSTEM,
        "-p",
        USER,
        "-n",
        "20",
        "--kv-type",
        "f32",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("prefill") && stderr(&o).contains("time to first token"),
        "{}",
        stderr(&o)
    );

    // The same conversation through the library.
    let m = CmfModel::open(&file).unwrap();
    let model = Model::load(&m).unwrap();
    let assets = TextAssets::from_cmf(&m).unwrap();
    let mut chat = ChatSession::new(
        &model,
        &assets.tokenizer,
        &assets.template,
        Some(SYSTEM),
        256,
        cmf_kernels::KvDtype::F32,
    )
    .unwrap();
    let cfg = GenerationConfig {
        max_tokens: 20,
        eos_ids: assets.eos_ids.clone(),
        ..Default::default()
    };
    let (reply, _) = chat.send(USER, &cfg, &mut |_| {}).unwrap();
    assert_eq!(stdout(&o), format!("{reply}\n"));
    assert!(!reply.is_empty());
}

#[test]
fn seeded_sampling_repeats_and_stdin_is_a_prompt() {
    let tmp = tempfile::tempdir().unwrap();
    let file = converted(tmp.path());
    let f = file.to_str().unwrap();
    let args = [
        "run", f, "-p", USER, "-n", "16", "--temp", "0.9", "--top-k", "40", "--top-p", "0.95",
        "--seed", "7",
    ];
    let (a, b) = (cmf(&args), cmf(&args));
    assert!(a.status.success(), "{}", stderr(&a));
    assert_eq!(stdout(&a), stdout(&b));
    assert!(stderr(&a).contains("seed 7"));

    // Without --prompt and with stdin not a terminal, stdin is the prompt.
    let mut child = Command::new(env!("CARGO_BIN_EXE_cmf"))
        .args(["run", f, "-n", "8"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(USER.as_bytes())
        .unwrap();
    let piped = child.wait_with_output().unwrap();
    let direct = cmf(&["run", f, "-p", USER, "-n", "8"]);
    assert!(piped.status.success(), "{}", stderr(&piped));
    assert_eq!(stdout(&piped), stdout(&direct));
}

#[test]
fn bench_and_ppl_json() {
    let tmp = tempfile::tempdir().unwrap();
    let file = converted(tmp.path());
    let f = file.to_str().unwrap();
    let o = cmf(&["bench", f, "-p", "16", "-n", "4", "-r", "2", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let tests: Vec<&str> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["test"].as_str().unwrap())
        .collect();
    assert_eq!(tests, ["pp16", "tg4"]);
    for r in v.as_array().unwrap() {
        assert_eq!(r["samples_ts"].as_array().unwrap().len(), 2);
        assert!(r["avg_ts"].as_f64().unwrap() > 0.0);
    }

    let text = root().join("fixtures/text/kjv-excerpt.txt");
    let o = cmf(&[
        "ppl",
        f,
        "-f",
        text.to_str().unwrap(),
        "--ctx",
        "64",
        "--chunks",
        "3",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["chunks"], 3);
    assert_eq!(v["scored_tokens"], 3 * (64 - 1 - 32));
    let ppl = v["ppl"].as_f64().unwrap();
    assert!(ppl.is_finite() && ppl > 1.0, "{ppl}");
}

/// `cmf bench --parallel` on a hybrid (Qwen3-Next) file: one row per sequence count.
#[test]
fn bench_parallel_runs_a_hybrid_model() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("qwen3next-tiny.cmf");
    let src = root().join("fixtures/llm/qwen3next-tiny");
    let (f, src) = (file.to_str().unwrap(), src.to_str().unwrap());
    let o = cmf(&["convert", "--model", src, "--quant", "f32", "-o", f]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = cmf(&[
        "bench",
        f,
        "-p",
        "20",
        "-n",
        "6",
        "--parallel",
        "1,3",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let rows: Vec<(u64, u64)> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["pl"].as_u64().unwrap(), r["n_kv"].as_u64().unwrap()))
        .collect();
    assert_eq!(rows, [(1, 26), (3, 78)]);
}

#[test]
fn bad_input_exit_codes() {
    let tmp = tempfile::tempdir().unwrap();
    let file = converted(tmp.path());
    let f = file.to_str().unwrap();
    let code = |o: &Output| o.status.code().unwrap();

    let o = cmf(&["run", "/nonexistent/model.cmf", "-p", "x"]);
    assert_eq!(code(&o), 1);
    assert!(
        stderr(&o).contains("/nonexistent/model.cmf"),
        "{}",
        stderr(&o)
    );

    let o = cmf(&["run", f, "-p", "x", "--top-p", "0"]);
    assert_eq!(code(&o), 2);
    assert!(stderr(&o).contains("top_p"), "{}", stderr(&o));

    let o = cmf(&["run", f, "-p", "x", "--raw", "--system", "s"]);
    assert_eq!(code(&o), 2);

    let o = cmf(&["run", f, "-p", "x", "--kv-type", "q4"]);
    assert_eq!(code(&o), 2);
    assert!(stderr(&o).contains("--kv-type"), "{}", stderr(&o));

    let o = cmf(&["bench", f, "-r", "0"]);
    assert_eq!(code(&o), 2);

    let short = tmp.path().join("short.txt");
    std::fs::write(&short, "In the beginning").unwrap();
    let o = cmf(&["ppl", f, "-f", short.to_str().unwrap(), "--ctx", "64"]);
    assert_eq!(code(&o), 2);
    assert!(stderr(&o).contains("tokens"), "{}", stderr(&o));

    // A text file that does not exist is named.
    let o = cmf(&["ppl", f, "-f", "/nonexistent.txt"]);
    assert_eq!(code(&o), 1);
    assert!(stderr(&o).contains("/nonexistent.txt"), "{}", stderr(&o));
}
