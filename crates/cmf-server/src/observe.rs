//! What the server tells its operator: a request id on every answer, one log line per request
//! (`key=value` on stderr), and counters served at `GET /metrics` in Prometheus' text format.
//!
//! A request's token counts and time to first token are known only to the inference worker, so
//! the connection layer hands each request a [`RequestRecord`] through a task-local
//! ([`with_record`]); `Engine::submit` picks it up and the worker fills it in. The line is
//! written when the answer's body has been sent (or dropped), so streamed answers are timed in
//! full.

use crate::worker::Engine;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

/// Where the per-request lines go.
#[derive(Debug, Clone, Default)]
pub enum RequestLog {
    #[default]
    Stderr,
    Off,
    /// Kept in memory (tests).
    Collect(Arc<Mutex<Vec<String>>>),
}

impl RequestLog {
    pub fn write(&self, line: String) {
        match self {
            RequestLog::Stderr => eprintln!("{line}"),
            RequestLog::Off => {}
            RequestLog::Collect(v) => v.lock().unwrap_or_else(|p| p.into_inner()).push(line),
        }
    }
}

/// Filled in by the worker for the request it runs.
#[derive(Debug, Default)]
pub struct RequestRecord {
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    /// When the first text piece was handed to the client's channel.
    pub first_text: OnceLock<Instant>,
}

tokio::task_local! {
    static RECORD: Arc<RequestRecord>;
}

/// Runs `f` (a request's handler) with `record` as the current request's record.
pub async fn with_record<F: std::future::Future>(record: Arc<RequestRecord>, f: F) -> F::Output {
    RECORD.scope(record, f).await
}

/// The record of the request being handled on this task, if any.
pub fn current_record() -> Option<Arc<RequestRecord>> {
    RECORD.try_with(Arc::clone).ok()
}

/// The client's `x-request-id` when it is sane (1–128 characters of `A-Z a-z 0-9 - _ . :`),
/// else a fresh one.
pub fn request_id(headers: &HeaderMap) -> HeaderValue {
    let sane = |v: &&HeaderValue| {
        let b = v.as_bytes();
        (1..=128).contains(&b.len())
            && b.iter()
                .all(|c| c.is_ascii_alphanumeric() || b"-_.:".contains(c))
    };
    if let Some(v) = headers.get("x-request-id").filter(sane) {
        return v.clone();
    }
    static NEXT: AtomicU64 = AtomicU64::new(0);
    static START: OnceLock<u64> = OnceLock::new();
    let start = *START.get_or_init(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64 & 0xffff_ffff)
    });
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    HeaderValue::from_str(&format!("req-{start:08x}{n:08x}")).expect("ASCII hex")
}

/// A latency histogram in Prometheus' shape: cumulative buckets rendered from per-bucket counts.
#[derive(Debug)]
pub struct Histogram {
    /// Upper bounds in seconds.
    bounds: &'static [f64],
    /// Per bucket (not cumulative); one more for +Inf.
    counts: Vec<AtomicU64>,
    sum_us: AtomicU64,
}

impl Histogram {
    /// Bounds for times to first token and between tokens: 5 ms to 30 s.
    pub const LATENCY: &'static [f64] = &[
        0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    ];

    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_us: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, d: std::time::Duration) {
        let s = d.as_secs_f64();
        let i = self
            .bounds
            .iter()
            .position(|&b| s <= b)
            .unwrap_or(self.bounds.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.sum_us
            .fetch_add(d.as_micros() as u64, Ordering::Relaxed);
    }

    pub fn count(&self) -> u64 {
        self.counts.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} histogram\n"));
        let mut acc = 0;
        for (i, c) in self.counts.iter().enumerate() {
            acc += c.load(Ordering::Relaxed);
            let le = self
                .bounds
                .get(i)
                .map_or("+Inf".to_string(), |b| b.to_string());
            out.push_str(&format!("{name}_bucket{{le=\"{le}\"}} {acc}\n"));
        }
        let sum = self.sum_us.load(Ordering::Relaxed) as f64 / 1e6;
        out.push_str(&format!("{name}_sum {sum}\n{name}_count {acc}\n"));
    }
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram::new(Histogram::LATENCY)
    }
}

