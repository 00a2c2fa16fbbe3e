//! Clients that hold sockets, send slowly, or leave mid-prefill: the server keeps answering,
//! closes what is too slow, refuses past its connection limit, and says what happened (request
//! ids, one log line per request, `/metrics`). Every wait is bounded.

use crate::client::{connect, get, post, request};
use crate::fixture::*;
use cmf_llm::engine::{CpuEngine, Engine};
use cmf_server::{ConnLimits, EngineBuilder, RequestLog};
use serde_json::json;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const COMPLETIONS: &str = "/v1/completions";

fn with_limits(f: impl FnOnce(&mut ConnLimits)) -> cmf_server::ServerConfig {
    let mut cfg = config();
    f(&mut cfg.limits);
    cfg
}

/// Reads until the server closes the connection (or `limit` passes); returns what came and how
/// long it took.
fn read_until_closed(s: &mut TcpStream, limit: Duration) -> (Vec<u8>, Duration) {
    let t = Instant::now();
    s.set_read_timeout(Some(limit)).unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!("connection still open after {:?}: {e}", t.elapsed()),
        }
    }
    (out, t.elapsed())
}

fn health_latency(a: SocketAddr) -> Duration {
    let t = Instant::now();
    let r = get(a, "/health");
    assert_eq!(r.status, 200);
    t.elapsed()
}

/// 500 idle sockets and 50 that send a request head a byte a second do not slow `/health` down.
#[test]
fn health_stays_fast_beside_idle_and_slow_connections() {
    // 550 client sockets and the server's 550 live in this one process.
    let fds = cmf_server::conn::raise_fd_limit(2048);
    if fds < 1300 {
        println!("SKIPPED: the open-file limit is {fds}, too low for 1100 sockets");
        return;
    }
    let srv = start(config());
    let a = srv.addr();
    let idle: Vec<TcpStream> = (0..500).map(|_| connect(a)).collect();
    let mut slow: Vec<TcpStream> = (0..50).map(|_| connect(a)).collect();
    let head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
    let open = |n: u64| {
        wait_until(Duration::from_secs(10), || {
            srv.metrics()
                .connections_open
                .load(std::sync::atomic::Ordering::Relaxed)
                >= n
        })
    };
    assert!(
        open(550),
        "connections open: {:?}",
        srv.metrics().connections_open
    );
    let mut latencies = Vec::new();
    for byte in head.iter().take(3) {
        for s in &mut slow {
            s.write_all(&[*byte]).unwrap();
        }
        let second = Instant::now() + Duration::from_secs(1);
        while Instant::now() < second {
            latencies.push(health_latency(a));
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    latencies.sort();
    let worst = *latencies.last().unwrap();
    let median = latencies[latencies.len() / 2];
    eprintln!(
        "/health beside 550 held connections: {} requests, median {median:?}, worst {worst:?}",
        latencies.len()
    );
    assert!(
        worst < Duration::from_millis(100),
        "worst {worst:?}, median {median:?}"
    );
    assert_eq!(
        srv.metrics()
            .connections_refused
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    drop(idle);
    drop(slow);
}

/// A connection that stops in the middle of its request head is closed after the header
/// timeout, and counted.
#[test]
fn half_sent_request_is_closed_after_the_header_timeout() {
    let srv = start(with_limits(|l| l.header = Duration::from_millis(400)));
    let mut s = connect(srv.addr());
    s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        .unwrap();
    let (_, took) = read_until_closed(&mut s, Duration::from_secs(5));
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(3),
        "{took:?}"
    );
    let m = get(srv.addr(), "/metrics").text();
    assert!(m.contains("cmf_timeouts_total{kind=\"header\"} 1\n"), "{m}");
}

/// A keep-alive connection with no next request is closed after the idle timeout; one that
/// never sends anything too.
#[test]
fn idle_connections_are_closed_after_the_idle_timeout() {
    let srv = start(with_limits(|l| l.idle = Duration::from_millis(400)));
    let a = srv.addr();
    let mut s = connect(a);
    s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let (got, took) = read_until_closed(&mut s, Duration::from_secs(5));
    assert!(String::from_utf8_lossy(&got).starts_with("HTTP/1.1 200"));
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(3),
        "{took:?}"
    );
    let mut silent = connect(a);
    let (got, took) = read_until_closed(&mut silent, Duration::from_secs(5));
    assert!(got.is_empty() && took < Duration::from_secs(3), "{took:?}");
    // The server counts a timeout after closing the socket: the client can see the close first.
    assert!(wait_until(Duration::from_secs(5), || srv
        .metrics()
        .idle_timeouts
        .load(std::sync::atomic::Ordering::Relaxed)
        >= 2));
}

/// A body that does not arrive within the body timeout gets 408.
#[test]
fn slow_body_gets_408() {
    let srv = start(with_limits(|l| l.body = Duration::from_millis(400)));
    let mut s = connect(srv.addr());
    s.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
          Content-Length: 100\r\n\r\n{\"prompt\":",
    )
    .unwrap();
    let (got, took) = read_until_closed(&mut s, Duration::from_secs(5));
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("request_timeout"), "{text}");
    assert!(took < Duration::from_secs(3), "{took:?}");
    let m = get(srv.addr(), "/metrics").text();
    assert!(
        m.contains("cmf_rejections_total{status=\"408\"} 1\n"),
        "{m}"
    );
}

