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
//! The `/v1` routes answer without the prefix too (`/models`, `/chat/completions`, as
//! llama-server does). Anything else is 404 (405 for a known path with the wrong method), in
//! OpenAI's error shape; so is a path segment that is not UTF-8.

use crate::error::ApiError;
use crate::openai::{
    chat_logprobs, completion_logprobs, finish_reason, model_object, sse_event, ChoiceOut,
    Endpoint, ResponseMeta, SSE_DONE,
};
use crate::prompt::{prepare, PromptLimits};
use crate::request::{parse_chat, parse_completion, GenRequest, Limits};
use crate::tools::{Delta, ToolFormat, ToolParser};
use crate::worker::{Engine, Event, Job};
use axum::body::{Body, Bytes};
use axum::extract::rejection::PathRejection;
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
use tower_http::cors::{AllowOrigin, CorsLayer};

/// What every handler shares.
pub struct AppState {
    pub engine: Engine,
    pub api_key: Option<String>,
    pub max_body_bytes: usize,
    pub max_tokens_default: usize,
    /// Cross-origin access for browser front ends (`--cors-origin`); None: no CORS headers.
    cors: Option<CorsLayer>,
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
            cors: None,
            requests: AtomicU64::new(0),
        }
    }

    /// Allows browsers on `origins` (`*`: any) to call the API, preflight requests included.
    pub fn with_cors(mut self, origins: &[String]) -> Result<AppState, String> {
        if origins.is_empty() {
            return Ok(self);
        }
        let allow = if origins.iter().any(|o| o == "*") {
            AllowOrigin::any()
        } else {
            let list = origins
                .iter()
                .map(|o| {
                    HeaderValue::from_str(o)
                        .map_err(|_| format!("--cors-origin: invalid origin {o:?}"))
                })
                .collect::<Result<Vec<_>, _>>()?;
            AllowOrigin::list(list)
        };
        self.cors = Some(
            CorsLayer::new()
                .allow_origin(allow)
                .allow_methods([axum::http::Method::GET, axum::http::Method::POST])
                .allow_headers([header::AUTHORIZATION, header::CONTENT_TYPE]),
        );
        Ok(self)
    }
}

pub fn router(state: Arc<AppState>) -> Router {
    let mut r = Router::new().route("/health", get(health));
    for prefix in ["/v1", ""] {
        r = r
            .route(&format!("{prefix}/models"), get(list_models))
            .route(&format!("{prefix}/models/{{id}}"), get(get_model))
            .route(
                &format!("{prefix}/chat/completions"),
                post(chat_completions),
            )
            .route(&format!("{prefix}/completions"), post(completions));
    }
    let cors = state.cors.clone();
    let r = r
        .fallback(|| async { ApiError::not_found("no such endpoint") })
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed() })
        .with_state(state);
    // Outermost, so that preflight requests are answered before routing.
    match cors {
        Some(layer) => r.layer(layer),
        None => r,
    }
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
    id: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    check_api_key(&s, &headers)?;
    let Path(id) = id.map_err(|e| {
        ApiError::bad_request(format!("invalid path: {}", e.body_text())).with_code("invalid_path")
    })?;
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
        let p = prepare(
            &state.engine.assets,
            &state.engine.guidance,
            &req,
            prompt_limits,
            fresh_seed(n),
        )?;
        Ok::<_, ApiError>((req, p))
    })
    .await
    .map_err(|e| ApiError::internal(format!("request preparation failed: {e}")))??;

    let (events, rx) = mpsc::unbounded_channel();
    let shape = Shape {
        n: req.n,
        logprobs: req.logprobs.is_some(),
        tool_format: prepared.tool_format,
        parallel_tool_calls: req.parallel_tool_calls,
        echo_text: prepared.echo_text.clone(),
        prompt_ids: prepared.ids.clone(),
        state: s.clone(),
    };
    s.engine.submit(Job {
        ids: prepared.ids,
        gen: prepared.gen,
        options: prepared.options,
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
        Ok(stream_response(meta, shape, rx, req.include_usage))
    } else {
        collect_response(meta, shape, rx).await
    }
}

/// How the events of one request become its answer.
struct Shape {
    n: usize,
    logprobs: bool,
    tool_format: Option<ToolFormat>,
    parallel_tool_calls: bool,
    echo_text: Option<String>,
    prompt_ids: Vec<u32>,
    state: Arc<AppState>,
}

impl Shape {
    fn tool_parser(&self, meta: &ResponseMeta, choice: usize) -> Option<ToolParser> {
        self.tool_format.map(|f| {
            let p = ToolParser::new(
                f,
                format!("call_{}_{choice}_", &meta.id[meta.id.len() - 8..]),
            );
            if self.parallel_tool_calls {
                p
            } else {
                p.single_call()
            }
        })
    }