/// Process-wide counters of the HTTP side.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Answered requests by status.
    by_status: Mutex<BTreeMap<u16, u64>>,
    /// Prompt tokens of the requests that reached the model (generated ones are the worker's).
    pub prompt_tokens: AtomicU64,
    pub connections_open: AtomicU64,
    pub connections_accepted: AtomicU64,
    /// Closed at once because `--max-connections` were open.
    pub connections_refused: AtomicU64,
    /// Closed for sending no complete request head within `--header-timeout`.
    pub header_timeouts: AtomicU64,
    /// Keep-alive connections closed after `--idle-timeout` without a request.
    pub idle_timeouts: AtomicU64,
    /// Requests answered 408 because the body did not arrive within `--body-timeout`.
    pub body_timeouts: AtomicU64,
    /// From a request's arrival to its first text piece.
    pub time_to_first_token: Histogram,
}

impl Metrics {
    pub fn count_status(&self, status: StatusCode) {
        let mut m = self.by_status.lock().unwrap_or_else(|p| p.into_inner());
        *m.entry(status.as_u16()).or_default() += 1;
    }

    pub fn status_count(&self, status: u16) -> u64 {
        let m = self.by_status.lock().unwrap_or_else(|p| p.into_inner());
        m.get(&status).copied().unwrap_or(0)
    }

    /// The Prometheus text exposition (format 0.0.4).
    pub fn render(&self, engine: &Engine) -> String {
        let mut out = String::new();
        let mut family = |name: &str, kind: &str, help: &str, rows: &[(String, u64)]| {
            out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
            for (labels, v) in rows {
                out.push_str(&format!("{name}{labels} {v}\n"));
            }
        };
        let one = |v: u64| vec![(String::new(), v)];
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let by_status: Vec<(u16, u64)> = {
            let m = self.by_status.lock().unwrap_or_else(|p| p.into_inner());
            m.iter().map(|(k, v)| (*k, *v)).collect()
        };
        let labelled = |keep: &dyn Fn(u16) -> bool| -> Vec<(String, u64)> {
            by_status
                .iter()
                .filter(|(s, _)| keep(*s))
                .map(|(s, v)| (format!("{{status=\"{s}\"}}"), *v))
                .collect()
        };
        family(
            "cmf_requests_total",
            "counter",
            "HTTP requests, by status (499: the client left before the answer started).",
            &labelled(&|_| true),
        );
        // Rejections: the client's fault (4xx) or no room (503); connections refused at the
        // limit are counted as 503s here too.
        // 499 (the client left before the answer started) is not a refusal.
        let mut rejected = labelled(&|s| ((400..500).contains(&s) && s != 499) || s == 503);
        let refused = load(&self.connections_refused);
        if refused > 0 {
            match rejected.iter_mut().find(|(l, _)| l.contains("\"503\"")) {
                Some(r) => r.1 += refused,
                None => rejected.push(("{status=\"503\"}".into(), refused)),
            }
        }
        family(
            "cmf_rejections_total",
            "counter",
            "Requests refused, by status (4xx, and 503 for a full queue or connection limit).",
            &rejected,
        );
        let stats = &engine.stats;
        family(
            "cmf_requests_running",
            "gauge",
            "Requests being generated (at most --parallel).",
            &one(load(&stats.running)),
        );
        family(
            "cmf_requests_waiting",
            "gauge",
            "Requests accepted and waiting for a generation slot or KV memory.",
            &one(engine.waiting() as u64 + load(&stats.waiting_for_memory)),
        );
        family(
            "cmf_kv_blocks_in_use",
            "gauge",
            "KV-cache blocks held by running requests (batched engine).",
            &one(load(&stats.kv_blocks_in_use)),
        );
        family(
            "cmf_kv_blocks_total",
            "gauge",
            "KV-cache blocks in the pool (batched engine; 0 otherwise).",
            &one(load(&stats.kv_blocks_total)),
        );
        let (queries, hits) = (load(&stats.prefix_queries), load(&stats.prefix_hits));
        family(
            "cmf_prefix_cache_queries_total",
            "counter",
            "Full prompt blocks looked up in the prefix cache.",
            &one(queries),
        );
        family(
            "cmf_prefix_cache_hits_total",
            "counter",
            "Full prompt blocks found in the prefix cache (not recomputed).",
            &one(hits),
        );
        family(
            "cmf_prompt_tokens_computed_total",
            "counter",
            "Prompt tokens the batched engine computed (the prefix cache's and those shared by \
             a request's choices are not).",
            &one(load(&stats.prompt_tokens_computed)),
        );
        out.push_str(&format!(
            "# HELP cmf_prefix_cache_hit_rate Prefix-cache hits per lookup so far.\n\
             # TYPE cmf_prefix_cache_hit_rate gauge\ncmf_prefix_cache_hit_rate {}\n",
            if queries == 0 {
                0.0
            } else {
                hits as f64 / queries as f64
            }
        ));
        let mut family = |name: &str, kind: &str, help: &str, rows: &[(String, u64)]| {
            out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
            for (labels, v) in rows {
                out.push_str(&format!("{name}{labels} {v}\n"));
            }
        };
        family(
            "cmf_requests_cancelled_total",
            "counter",
            "Generations stopped because their client left.",
            &one(load(&stats.cancelled)),
        );
        family(
            "cmf_prompt_tokens_total",
            "counter",
            "Prompt tokens of the requests that reached the model.",
            &one(load(&self.prompt_tokens)),
        );
        family(
            "cmf_generated_tokens_total",
            "counter",
            "Tokens generated, cancelled requests included.",
            &one(load(&stats.generated_tokens)),
        );
        family(
            "cmf_connections_open",
            "gauge",
            "Client connections open now.",
            &one(load(&self.connections_open)),
        );
        family(
            "cmf_connections_total",
            "counter",
            "Client connections accepted (refused ones excluded).",
            &one(load(&self.connections_accepted)),
        );
        family(
            "cmf_connections_refused_total",
            "counter",
            "Connections closed at once because --max-connections were open.",
            &one(refused),
        );
        family(
            "cmf_timeouts_total",
            "counter",
            "Connections or requests cut for being too slow, by what timed out.",
            &[
                ("{kind=\"header\"}".into(), load(&self.header_timeouts)),
                ("{kind=\"body\"}".into(), load(&self.body_timeouts)),
                ("{kind=\"idle\"}".into(), load(&self.idle_timeouts)),
            ],
        );
        self.time_to_first_token.render(
            "cmf_time_to_first_token_seconds",
            "From a request's arrival to its first text piece.",
            &mut out,
        );
        stats.inter_token_latency.render(
            "cmf_inter_token_latency_seconds",
            "Between consecutive text pieces of one answer.",
            &mut out,
        );
        out
    }
}

