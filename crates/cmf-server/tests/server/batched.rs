//! `--parallel N`: many requests generated at once on the batched engine, behind the same API.
//! Answers equal `cmf_llm::generate` run alone (greedy and seeded, stop strings, through the
//! paged f16 KV cache); the queue still answers 503 beyond its capacity; a client that leaves
//! frees its KV blocks; `/metrics` shows the engine.

use crate::client::{get, post, EventStream};
use crate::fixture::*;
use cmf_llm::sampling::SamplingParams;
use cmf_server::RunningServer;
use serde_json::json;
use std::net::SocketAddr;
use std::time::Duration;

const COMPLETIONS: &str = "/v1/completions";

fn start_parallel(n: usize, queue: usize, pace: Option<Duration>) -> RunningServer {
    let mut cfg = config();
    cfg.engine.parallel = n;
    cfg.engine.queue_capacity = queue;
    cfg.engine.token_pacing = pace;
    start(cfg)
}

/// The value of an unlabelled metric.
fn metric(a: SocketAddr, name: &str) -> f64 {
    let text = get(a, "/metrics").text();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("{name} missing from /metrics:\n{text}"))
}

#[test]
fn concurrent_answers_equal_alone() {
    let srv = start_parallel(4, 16, None);
    let a = srv.addr();
    let prompts = [
        "In the beginning God created",
        "And God said, Let there be light:",
        "And the earth was without form, and void; and darkness",
        "Be fruitful",
        "And the evening and the morning were the third day.",
        "In the beginning God created the heaven",
    ];
    let seeded = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        seed: 77,
        ..SamplingParams::default()
    };
    let cases: Vec<(String, serde_json::Value, String)> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let (sampling, stop): (SamplingParams, &[&str]) = match i {
                1 => (seeded, &[]),
                2 => (greedy(), &[" the"]),
                _ => (greedy(), &[]),
            };
            let n = 12 + 4 * i;
            let (want, _) = reference(&text_ids(p), &gen_config(n, sampling, stop));
            let mut body = json!({"prompt": p, "max_tokens": n, "temperature": 0.0});
            if i == 1 {
                body = json!({"prompt": p, "max_tokens": n, "temperature": 0.9, "top_p": 0.95,
                              "seed": 77});
            }
            if i == 2 {
                body["stop"] = json!([" the"]);
            }
            if i == 3 {
                body["stream"] = json!(true);
            }
            (p.to_string(), body, want)
        })
        .collect();
    let answers: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = cases
            .iter()
            .map(|(_, body, _)| {
                s.spawn(move || {
                    if body["stream"] == true {
                        let mut text = String::new();
                        for d in EventStream::open(a, COMPLETIONS, body).collect() {
                            if d != "[DONE]" {
                                let v: serde_json::Value = serde_json::from_str(&d).unwrap();
                                text.push_str(v["choices"][0]["text"].as_str().unwrap_or(""));
                            }
                        }
                        text
                    } else {
                        let r = post(a, COMPLETIONS, body);
                        assert_eq!(r.status, 200, "{}", r.text());
                        r.json()["choices"][0]["text"].as_str().unwrap().to_string()
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for ((p, _, want), got) in cases.iter().zip(&answers) {
        assert_eq!(got, want, "prompt {p:?}");
    }
    // A request with log-probabilities runs alone on the single-sequence path.
    let r = post(
        a,
        COMPLETIONS,
        &json!({"prompt": prompts[0], "max_tokens": 4, "logprobs": 2}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.json()["choices"][0]["logprobs"]["tokens"]
            .as_array()
            .unwrap()
            .len(),
        4
    );

    assert!(metric(a, "cmf_kv_blocks_total") > 0.0);
    // The gauges follow within a step of the last answer.
    assert!(wait_until(Duration::from_secs(10), || metric(
        a,
        "cmf_kv_blocks_in_use"
    ) == 0.0
        && metric(a, "cmf_requests_running") == 0.0));
    // Prompts 0 and 5 share their first tokens, but not a whole 16-token block: lookups only.
    assert!(metric(a, "cmf_prefix_cache_queries_total") >= 0.0);
    assert!(metric(a, "cmf_prefix_cache_hit_rate") >= 0.0);
    assert!(metric(a, "cmf_time_to_first_token_seconds_count") >= 7.0);
    assert!(metric(a, "cmf_inter_token_latency_seconds_count") > 20.0);
}

/// Two run, one waits in the queue, the next is refused with 503 + Retry-After; a running
/// client that hangs up frees its blocks at once and the waiting request takes its place.
#[test]
fn full_queue_and_disconnect() {
    let srv = start_parallel(2, 1, Some(Duration::from_millis(20)));
    let a = srv.addr();
    let body = json!({"prompt": "In the beginning", "max_tokens": 200, "stream": true});
    let first = EventStream::open(a, COMPLETIONS, &body);
    let mut second = EventStream::open(a, COMPLETIONS, &body);
    assert!(
        wait_until(Duration::from_secs(10), || metric(
            a,
            "cmf_requests_running"
        ) == 2.0),
        "two requests never ran together"
    );
    assert!(second.next_data().is_some());
    let held = metric(a, "cmf_kv_blocks_in_use");
    assert!(held >= 2.0, "{held} blocks for two running requests");
    let waiting = EventStream::open(a, COMPLETIONS, &body);
    assert!(wait_until(Duration::from_secs(10), || metric(
        a,
        "cmf_requests_waiting"
    ) == 1.0));
    let refused = post(a, COMPLETIONS, &body);
    assert_eq!(refused.status, 503, "{}", refused.text());
    assert_eq!(refused.header("retry-after"), Some("1"));

    drop(first);
    assert!(
        wait_until(Duration::from_secs(10), || metric(
            a,
            "cmf_requests_cancelled_total"
        ) == 1.0),
        "the hang-up was not seen"
    );
    // The waiting request runs in the freed slot.
    assert!(wait_until(Duration::from_secs(10), || metric(
        a,
        "cmf_requests_waiting"
    ) == 0.0
        && metric(a, "cmf_requests_running") == 2.0));
    drop(second);
    drop(waiting);
    assert!(
        wait_until(Duration::from_secs(10), || metric(
            a,
            "cmf_kv_blocks_in_use"
        ) == 0.0),
        "blocks still held after every client left"
    );
    assert!(metric(a, "cmf_rejections_total{status=\"503\"}") >= 1.0);
}
