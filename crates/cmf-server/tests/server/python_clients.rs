//! `tests/python/openai_clients.py`: the official `openai` client and `langchain-openai` against
//! a running server (tool calls, `.parse()` with a Pydantic model, logprobs against a
//! teacher-forced pass, `n` choices, LangChain's streamed usage, `bind_tools`,
//! `with_structured_output`), one request at a time and with `--parallel 4`.
//! Prints `SKIPPED` and passes when Python or those packages are missing (`.ci/run` installs
//! them).

use crate::features::{teacher_forced, tool_model};
use crate::fixture::*;
use serde_json::json;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn openai_and_langchain_clients() {
    clients_against(1);
}

/// The same clients against the batched engine: several choices, log-probabilities, tool calls
/// and structured output inside the batch.
#[test]
fn openai_and_langchain_clients_batched() {
    clients_against(4);
}

fn clients_against(parallel: usize) {
    let python = std::env::var("CMF_PYTHON").unwrap_or_else(|_| "python3".into());
    let mut cfg = config();
    cfg.model = tool_model().clone();
    cfg.engine.kv_dtype = cmf_kernels::KvDtype::F32;
    cfg.engine.parallel = parallel;
    let srv = start(cfg);

    let prompt = "In the beginning God created the heaven";
    let ids = text_ids(prompt);
    let expected = json!({"prompt": prompt, "logprobs": teacher_forced(&ids)});
    let dir = scratch_dir(&format!("cmf-server-python-{parallel}"));
    let exp_path = dir.join("expected.json");
    std::fs::write(&exp_path, expected.to_string()).unwrap();

    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/python/openai_clients.py"
    );
    let child = Command::new(&python)
        .arg(script)
        .arg(format!("http://{}", srv.addr()))
        .arg(&exp_path)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let Ok(mut child) = child else {
        println!("SKIPPED: {python} is not available");
        return;
    };
    let t = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t.elapsed() > Duration::from_secs(300) {
            let _ = child.kill();
            panic!("the Python client test ran past 300 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    print!("{stdout}");
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("SKIPPED") || stdout.contains("all passed"),
        "{stdout}"
    );
}