    fn tokenizer(&self) -> &cmf_llm::chat::Tokenizer {
        &self.state.engine.assets.tokenizer
    }

    /// A logprobs block for `entries` (None when the request did not ask). Completions count
    /// `text_offset` from `offset`.
    fn logprobs(
        &self,
        endpoint: Endpoint,
        entries: &[cmf_llm::logits::TokenLogprob],
        offset: usize,
    ) -> Option<serde_json::Value> {
        if !self.logprobs {
            return None;
        }
        Some(match endpoint {
            Endpoint::Chat => chat_logprobs(self.tokenizer(), entries),
            Endpoint::Completion => {
                let e: Vec<_> = entries.iter().map(|e| (e.id, Some(e))).collect();
                completion_logprobs(self.tokenizer(), &e, offset)
            }
        })
    }
}

/// One choice being collected.
#[derive(Default)]
struct Collecting {
    text: String,
    logprobs: Vec<cmf_llm::logits::TokenLogprob>,
    finish: Option<cmf_llm::generate::FinishReason>,
}

/// Waits for the whole answer. If the client goes away meanwhile, hyper drops this future, the
/// receiver with it, and the worker cancels the generation.
async fn collect_response(
    meta: ResponseMeta,
    shape: Shape,
    mut rx: mpsc::UnboundedReceiver<Event>,
) -> Result<Response, ApiError> {
    let mut choices: Vec<Collecting> = (0..shape.n).map(|_| Collecting::default()).collect();
    let mut prompt_lp = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Prompt(lp) => prompt_lp = lp,
            Event::Text {
                choice,
                text,
                logprobs,
            } => {
                let c = &mut choices[choice];
                c.text.push_str(&text);
                c.logprobs.extend(logprobs);
            }
            Event::ChoiceDone {
                choice,
                finish,
                logprobs,
            } => {
                choices[choice].finish = Some(finish);
                choices[choice].logprobs.extend(logprobs);
            }
            Event::Done(stats) => {
                let out: Vec<ChoiceOut> = choices
                    .into_iter()
                    .enumerate()
                    .map(|(i, c)| finish_choice(&meta, &shape, i, c, &prompt_lp))
                    .collect();
                return Ok(json_response(StatusCode::OK, &meta.complete(&out, &stats)));
            }
            Event::Failed(msg) => return Err(ApiError::internal(msg)),
        }
    }
    Err(ApiError::internal(
        "the inference worker stopped before answering",
    ))
}

/// A collected choice in its response shape: tool calls parsed out, echo prepended, logprobs.
fn finish_choice(
    meta: &ResponseMeta,
    shape: &Shape,
    i: usize,
    c: Collecting,
    prompt_lp: &[cmf_llm::logits::TokenLogprob],
) -> ChoiceOut {
    let (content, tool_calls) = match shape.tool_parser(meta, i) {
        Some(mut p) => {
            let mut deltas = p.push(&c.text);
            let (tail, calls) = p.finish();
            deltas.extend(tail);
            let content = deltas
                .into_iter()
                .filter_map(|d| match d {
                    Delta::Content(t) => Some(t),
                    _ => None,
                })
                .collect::<String>();
            (content, calls)
        }
        None => (c.text, Vec::new()),
    };
    let finish = c.finish.map(|f| finish_reason(f, !tool_calls.is_empty()));
    let echo = shape.echo_text.as_deref().unwrap_or("");
    let logprobs = match (meta.endpoint, shape.echo_text.is_some() && shape.logprobs) {
        (Endpoint::Completion, true) => {
            // The prompt's tokens first (the first one has no log-probability), then the answer's.
            let ids = &shape.prompt_ids;
            let mut e: Vec<(u32, Option<&cmf_llm::logits::TokenLogprob>)> = Vec::new();
            if let Some(&first) = ids.first() {
                e.push((first, None));
            }
            e.extend(prompt_lp.iter().map(|l| (l.id, Some(l))));
            e.extend(c.logprobs.iter().map(|l| (l.id, Some(l))));
            Some(completion_logprobs(shape.tokenizer(), &e, 0))
        }
        _ => shape.logprobs(meta.endpoint, &c.logprobs, echo.len()),
    };
    ChoiceOut {
        content: format!("{echo}{content}"),
        tool_calls,
        logprobs,
        finish,
    }
}