/// Past `max_connections` a connection is answered 503 at once and closed; a slot that frees up
/// is used again.
#[test]
fn connections_past_the_limit_get_503() {
    let srv = start(with_limits(|l| l.max_connections = 3));
    let a = srv.addr();
    let held: Vec<TcpStream> = (0..3).map(|_| connect(a)).collect();
    assert!(wait_until(Duration::from_secs(5), || {
        srv.metrics()
            .connections_open
            .load(std::sync::atomic::Ordering::Relaxed)
            == 3
    }));
    let mut extra = connect(a);
    let (got, _) = read_until_closed(&mut extra, Duration::from_secs(5));
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 503"), "{text}");
    assert!(text.contains("too_many_connections"), "{text}");
    drop(held);
    assert!(wait_until(Duration::from_secs(5), || {
        srv.metrics()
            .connections_open
            .load(std::sync::atomic::Ordering::Relaxed)
            == 0
    }));
    assert_eq!(get(a, "/health").status, 200);
    let m = get(a, "/metrics").text();
    assert!(m.contains("cmf_connections_refused_total 1\n"), "{m}");
    assert!(
        m.contains("cmf_rejections_total{status=\"503\"} 1\n"),
        "{m}"
    );
}

/// Every answer has an `x-request-id` (the client's when sane), every request one log line with
/// its status and token counts, and `/metrics` counts them.
#[test]
fn request_ids_log_lines_and_metrics() {
    let lines = Arc::new(Mutex::new(Vec::new()));
    let mut cfg = config();
    cfg.request_log = RequestLog::Collect(lines.clone());
    cfg.api_key = Some("k".into());
    let srv = start(cfg);
    let a = srv.addr();
    let body = json!({"prompt": "In the beginning", "max_tokens": 3, "temperature": 0}).to_string();
    let auth = ("Authorization", "Bearer k");
    let ok = request(
        a,
        "POST",
        COMPLETIONS,
        &[auth, ("X-Request-Id", "client-7")],
        Some(body.as_bytes()),
    );
    assert_eq!(ok.status, 200);
    assert_eq!(ok.header("x-request-id"), Some("client-7"));
    let usage = ok.json()["usage"].clone();
    let denied = request(
        a,
        "POST",
        COMPLETIONS,
        &[("X-Request-Id", "bad id!")],
        Some(body.as_bytes()),
    );
    assert_eq!(denied.status, 401);
    let generated = denied.header("x-request-id").unwrap();
    assert!(generated.starts_with("req-"), "{generated}");
    assert_eq!(get(a, "/nowhere").status, 404);
    // A request is counted, then logged, once its answer has been sent, which the client can
    // see first: wait for the three lines before reading the counters.
    assert!(wait_until(Duration::from_secs(5), || lines
        .lock()
        .unwrap()
        .len()
        == 3));
    let m = get(a, "/metrics");
    assert_eq!(m.status, 200);
    assert!(m.header("content-type").unwrap().starts_with("text/plain"));
    let m = m.text();
    for want in [
        "cmf_requests_total{status=\"200\"} 1\n",
        "cmf_requests_total{status=\"401\"} 1\n",
        "cmf_rejections_total{status=\"401\"} 1\n",
        "cmf_rejections_total{status=\"404\"} 1\n",
        "cmf_requests_running 0\n",
        "cmf_requests_waiting 0\n",
        &format!("cmf_prompt_tokens_total {}\n", usage["prompt_tokens"]),
        &format!(
            "cmf_generated_tokens_total {}\n",
            usage["completion_tokens"]
        ),
    ] {
        assert!(m.contains(want), "{want:?} not in\n{m}");
    }
    // The /metrics request is logged once its body has been sent.
    assert!(wait_until(Duration::from_secs(5), || lines
        .lock()
        .unwrap()
        .len()
        == 4));
    let lines = lines.lock().unwrap().clone();
    let first = &lines[0];
    for want in [
        "id=client-7".to_string(),
        "method=POST".into(),
        "path=/v1/completions".into(),
        "status=200".into(),
        format!("prompt_tokens={}", usage["prompt_tokens"]),
        format!("generated_tokens={}", usage["completion_tokens"]),
        "ttft_ms=".into(),
        "total_ms=".into(),
        "end=complete".into(),
    ] {
        assert!(first.contains(&want), "{want:?} not in {first:?}");
    }
    assert!(!first.contains("ttft_ms=-"), "{first}");
    assert!(lines[1].contains(&format!("id={generated}")) && lines[1].contains("status=401"));
    assert!(lines[1].contains("ttft_ms=-"), "{}", lines[1]);
    assert!(
        lines[2].contains("path=/nowhere status=404"),
        "{}",
        lines[2]
    );
}