/// One request's line, written by [`RequestLine::finish`] once its answer is over.
pub struct RequestLine {
    pub id: HeaderValue,
    pub method: String,
    pub path: String,
    pub status: StatusCode,
    pub start: Instant,
    pub record: Arc<RequestRecord>,
    /// The client went away before the whole answer was sent.
    pub client_left: bool,
}

impl RequestLine {
    /// Counts the request and writes its line.
    pub fn finish(&self, metrics: &Metrics, log: &RequestLog) {
        let r = &self.record;
        let prompt = r.prompt_tokens.load(Ordering::Relaxed);
        let generated = r.generated_tokens.load(Ordering::Relaxed);
        metrics.count_status(self.status);
        metrics.prompt_tokens.fetch_add(prompt, Ordering::Relaxed);
        let ms = |t: Instant| format!("{:.1}", t.duration_since(self.start).as_secs_f64() * 1e3);
        let ttft = r.first_text.get().map_or("-".into(), |t| ms(*t));
        if let Some(t) = r.first_text.get() {
            metrics
                .time_to_first_token
                .observe(t.saturating_duration_since(self.start));
        }
        log.write(format!(
            "cmf serve: request id={} method={} path={} status={} prompt_tokens={prompt} \
             generated_tokens={generated} ttft_ms={ttft} total_ms={} end={}",
            String::from_utf8_lossy(self.id.as_bytes()),
            self.method,
            self.path,
            self.status.as_u16(),
            ms(Instant::now()),
            if self.client_left {
                "client_left"
            } else {
                "complete"
            },
        ));
    }
}

/// A request path for the log: at most 200 bytes, no spaces or control characters (hyper only
/// accepts visible ASCII in the target, so this is a safeguard).
pub fn loggable_path(path: &str) -> String {
    path.chars()
        .take(200)
        .map(|c| if c.is_ascii_graphic() { c } else { '?' })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_are_kept_when_sane() {
        let mut h = HeaderMap::new();
        h.insert("x-request-id", HeaderValue::from_static("abc-123_x.y:z"));
        assert_eq!(request_id(&h), "abc-123_x.y:z");
        for bad in ["", "a b", "a\"b", &"x".repeat(129)] {
            let mut h = HeaderMap::new();
            h.insert("x-request-id", HeaderValue::from_str(bad).unwrap());
            let id = request_id(&h);
            assert!(id.to_str().unwrap().starts_with("req-"), "{bad:?} → {id:?}");
        }
        assert_ne!(request_id(&HeaderMap::new()), request_id(&HeaderMap::new()));
    }
}