/// Server-sent events: the role chunk of each choice at once, a chunk per text piece (or
/// tool-call delta) as the worker sends it, then each choice's finish chunk, the usage (on the
/// last finish chunk, or in OpenAI's usage-only chunk when `include_usage` asks) and `[DONE]`.
/// A failure after the stream started is sent as an `{"error": …}` event and the stream ends
/// without `[DONE]`. When the client disconnects, hyper drops the body stream and with it the
/// receiver, which is what the worker watches.
fn stream_response(
    meta: ResponseMeta,
    shape: Shape,
    rx: mpsc::UnboundedReceiver<Event>,
    include_usage: bool,
) -> Response {
    struct S {
        meta: ResponseMeta,
        shape: Shape,
        rx: mpsc::UnboundedReceiver<Event>,
        include_usage: bool,
        parsers: Vec<Option<ToolParser>>,
        /// Per choice: whether it called a tool; log-probabilities not yet sent; bytes sent.
        called: Vec<bool>,
        held_lp: Vec<Vec<cmf_llm::logits::TokenLogprob>>,
        sent: Vec<usize>,
        /// The last choice's finish, sent with the usage once every choice is done.
        last_finish: Option<(usize, &'static str, Option<serde_json::Value>)>,
        done: bool,
    }
    impl S {
        fn deltas(&mut self, choice: usize, deltas: Vec<Delta>, out: &mut String) {
            for d in deltas {
                if !matches!(d, Delta::Content(_)) {
                    self.called[choice] = true;
                }
                let lp = std::mem::take(&mut self.held_lp[choice]);
                let block = self
                    .shape
                    .logprobs(self.meta.endpoint, &lp, self.sent[choice]);
                if let Delta::Content(t) = &d {
                    self.sent[choice] += t.len();
                }
                out.push_str(&sse_event(&self.meta.delta_chunk(choice, &d, block)));
            }
        }
    }
    let n = shape.n;
    let mut head = String::new();
    for i in 0..n {
        if let Some(c) = meta.first_chunk(i) {
            head.push_str(&sse_event(&c));
        }
    }
    if let Some(echo) = shape.echo_text.as_deref() {
        for i in 0..n {
            let d = Delta::Content(echo.to_string());
            head.push_str(&sse_event(&meta.delta_chunk(i, &d, None)));
        }
    }
    let parsers = (0..n).map(|i| shape.tool_parser(&meta, i)).collect();
    let sent = vec![shape.echo_text.as_deref().map_or(0, str::len); n];
    let body = stream::unfold(
        S {
            meta,
            shape,
            rx,
            include_usage,
            parsers,
            called: vec![false; n],
            held_lp: vec![Vec::new(); n],
            sent,
            last_finish: None,
            done: false,
        },
        |mut s| async move {
            if s.done {
                return None;
            }
            let mut out = String::new();
            match s.rx.recv().await {
                Some(Event::Prompt(_)) => {}
                Some(Event::Text {
                    choice,
                    text,
                    logprobs,
                }) => {
                    s.held_lp[choice].extend(logprobs);
                    let deltas = match s.parsers[choice].as_mut() {
                        Some(p) => p.push(&text),
                        None => vec![Delta::Content(text)],
                    };
                    s.deltas(choice, deltas, &mut out);
                }
                Some(Event::ChoiceDone {
                    choice,
                    finish,
                    logprobs,
                }) => {
                    if let Some(mut p) = s.parsers[choice].take() {
                        let (tail, calls) = p.finish();
                        s.deltas(choice, tail, &mut out);
                        s.called[choice] |= !calls.is_empty();
                    }
                    s.held_lp[choice].extend(logprobs);
                    let lp = std::mem::take(&mut s.held_lp[choice]);
                    let block = s.shape.logprobs(s.meta.endpoint, &lp, s.sent[choice]);
                    let reason = finish_reason(finish, s.called[choice]);
                    if choice + 1 == s.shape.n {
                        s.last_finish = Some((choice, reason, block));
                    } else {
                        out.push_str(&sse_event(
                            &s.meta.finish_chunk(choice, reason, block, None),
                        ));
                    }
                }
                Some(Event::Done(stats)) => {
                    s.done = true;
                    if let Some((choice, reason, block)) = s.last_finish.take() {
                        let usage = (!s.include_usage).then_some(&stats);
                        out.push_str(&sse_event(
                            &s.meta.finish_chunk(choice, reason, block, usage),
                        ));
                    }
                    if s.include_usage {
                        out.push_str(&sse_event(&s.meta.usage_chunk(&stats)));
                    }
                    out.push_str(SSE_DONE);
                }
                Some(Event::Failed(msg)) => {
                    s.done = true;
                    out = sse_event(&ApiError::internal(msg).body());
                }
                None => {
                    s.done = true;
                    out = sse_event(
                        &ApiError::internal("the inference worker stopped before finishing").body(),
                    );
                }
            }
            Some((Ok::<_, Infallible>(Bytes::from(out)), s))
        },
    );
    let body = stream::iter((!head.is_empty()).then(|| Ok(Bytes::from(head)))).chain(body);
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