/// A CPU engine whose prefill costs `per_token` per token and goes in pieces of 16, like a big
/// model's long prompt.
struct SlowPrefill<'m, 'a> {
    cpu: CpuEngine<'m, 'a>,
    per_token: Duration,
}

impl Engine for SlowPrefill<'_, '_> {
    fn prefill(&mut self, tokens: &[u32]) -> cmf_llm::Result<&[f32]> {
        std::thread::sleep(self.per_token * tokens.len() as u32);
        self.cpu.prefill(tokens)
    }
    fn prefill_piece(&self) -> usize {
        16
    }
    fn len(&self) -> usize {
        self.cpu.len()
    }
    fn limit(&self) -> usize {
        self.cpu.limit()
    }
    fn truncate(&mut self, len: usize) {
        self.cpu.truncate(len)
    }
}

/// A long prompt whose client leaves during the prefill frees the worker within a prefill
/// piece: the next request is answered long before the abandoned prefill would have ended.
#[test]
fn disconnect_during_a_long_prefill_frees_the_worker() {
    let per_token = Duration::from_millis(10);
    let mut cfg = config();
    cfg.engine.build_engine = Some(EngineBuilder::new(move |model, ctx, kv| {
        Ok(Box::new(SlowPrefill {
            cpu: CpuEngine::new(model, ctx, kv).unwrap(),
            per_token,
        }))
    }));
    let lines = Arc::new(Mutex::new(Vec::new()));
    cfg.request_log = RequestLog::Collect(lines.clone());
    let srv = start(cfg);
    let a = srv.addr();
    let long = "In the beginning was the word, and the word was long. ".repeat(8);
    let n = text_ids(&long).len();
    assert!((150..250).contains(&n), "{n} prompt tokens");
    let full_prefill = per_token * n as u32;
    let body = json!({"prompt": long, "max_tokens": 1}).to_string();
    let mut s = connect(a);
    crate::client::send(&mut s, "POST", COMPLETIONS, &[], Some(body.as_bytes()));
    assert!(wait_until(Duration::from_secs(10), || srv
        .stats()
        .busy
        .load(std::sync::atomic::Ordering::Relaxed)));
    std::thread::sleep(Duration::from_millis(100));
    drop(s);
    let t = Instant::now();
    let r = post(a, COMPLETIONS, &json!({"prompt": "In", "max_tokens": 2}));
    let took = t.elapsed();
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        took < full_prefill / 3,
        "the next request took {took:?}; the abandoned prefill alone takes {full_prefill:?}"
    );
    assert_eq!(
        srv.stats()
            .cancelled
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    // The abandoned request has its line too, and it is no rejection.
    let left = lines.lock().unwrap()[0].clone();
    assert!(
        left.contains("status=499") && left.contains("end=client_left"),
        "{left}"
    );
    let m = get(a, "/metrics").text();
    assert!(m.contains("cmf_requests_total{status=\"499\"} 1\n"), "{m}");
    assert!(!m.contains("cmf_rejections_total{status=\"499\"}"), "{m}");
}

/// `generate_cancellable` asks between the prefill's pieces: cancelled at the third check, two
/// pieces are cached and nothing is generated; never cancelled, the pieces give the answer of one
/// whole prefill.
#[test]
fn generate_cancellable_checks_between_prefill_pieces() {
    use cmf_format::CmfModel;
    use cmf_llm::chat::TextAssets;
    use cmf_llm::generate::{generate_cancellable, FinishReason};
    use std::cell::Cell;
    let file = CmfModel::open(model_path()).unwrap();
    let model = cmf_llm::Model::load(&file).unwrap();
    let assets = TextAssets::from_cmf(&file).unwrap();
    let ids = text_ids(&"In the beginning was the word. ".repeat(8));
    assert!(ids.len() > 48, "{} ids", ids.len());
    let cfg = gen_config(8, greedy(), &[]);
    let run = |cancel_at: usize| {
        let calls = Cell::new(0usize);
        let mut engine = SlowPrefill {
            cpu: CpuEngine::new(&model, 256, cmf_kernels::KvDtype::F16).unwrap(),
            per_token: Duration::ZERO,
        };
        let mut text = String::new();
        let stats = generate_cancellable(
            &mut engine,
            &assets.tokenizer,
            &ids,
            &mut Vec::new(),
            &cfg,
            &mut |t| text.push_str(t),
            &|| {
                calls.set(calls.get() + 1);
                calls.get() == cancel_at
            },
        )
        .unwrap();
        (stats, engine.len(), text)
    };
    let (stats, cached, text) = run(3);
    assert_eq!(stats.finish, FinishReason::Cancelled);
    assert_eq!((stats.generated_tokens, cached), (0, 32));
    assert!(text.is_empty());
    let (stats, _, text) = run(0);
    assert_ne!(stats.finish, FinishReason::Cancelled);
    let (want, _) = reference(&ids, &cfg);
    assert_eq!(text, want);
}
