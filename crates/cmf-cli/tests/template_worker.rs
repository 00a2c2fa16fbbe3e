//! Chat templates rendered in `cmf __template-worker` processes (`cmf_llm::chat::render_worker`):
//! the same text as in the process on every fixture case, a runaway allocation stopped at the
//! worker's memory cap with the pool still serving, a worker killed from outside replaced, and a
//! worker that does not answer killed at the deadline; the mode itself hidden from `--help` and
//! refusing a malformed stream with exit 1.

mod common;
use common::root;

use std::time::{Duration, Instant};

use cmf_llm::chat::render_worker::{RenderWorkers, WorkerSettings};
use cmf_llm::chat::template::Limits;
use cmf_llm::chat::{ChatTemplate, SpecialTokens};
use cmf_llm::LlmError;
use minijinja::Value;

fn workers() -> RenderWorkers {
    RenderWorkers::new(WorkerSettings::new(
        env!("CARGO_BIN_EXE_cmf"),
        ["__template-worker"],
    ))
}

/// Doubles a string forty times: a terabyte, in a handful of instructions.
const DOUBLING: &str = "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}";

fn render(w: &RenderWorkers, t: &ChatTemplate, content: &str) -> cmf_llm::Result<String> {
    let msgs = Value::from(vec![Value::from_iter([
        ("role", "user"),
        ("content", content),
    ])]);
    w.render(t, msgs, None, &[], true)
}

#[test]
fn workers_render_the_fixture_cases_as_the_process_does() {
    let w = workers();
    let (mut n, mut spent) = (0, Duration::ZERO);
    for name in ["llama-tiny", "mistral-tiny", "qwen2-tiny", "qwen3-tiny"] {
        let dir = root().join("fixtures/llm").join(name);
        let cfg: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("tokenizer_config.json")).unwrap())
                .unwrap();
        let s = |k: &str| cfg[k].as_str().map(str::to_string);
        let special = SpecialTokens {
            bos_token: s("bos_token"),
            eos_token: s("eos_token"),
            unk_token: s("unk_token"),
            pad_token: s("pad_token"),
        };
        let t = ChatTemplate::new(cfg["chat_template"].as_str().unwrap(), special).unwrap();
        let text = std::fs::read_to_string(dir.join("expected.json")).unwrap();
        let expected: Value = serde_json::from_str(&text).unwrap();
        let cases = expected.get_attr("chat_template_cases").unwrap();
        for key in cases.try_iter().unwrap() {
            let case = cases.get_item(&key).unwrap();
            let msgs = case.get_attr("messages").unwrap();
            let tools = case.get_attr("tools").ok().filter(|t| !t.is_undefined());
            let gen = case.get_attr("add_generation_prompt").unwrap().is_true();
            let started = Instant::now();
            let there = w.render(&t, msgs.clone(), tools.clone(), &[], gen);
            spent += started.elapsed();
            let want = case.get_attr("rendered").unwrap();
            assert_eq!(there.unwrap(), want.as_str().unwrap(), "{name}/{key}");
            // Extra variables cross too (Qwen3's `enable_thinking`).
            let kwargs = [("enable_thinking".to_string(), Value::from(false))];
            let here = t.render_with_kwargs(msgs.clone(), tools.clone(), &kwargs, gen);
            let there = w.render(&t, msgs, tools, &kwargs, gen);
            assert_eq!(
                format!("{here:?}"),
                format!("{there:?}"),
                "{name}/{key}: the worker renders differently"
            );
            n += 1;
        }
    }
    assert!(n > 0);
    eprintln!(
        "{n} renders through one worker: {:.2} ms each on average (the first starts it)",
        spent.as_secs_f64() * 1e3 / n as f64
    );
}

#[test]
fn a_runaway_allocation_ends_only_its_worker() {
    // A smaller cap than the default, to get there sooner (`cmf` itself is tested at the default
    // in hostile_cli.rs and serve_cli.rs).
    let w = RenderWorkers::new(WorkerSettings {
        memory_limit: 256 << 20,
        ..WorkerSettings::new(env!("CARGO_BIN_EXE_cmf"), ["__template-worker"])
    });
    let t = ChatTemplate::new(
        &format!("{{% if messages[0].content == 'boom' %}}{DOUBLING}{{% endif %}}{{{{ messages[0].content }}}}"),
        SpecialTokens::default(),
    )
    .unwrap()
    .with_origin("boom.cmf");
    assert_eq!(render(&w, &t, "hello").unwrap(), "hello");
    let started = Instant::now();
    let err = render(&w, &t, "boom").unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    assert!(
        matches!(err, LlmError::TemplateMemory { limit_mib: 256, .. }),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        "chat template of boom.cmf: render exceeded its memory limit (256 MiB)"
    );
    assert_eq!(render(&w, &t, "again").unwrap(), "again");
}

/// Waits until process `pid` has ended (a zombie counts: its parent has not reaped it yet).
fn wait_ended(pid: u32) {
    let started = Instant::now();
    loop {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Err(_) => return,
            Ok(stat)
                if stat
                    .rsplit(')')
                    .next()
                    .unwrap_or("")
                    .trim_start()
                    .starts_with('Z') =>
            {
                return
            }
            Ok(_) => {}
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{pid} still runs"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_worker_killed_from_outside_is_replaced() {
    let w = workers();
    let t = ChatTemplate::new("{{ messages[0].content }}!", SpecialTokens::default()).unwrap();
    assert_eq!(render(&w, &t, "one").unwrap(), "one!");
    let pids = w.idle_pids();
    assert_eq!(pids.len(), 1);
    let killed = std::process::Command::new("kill")
        .args(["-KILL", &pids[0].to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    wait_ended(pids[0]);
    assert_eq!(render(&w, &t, "two").unwrap(), "two!");
    let now = w.idle_pids();
    assert_eq!(now.len(), 1);
    assert_ne!(now, pids);
}

#[test]
fn a_silent_worker_is_killed_at_the_deadline() {
    // `sleep` reads nothing and answers nothing: the parent's deadline is all that ends it.
    let w = RenderWorkers::new(WorkerSettings::new("sleep", ["60"]));
    let limits = Limits {
        time: Duration::from_millis(100),
        ..Limits::default()
    };
    let t = ChatTemplate::with_limits("{{ 1 }}", SpecialTokens::default(), limits).unwrap();
    let started = Instant::now();
    let err = render(&w, &t, "x").unwrap_err();
    let took = started.elapsed();
    assert!(matches!(err, LlmError::TemplateLimit(_)), "{err}");
    assert!(err.to_string().contains("time limit"), "{err}");
    assert!(
        took >= Duration::from_millis(100) && took < Duration::from_secs(6),
        "{took:?}"
    );
    assert!(w.idle_pids().is_empty());

    let missing = RenderWorkers::new(WorkerSettings::new("/nonexistent/cmf", ["x"]));
    let err = render(&missing, &t, "x").unwrap_err();
    assert!(err.to_string().contains("/nonexistent/cmf"), "{err}");
}

#[test]
fn the_worker_mode_is_hidden_and_refuses_a_stream_it_cannot_read() {
    let help = common::cmf(&["--help"]);
    assert!(help.status.success());
    assert!(!common::text(&help).contains("template-worker"));
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_cmf"))
        .arg("__template-worker")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"\xff\xff\xff\xffnot a frame").unwrap();
    drop(stdin);
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", common::text(&o));
    assert!(
        common::text(&o).contains("chat template render worker"),
        "{}",
        common::text(&o)
    );
    assert!(!common::text(&o).contains("panicked"));
}
