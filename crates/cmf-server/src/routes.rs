//! The HTTP surface: routes, API-key check, bounded body reading, and the two ways an answer
//! leaves the server (one JSON body, or server-sent events as the worker produces text).
//!
//! | route | auth | |
//! | --- | --- | --- |
//! | `GET /health` | no | liveness, queue depth, counters |
//! | `GET /v1/models`, `GET /v1/models/{id}` | yes | the one loaded model |
//! | `POST /v1/chat/completions` | yes | messages → chat template → generation |
//! | `POST /v1/completions` | yes | raw prompt → generation |
//!
//! Anything else is 404 (405 for a known path with the wrong method), in OpenAI's error shape.

use crate::error::ApiError;
use crate::openai::{model_object, sse_event, Endpoint, ResponseMeta, SSE_DONE};
use crate::prompt::{prepare, PromptLimits};
use crate::request::{parse_chat, parse_completion, GenRequest, Limits};
use crate::worker::{Engine, Event, Job};
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures_util::{stream, StreamExt};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;

/// What every handler shares.
pub struct AppState {
    pub engine: Engine,
    pub api_key: Option<String>,
    pub max_body_bytes: usize,
    pub max_tokens_default: usize,
    requests: AtomicU64,
}

impl AppState {
    pub fn new(
        engine: Engine,
        api_key: Option<String>,
        max_body_bytes: usize,
        max_tokens_default: usize,
    ) -> AppState {
        AppState {
            engine,
            api_key,
            max_body_bytes,
            max_tokens_default,
            requests: AtomicU64::new(0),
        }
    }
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{id}", get(get_model))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .fallback(|| async { ApiError::not_found("no such endpoint") })
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed() })
        .with_state(state)
}

pub(crate) fn json_response(status: StatusCode, v: &serde_json::Value) -> Response {
    let mut r = (status, v.to_string()).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

async fn health(State(s): State<Arc<AppState>>) -> Response {
    let w = &s.engine.stats;
    let v = serde_json::json!({
        "status": "ok",
        "model": s.engine.info.id,
        "busy": w.busy.load(Ordering::Relaxed),
        "waiting": s.engine.waiting(),
        "queue_capacity": s.engine.queue_capacity(),
        "finished": w.finished.load(Ordering::Relaxed),
        "cancelled": w.cancelled.load(Ordering::Relaxed),
        "generated_tokens": w.generated_tokens.load(Ordering::Relaxed),
    });
    json_response(StatusCode::OK, &v)
}

async fn list_models(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    check_api_key(&s, &headers)?;
    let info = &s.engine.info;
    let v = serde_json::json!({
        "object": "list",
        "data": [model_object(&info.id, info.created)],
    });
    Ok(json_response(StatusCode::OK, &v))
}

async fn get_model(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    check_api_key(&s, &headers)?;
    let info = &s.engine.info;
    if id != info.id {
        return Err(ApiError::not_found(format!(
            "no model named \"{}\" (this server has \"{}\")",
            id.escape_default(),
            info.id
        ))
        .with_code("model_not_found"));
    }
    Ok(json_response(
        StatusCode::OK,
        &model_object(&info.id, info.created),
    ))
}

async fn chat_completions(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    run_generation(s, headers, body, Endpoint::Chat).await
}

async fn completions(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    run_generation(s, headers, body, Endpoint::Completion).await
}

/// Auth → body → parse + tokenize (off the async threads) → queue → answer.
async fn run_generation(
    s: Arc<AppState>,
    headers: HeaderMap,
    body: Body,
    endpoint: Endpoint,
) -> Result<Response, ApiError> {
    check_api_key(&s, &headers)?;
    let bytes = read_body(body, &headers, s.max_body_bytes).await?;
    let n = s.requests.fetch_add(1, Ordering::Relaxed);
    let state = s.clone();
    let (req, prepared) = tokio::task::spawn_blocking(move || {
        let info = &state.engine.info;
        let limits = Limits { ctx: info.ctx };
        let req: GenRequest = match endpoint {
            Endpoint::Chat => parse_chat(&bytes, limits)?,
            Endpoint::Completion => parse_completion(&bytes, limits)?,
        };
        let prompt_limits = PromptLimits {
            ctx: info.ctx,
            max_tokens_default: state.max_tokens_default,
            vocab_size: info.vocab_size,
        };
        let p = prepare(&state.engine.assets, &req, prompt_limits, fresh_seed(n))?;
        Ok::<_, ApiError>((req, p))
    })
    .await
    .map_err(|e| ApiError::internal(format!("request preparation failed: {e}")))??;

    let (events, rx) = mpsc::unbounded_channel();
    s.engine.submit(Job {
        ids: prepared.ids,
        gen: prepared.gen,
        events,
    })?;
    let meta = ResponseMeta {
        id: match endpoint {
            Endpoint::Chat => format!("chatcmpl-{}", response_id(n)),
            Endpoint::Completion => format!("cmpl-{}", response_id(n)),
        },
        created: unix_now(),
        model: s.engine.info.id.clone(),
        endpoint,
    };
    if req.stream {
        Ok(stream_response(meta, rx, req.include_usage))
    } else {
        collect_response(meta, rx).await
    }
}

/// Waits for the whole answer. If the client goes away meanwhile, hyper drops this future, the
/// receiver with it, and the worker cancels the generation.
async fn collect_response(
    meta: ResponseMeta,
    mut rx: mpsc::UnboundedReceiver<Event>,
) -> Result<Response, ApiError> {
    let mut text = String::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Text(t) => text.push_str(&t),
            Event::Done(stats) => {
                return Ok(json_response(StatusCode::OK, &meta.complete(&text, &stats)))
            }
            Event::Failed(msg) => return Err(ApiError::internal(msg)),
        }
    }
    Err(ApiError::internal(
        "the inference worker stopped before answering",
    ))
}

