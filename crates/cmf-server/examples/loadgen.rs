//! A small, bounded load generator for `cmf serve` on loopback: C clients each send streaming
//! chat requests one after another until R requests were sent in total or T seconds passed, and
//! it reports requests/s, generated tokens/s, time to first token (first non-empty content
//! delta, measured from the moment the request was written) and whole-request latency.
//!
//! ```sh
//! cargo run --release -p cmf-server --example loadgen -- --port 8080 --clients 4 --requests 16 \
//!     --max-tokens 64 --time-limit 300
//! ```
//! Only loopback addresses are accepted.

#[path = "../tests/server/client.rs"]
#[allow(dead_code)]
mod client;

use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const PROMPTS: [&str; 4] = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle works to a ten-year-old.",
    "Describe the water cycle in a few paragraphs.",
    "Write a letter to a friend about a trip to the mountains.",
];

struct Args {
    addr: SocketAddr,
    clients: usize,
    requests: usize,
    max_tokens: usize,
    time_limit: Duration,
}

fn parse_args() -> Args {
    let mut a = Args {
        addr: "127.0.0.1:8080".parse().unwrap(),
        clients: 1,
        requests: 8,
        max_tokens: 64,
        time_limit: Duration::from_secs(300),
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut it = argv.iter();
    while let Some(flag) = it.next() {
        let val = it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        let num = || -> usize {
            val.parse()
                .unwrap_or_else(|_| panic!("{flag} {val}: not a number"))
        };
        match flag.as_str() {
            "--port" => a.addr.set_port(num() as u16),
            "--addr" => a.addr = val.parse().expect("--addr: ip:port"),
            "--clients" => a.clients = num().max(1),
            "--requests" => a.requests = num().max(1),
            "--max-tokens" => a.max_tokens = num().max(1),
            "--time-limit" => a.time_limit = Duration::from_secs(num() as u64),
            _ => panic!("unknown flag {flag}"),
        }
    }
    assert!(
        a.addr.ip().is_loopback(),
        "loadgen only talks to loopback addresses"
    );
    a
}

#[derive(Debug, Clone)]
struct Sample {
    ttft: Duration,
    latency: Duration,
    tokens: u64,
}

/// One streaming request; `None` (and the status) if the server refused it.
fn one_request(addr: SocketAddr, prompt: &str, max_tokens: usize) -> Result<Sample, String> {
    let body = json!({
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens, "temperature": 0, "stream": true,
    });
    let t0 = Instant::now();
    let mut s = client::EventStream::open(addr, "/v1/chat/completions", &body);
    if s.status != 200 {
        return Err(format!("status {}", s.status));
    }
    let mut ttft = None;
    let mut tokens = 0;
    while let Some(d) = s.next_data() {
        if d == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(&d).map_err(|e| e.to_string())?;
        if let Some(err) = v.get("error") {
            return Err(err.to_string());
        }
        let content = v["choices"][0]["delta"]["content"].as_str().unwrap_or("");
        if ttft.is_none() && !content.is_empty() {
            ttft = Some(t0.elapsed());
        }
        if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
            tokens = n;
        }
    }
    Ok(Sample {
        ttft: ttft.unwrap_or_else(|| t0.elapsed()),
        latency: t0.elapsed(),
        tokens,
    })
}

fn pct(v: &mut [Duration], p: f64) -> f64 {
    v.sort();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i].as_secs_f64() * 1e3
}

fn main() {
    let a = parse_args();
    let sent = Arc::new(AtomicUsize::new(0));
    let samples = Arc::new(Mutex::new(Vec::new()));
    let errors = Arc::new(Mutex::new(Vec::new()));
    let start = Instant::now();
    let threads: Vec<_> = (0..a.clients)
        .map(|c| {
            let (sent, samples, errors) = (sent.clone(), samples.clone(), errors.clone());
            let (addr, requests, max_tokens, limit) =
                (a.addr, a.requests, a.max_tokens, a.time_limit);
            std::thread::spawn(move || loop {
                let n = sent.fetch_add(1, Ordering::SeqCst);
                if n >= requests || start.elapsed() > limit {
                    break;
                }
                match one_request(addr, PROMPTS[(n + c) % PROMPTS.len()], max_tokens) {
                    Ok(s) => samples.lock().unwrap().push(s),
                    Err(e) => errors.lock().unwrap().push(e),
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let wall = start.elapsed().as_secs_f64();
    let samples = samples.lock().unwrap().clone();
    let errors = errors.lock().unwrap().clone();
    if samples.is_empty() {
        eprintln!("no request succeeded: {errors:?}");
        std::process::exit(1);
    }
    let tokens: u64 = samples.iter().map(|s| s.tokens).sum();
    let mut ttft: Vec<Duration> = samples.iter().map(|s| s.ttft).collect();
    let mut lat: Vec<Duration> = samples.iter().map(|s| s.latency).collect();
    let report = json!({
        "clients": a.clients,
        "requests_ok": samples.len(),
        "requests_failed": errors.len(),
        "max_tokens": a.max_tokens,
        "wall_s": wall,
        "requests_per_s": samples.len() as f64 / wall,
        "generated_tokens": tokens,
        "generated_tokens_per_s": tokens as f64 / wall,
        "ttft_ms": {"min": pct(&mut ttft, 0.0), "median": pct(&mut ttft, 0.5), "p90": pct(&mut ttft, 0.9), "max": pct(&mut ttft, 1.0)},
        "latency_ms": {"min": pct(&mut lat, 0.0), "median": pct(&mut lat, 0.5), "p90": pct(&mut lat, 0.9), "max": pct(&mut lat, 1.0)},
        "errors": errors.iter().take(5).collect::<Vec<_>>(),
    });
    println!("{report}");
}
