//! `cmf serve` end to end as a process: it prints where it listens once the model is loaded,
//! answers on loopback, stops cleanly on SIGTERM, and refuses bad flags (exit 2) and bad files or
//! a taken port (exit 1) with a message that names them. The HTTP API itself is tested in
//! `crates/cmf-server/tests/server/`.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

fn cmf() -> Command {
    Command::new(env!("CARGO_BIN_EXE_cmf"))
}

fn tiny_model(dir: &Path) -> PathBuf {
    fixture_model(dir, "qwen2-tiny")
}

/// `fixtures/llm/<name>` converted to an f32 CMF file in `dir`.
fn fixture_model(dir: &Path, name: &str) -> PathBuf {
    let out = dir.join(format!("{name}.cmf"));
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/llm")
        .join(name);
    let st = cmf()
        .args(["convert", "--model"])
        .arg(&src)
        .args(["--quant", "f32", "-o"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        st.status.success(),
        "{}",
        String::from_utf8_lossy(&st.stderr)
    );
    out
}

/// Starts `cmf serve`; returns the child and the address from its "serving … on http://…" line.
fn serve(args: &[&str]) -> (Child, SocketAddr) {
    let (child, addr, _) = serve_logged(args);
    (child, addr)
}

/// [`serve`], and the lines it writes to stderr after the first.
fn serve_logged(args: &[&str]) -> (Child, SocketAddr, mpsc::Receiver<String>) {
    let mut child = cmf()
        .arg("serve")
        .args(args)
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let line = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("cmf serve prints a line once it listens");
    let addr = line
        .split("http://")
        .nth(1)
        .and_then(|s| s.split("/v1").next())
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .parse()
        .unwrap();
    (child, addr, rx)
}

fn http(addr: SocketAddr, req: &str) -> String {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(10)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

fn wait_exit(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let t = std::time::Instant::now();
    while t.elapsed() < limit {
        if let Some(st) = child.try_wait().unwrap() {
            return Some(st);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

#[test]
fn serve_answers_and_stops_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let (mut child, addr) = serve(&[model.to_str().unwrap(), "--port", "0", "--threads", "1"]);
    assert!(addr.ip().is_loopback());
    let health = http(
        addr,
        "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    );
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    assert!(health.contains("\"model\":\"qwen2-tiny\""), "{health}");
    let body = r#"{"messages":[{"role":"user","content":"hello"}],"max_tokens":4}"#;
    let chat = http(
        addr,
        &format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ),
    );
    assert!(chat.starts_with("HTTP/1.1 200"), "{chat}");
    assert!(chat.contains("\"object\":\"chat.completion\""), "{chat}");

    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let st = wait_exit(&mut child, Duration::from_secs(20));
    if st.is_none() {
        let _ = child.kill();
    }
    assert!(
        st.is_some_and(|s| s.success()),
        "exit after SIGTERM: {st:?}"
    );
}

/// The text of a greedy completion of `prompt` from the server at `addr`.
fn completion(addr: SocketAddr, prompt: &str) -> String {
    let body = format!(r#"{{"prompt":"{prompt}","max_tokens":10,"temperature":0}}"#);
    let answer = http(
        addr,
        &format!(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ),
    );
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let json = &answer[answer.find("\r\n\r\n").expect("a body") + 4..];
    let v: serde_json::Value = serde_json::from_str(json).unwrap();
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

/// The value of the `/metrics` line `name` of the server at `addr`.
fn metric(addr: SocketAddr, name: &str) -> f64 {
    let text = http(
        addr,
        "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    );
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {text}"))
}

/// A hybrid (Qwen3-Next) model served with `--parallel 3`: three concurrent greedy answers, then
/// a long prompt twice, equal those of `--parallel 1`; the second long prompt resumes from the
/// first's recurrent-state checkpoint (prefix hits in `/metrics`), and with `--state-cache 0`
/// nothing is reused.
#[test]
fn serve_parallel_runs_a_hybrid_model() {
    let dir = tempfile::tempdir().unwrap();
    let model = fixture_model(dir.path(), "qwen3next-tiny");
    let m = model.to_str().unwrap();
    let prompts = ["hello there", "the quick brown fox jumps", "one two"];
    let long =
        "and the earth was without form and void and darkness was upon the face of the deep "
            .repeat(3);
    let answers = |flags: &[&str]| -> (Vec<String>, f64) {
        let mut args = vec![m, "--port", "0", "--threads", "1"];
        args.extend(flags);
        let (mut child, addr) = serve(&args);
        let mut got = std::thread::scope(|s| {
            let hs: Vec<_> = prompts
                .iter()
                .map(|p| s.spawn(move || completion(addr, p)))
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        });
        got.push(completion(addr, &long));
        got.push(completion(addr, &long));
        let hits = metric(addr, "cmf_prefix_cache_hits_total");
        let _ = child.kill();
        let _ = child.wait();
        (got, hits)
    };
    let (alone, _) = answers(&["--parallel", "1"]);
    let (batched, hits) = answers(&["--parallel", "3"]);
    assert_eq!(batched, alone);
    assert!(batched.iter().all(|t| !t.is_empty()), "{batched:?}");
    assert!(hits > 0.0, "the repeated prompt took no prefix hit");
    let (off, hits) = answers(&["--parallel", "3", "--state-cache", "0"]);
    assert_eq!(off, alone);
    assert_eq!(hits, 0.0);
}

#[test]
fn serve_refuses_bad_flags_files_and_ports() {
    let run = |args: &[&str]| {
        let out = cmf().arg("serve").args(args).output().unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let m = model.to_str().unwrap();
    for (flag, val) in [
        ("--max-connections", "0"),
        ("--header-timeout", "0"),
        ("--body-timeout", "inf"),
        ("--idle-timeout", "NaN"),
        ("--shutdown-timeout", "1e9"),
        ("--queue", "0"),
        ("--max-tokens-default", "0"),
        ("--ctx", "1"),
        ("--state-cache", "lots"),
        ("--threads", "0"),
        ("--api-key", " "),
        ("--gpu", "sometimes"),
        ("--gpu-layers", "3-x"),
    ] {
        let (code, text) = run(&[m, "--port", "0", flag, val]);
        assert_eq!(code, 2, "{flag} {val}: {text}");
        assert!(text.contains(flag), "{flag}: {text}");
    }
    let missing = dir.path().join("missing.cmf");
    let (code, text) = run(&[missing.to_str().unwrap(), "--port", "0"]);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("missing.cmf"), "{text}");

    // `--gpu cuda` where no device answers (CI): refused at start, naming the flag.
    let gpu = cmf_gpu::facade::Gpu::open(cmf_gpu::facade::GpuMode::Auto).unwrap();
    if gpu.is_active() {
        println!("SKIPPED --gpu cuda refusal: a CUDA device is present");
    } else {
        let (code, text) = run(&[m, "--port", "0", "--gpu", "cuda"]);
        assert_eq!(code, 1, "{text}");
        assert!(text.contains("--gpu cuda"), "{text}");
    }

    // A port that is taken: the error names the address.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let (code, text) = run(&[m, "--port", &port]);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains(&format!("127.0.0.1:{port}")), "{text}");
}

fn sigterm(child: &Child) {
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
}

/// Every request gets one log line on stderr; after SIGTERM a client that sent half a request
/// holds the server no longer than `--shutdown-timeout`.
#[test]
fn serve_logs_requests_and_stops_within_its_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let (mut child, addr, log) = serve_logged(&[
        model.to_str().unwrap(),
        "--port",
        "0",
        "--threads",
        "1",
        "--header-timeout",
        "60",
        "--shutdown-timeout",
        "1",
    ]);
    let health = http(
        addr,
        "GET /health HTTP/1.1\r\nHost: x\r\nX-Request-Id: probe-1\r\nConnection: close\r\n\r\n",
    );
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    assert!(health.contains("x-request-id: probe-1"), "{health}");
    let line = log
        .recv_timeout(Duration::from_secs(10))
        .expect("a log line for the request");
    assert!(
        line.contains("id=probe-1 method=GET path=/health status=200"),
        "{line}"
    );

    let mut half = TcpStream::connect_timeout(&addr, Duration::from_secs(10)).unwrap();
    half.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let t = std::time::Instant::now();
    sigterm(&child);
    let st = wait_exit(&mut child, Duration::from_secs(10));
    if st.is_none() {
        let _ = child.kill();
    }
    let took = t.elapsed();
    assert!(
        st.is_some_and(|s| s.success()),
        "exit after SIGTERM: {st:?}"
    );
    assert!(
        took < Duration::from_secs(4),
        "took {took:?} with a 1 s deadline"
    );
    let rest: Vec<String> = log.try_iter().collect();
    assert!(
        rest.iter().any(|l| l.contains("shutdown deadline passed")),
        "{rest:#?}"
    );
}

/// A second SIGTERM exits at once, whatever the deadline.
#[test]
fn serve_exits_at_once_on_a_second_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let (mut child, addr, _log) = serve_logged(&[
        model.to_str().unwrap(),
        "--port",
        "0",
        "--threads",
        "1",
        "--shutdown-timeout",
        "600",
    ]);
    let mut half = TcpStream::connect_timeout(&addr, Duration::from_secs(10)).unwrap();
    half.write_all(b"GET /health HTTP/1.1\r\nHo").unwrap();
    std::thread::sleep(Duration::from_millis(200));
    sigterm(&child);
    std::thread::sleep(Duration::from_millis(300));
    assert!(child.try_wait().unwrap().is_none(), "still draining");
    sigterm(&child);
    let st = wait_exit(&mut child, Duration::from_secs(5));
    if st.is_none() {
        let _ = child.kill();
    }
    assert_eq!(st.and_then(|s| s.code()), Some(130), "{st:?}");
}

/// A chat template that never finishes does not keep the server from stopping: SIGTERM exits
/// within the shutdown deadline although the request is still being prepared.
#[test]
fn serve_stops_while_a_template_hangs() {
    let dir = tempfile::tempdir().unwrap();
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/llm/qwen2-tiny");
    let hf = dir.path().join("hf");
    std::fs::create_dir(&hf).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), hf.join(e.file_name())).unwrap();
    }
    let cfg_path = hf.join("tokenizer_config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&cfg_path).unwrap()).unwrap();
    let hang = "{% if messages[0]['content'] == 'hang' %}{% for a in range(100000) %}\
                {% for b in range(100000) %}{% for c in range(100000) %}{% endfor %}{% endfor %}\
                {% endfor %}{% endif %}";
    let template = format!("{hang}{}", cfg["chat_template"].as_str().unwrap());
    cfg["chat_template"] = serde_json::Value::String(template);
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let model = dir.path().join("hang.cmf");
    let st = cmf()
        .args(["convert", "--model"])
        .arg(&hf)
        .args(["--quant", "f32", "-o"])
        .arg(&model)
        .output()
        .unwrap();
    assert!(
        st.status.success(),
        "{}",
        String::from_utf8_lossy(&st.stderr)
    );

    let (mut child, addr, _log) = serve_logged(&[
        model.to_str().unwrap(),
        "--port",
        "0",
        "--threads",
        "1",
        "--shutdown-timeout",
        "1",
    ]);
    let body = r#"{"messages":[{"role":"user","content":"hang"}],"max_tokens":2}"#;
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(10)).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let health = http(
        addr,
        "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    );
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    let t = std::time::Instant::now();
    sigterm(&child);
    let st = wait_exit(&mut child, Duration::from_secs(15));
    if st.is_none() {
        let _ = child.kill();
    }
    let took = t.elapsed();
    assert!(
        st.is_some_and(|s| s.success()),
        "exit after SIGTERM: {st:?}"
    );
    assert!(
        took < Duration::from_secs(5),
        "took {took:?} with a 1 s deadline"
    );
}

/// A conversation whose template outgrows the render worker's memory gets a 400 in OpenAI's error
/// shape, naming the cap (not the file); the server goes on, the next request in a fresh worker.
#[test]
fn serve_answers_a_runaway_template_with_a_400_and_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let hf = common::checkpoint_with_template(dir.path(), "qwen2-tiny", "boom", |t| {
        format!(
            "{{% if messages[-1].content == 'boom' %}}{}{{% endif %}}{t}",
            common::DOUBLING_TEMPLATE
        )
    });
    let model = dir.path().join("boom.cmf");
    let st = cmf()
        .args(["convert", "--model"])
        .arg(&hf)
        .args(["--quant", "f32", "-o"])
        .arg(&model)
        .output()
        .unwrap();
    assert!(
        st.status.success(),
        "{}",
        String::from_utf8_lossy(&st.stderr)
    );
    let (mut child, addr) = serve(&[model.to_str().unwrap(), "--port", "0", "--threads", "1"]);
    let chat = |content: &str| {
        let body =
            format!(r#"{{"messages":[{{"role":"user","content":"{content}"}}],"max_tokens":2}}"#);
        http(
            addr,
            &format!(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            ),
        )
    };
    let r = chat("boom");
    assert!(r.starts_with("HTTP/1.1 400"), "{r}");
    assert!(r.contains("memory limit (1024 MiB)"), "{r}");
    assert!(r.contains(r#""param":"messages""#), "{r}");
    assert!(!r.contains(dir.path().to_str().unwrap()), "{r}");
    let r = chat("hello");
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    assert!(r.contains(r#""object":"chat.completion""#), "{r}");
    // Its workers killed from outside, the server starts new ones.
    let workers = children_of(child.id());
    assert!(!workers.is_empty());
    for pid in &workers {
        let st = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status()
            .unwrap();
        assert!(st.success());
    }
    let t = std::time::Instant::now();
    while children_of(child.id()).iter().any(|p| workers.contains(p)) {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the workers still run"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let r = chat("again");
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    sigterm(&child);
    let st = wait_exit(&mut child, Duration::from_secs(20));
    if st.is_none() {
        let _ = child.kill();
    }
    assert!(
        st.is_some_and(|s| s.success()),
        "exit after SIGTERM: {st:?}"
    );
}

/// Process ids whose parent is `parent` (from /proc).
fn children_of(parent: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        // "pid (comm) state ppid ...": comm may hold spaces, so split after its ')'.
        let mut rest = stat.rsplit(')').next().unwrap_or("").split_whitespace();
        let (state, ppid) = (rest.next(), rest.next().and_then(|p| p.parse::<u32>().ok()));
        if ppid == Some(parent) && state != Some("Z") {
            out.push(pid);
        }
    }
    out
}