/// Server-sent events: the role chunk at once, a chunk per text piece as the worker sends it,
/// then the finish chunk (with usage), the optional usage-only chunk and `[DONE]`. A failure
/// after the stream started is sent as an `{"error": …}` event and the stream ends without
/// `[DONE]`. When the client disconnects, hyper drops the body stream and with it the receiver,
/// which is what the worker watches.
fn stream_response(
    meta: ResponseMeta,
    rx: mpsc::UnboundedReceiver<Event>,
    include_usage: bool,
) -> Response {
    struct S {
        meta: ResponseMeta,
        rx: mpsc::UnboundedReceiver<Event>,
        include_usage: bool,
        done: bool,
    }
    let head = meta.first_chunk().map(|c| sse_event(&c));
    let body = stream::unfold(
        S {
            meta,
            rx,
            include_usage,
            done: false,
        },
        |mut s| async move {
            if s.done {
                return None;
            }
            let out = match s.rx.recv().await {
                Some(Event::Text(t)) => sse_event(&s.meta.text_chunk(&t)),
                Some(Event::Done(stats)) => {
                    s.done = true;
                    let mut out = sse_event(&s.meta.final_chunk(&stats));
                    if s.include_usage {
                        out.push_str(&sse_event(&s.meta.usage_chunk(&stats)));
                    }
                    out.push_str(SSE_DONE);
                    out
                }
                Some(Event::Failed(msg)) => {
                    s.done = true;
                    sse_event(&ApiError::internal(msg).body())
                }
                None => {
                    s.done = true;
                    sse_event(
                        &ApiError::internal("the inference worker stopped before finishing").body(),
                    )
                }
            };
            Some((Ok::<_, Infallible>(Bytes::from(out)), s))
        },
    );
    let body = stream::iter(head.map(|h| Ok(Bytes::from(h)))).chain(body);
    let mut r = Response::new(Body::from_stream(body));
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

/// `Authorization: Bearer <key>` when the server has a key; compared in constant time.
fn check_api_key(s: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &s.api_key else {
        return Ok(());
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match given {
        Some(g) if constant_time_eq(g.as_bytes(), key.as_bytes()) => Ok(()),
        _ => Err(ApiError::unauthorized()),
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Reads the body up to `limit` bytes (413 beyond, told by Content-Length before reading
/// when the client sends one).
async fn read_body(body: Body, headers: &HeaderMap, limit: usize) -> Result<Bytes, ApiError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(ApiError::too_large(limit));
    }
    let mut data = body.into_data_stream();
    let mut buf = Vec::new();
    while let Some(chunk) = data.next().await {
        let chunk = chunk
            .map_err(|e| ApiError::bad_request(format!("reading the request body failed: {e}")))?;
        if buf.len() + chunk.len() > limit {
            return Err(ApiError::too_large(limit));
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(Bytes::from(buf))
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A seed for a request that gave none: clock and request number mixed (splitmix64 finaliser).
fn fresh_seed(n: u64) -> u64 {
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut z = t ^ n.rotate_left(32);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Unique per process and request: start time and request number.
fn response_id(n: u64) -> String {
    static START: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let start = *START.get_or_init(|| fresh_seed(u64::MAX) & 0xffff_ffff);
    format!("{start:08x}{n:08x}")
}
