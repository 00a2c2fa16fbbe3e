//! Starting and stopping: load the model (the port opens only once it is ready), bind, serve on a
//! small tokio runtime ([`crate::conn`]: limits and timeouts per connection), shut down
//! gracefully (in-flight answers finish within the shutdown deadline; the queue drains).

use crate::conn::{ConnLimits, Shared, Stopped};
use crate::observe::{Metrics, RequestLog};
use crate::routes::{router, AppState};
use crate::worker::{Engine, EngineOptions, StartError, WorkerStats};
use axum::http::{header, HeaderValue};
use axum::response::IntoResponse;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;
use tokio::sync::oneshot;

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub model: PathBuf,
    pub host: String,
    /// 0: an ephemeral port (see [`RunningServer::addr`]).
    pub port: u16,
    pub engine: EngineOptions,
    /// `max_tokens` for requests that give none (capped by what the context leaves).
    pub max_tokens_default: usize,
    /// Required as `Authorization: Bearer <key>` on `/v1/*` when set.
    pub api_key: Option<String>,
    /// Larger request bodies get 413.
    pub max_body_bytes: usize,
    /// Threads of the HTTP runtime (inference has its own thread and the kernels' pool).
    pub http_threads: usize,
    /// Connection limit, timeouts and the shutdown deadline.
    pub limits: ConnLimits,
    /// Where the one line per request goes.
    pub request_log: RequestLog,
    /// Origins browsers may call the API from (`*`: any); empty: no CORS headers.
    pub cors_origins: Vec<String>,
}

impl ServerConfig {
    pub fn new(model: impl Into<PathBuf>) -> ServerConfig {
        ServerConfig {
            model: model.into(),
            host: "127.0.0.1".into(),
            port: 8080,
            engine: EngineOptions::default(),
            max_tokens_default: 512,
            api_key: None,
            max_body_bytes: 1 << 20,
            http_threads: 2,
            limits: ConnLimits::default(),
            request_log: RequestLog::default(),
            cors_origins: Vec::new(),
        }
    }
}

fn runtime(threads: usize) -> Result<tokio::runtime::Runtime, StartError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .max_blocking_threads(8)
        .thread_name("cmf-http")
        .enable_all()
        .build()
        .map_err(|e| StartError::Other(format!("cannot start the HTTP runtime: {e}")))
}

fn state(cfg: &ServerConfig) -> Result<Arc<AppState>, StartError> {
    let engine = Engine::start(&cfg.model, cfg.engine.clone())?;
    let state = AppState::new(
        engine,
        cfg.api_key.clone(),
        cfg.max_body_bytes,
        cfg.max_tokens_default,
    )
    .with_cors(&cfg.cors_origins)
    .map_err(StartError::Other)?;
    Ok(Arc::new(state))
}

async fn bind(cfg: &ServerConfig) -> Result<tokio::net::TcpListener, StartError> {
    let addr = format!("{}:{}", cfg.host, cfg.port);
    tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|e| StartError::Other(format!("cannot listen on {addr}: {e}")))
}

/// The routes plus `GET /metrics`, and what every connection shares.
fn shared(cfg: &ServerConfig, state: Arc<AppState>, metrics: Arc<Metrics>) -> Arc<Shared> {
    let m = metrics.clone();
    let st = state.clone();
    let app = router(state).route(
        "/metrics",
        axum::routing::get(move || async move {
            let mut r = m.render(&st.engine).into_response();
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            r
        }),
    );
    Arc::new(Shared {
        app,
        limits: cfg.limits.clone(),
        metrics,
        log: cfg.request_log.clone(),
    })
}

fn check_limits(l: &ConnLimits) -> Result<(), StartError> {
    if l.max_connections == 0 {
        return Err(StartError::Other(
            "the connection limit must be at least 1".into(),
        ));
    }
    Ok(())
}

/// Loads the model, listens, calls `on_listening` with the address, and serves until Ctrl-C or
/// SIGTERM; then answers in flight get `limits.shutdown` to finish, and a second Ctrl-C or
/// SIGTERM exits at once. For `cmf serve`.
pub fn run_until_ctrl_c(
    cfg: ServerConfig,
    on_listening: impl FnOnce(SocketAddr, &crate::worker::ModelInfo),
) -> Result<(), StartError> {
    let mut cfg = cfg;
    check_limits(&cfg.limits)?;
    cfg.limits.max_connections = crate::conn::connection_cap(cfg.limits.max_connections);
    let rt = runtime(cfg.http_threads)?;
    let state = state(&cfg)?;
    let metrics = Arc::new(Metrics::default());
    let stopped = rt.block_on(async {
        let listener = bind(&cfg).await?;
        let addr = listener
            .local_addr()
            .map_err(|e| StartError::Other(e.to_string()))?;
        on_listening(addr, &state.engine.info);
        let stop = async {
            stop_signal().await;
            eprintln!(
                "cmf serve: shutting down: finishing the answers in flight (Ctrl-C again to quit now)"
            );
            tokio::spawn(async {
                stop_signal().await;
                std::process::exit(130);
            });
        };
        let shared = shared(&cfg, state.clone(), metrics);
        Ok::<_, StartError>(crate::conn::serve(listener, shared, stop).await)
    })?;
    if let Stopped::DeadlinePassed(n) = stopped {
        eprintln!("cmf serve: shutdown deadline passed: closing {n} connection(s)");
    }
    // Tasks still running (connections past the deadline, a request still being prepared) are
    // dropped or left behind rather than waited for.
    rt.shutdown_timeout(Duration::from_millis(200));
    // The worker stops within one token or prefill piece once its clients are gone; joining it
    // is bounded all the same (a thread still busy after that dies with the process).
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        drop(state);
        let _ = tx.send(());
    });
    let _ = rx.recv_timeout(cfg.limits.shutdown.min(Duration::from_secs(5)));
    Ok(())
}

/// Ctrl-C, or (Unix) SIGTERM as service managers send it.
async fn stop_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

/// A server on a background thread (tests, benchmarks): stopped by [`RunningServer::stop`] or drop.
pub struct RunningServer {
    addr: SocketAddr,
    state: Arc<AppState>,
    metrics: Arc<Metrics>,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl RunningServer {
    pub fn start(cfg: ServerConfig) -> Result<RunningServer, StartError> {
        let mut cfg = cfg;
        check_limits(&cfg.limits)?;
        cfg.limits.max_connections = crate::conn::connection_cap(cfg.limits.max_connections);
        let rt = runtime(cfg.http_threads)?;
        let state = state(&cfg)?;
        let metrics = Arc::new(Metrics::default());
        let listener = rt.block_on(bind(&cfg))?;
        let addr = listener
            .local_addr()
            .map_err(|e| StartError::Other(e.to_string()))?;
        let (tx, rx) = oneshot::channel::<()>();
        let shared = shared(&cfg, state.clone(), metrics.clone());
        let thread = std::thread::Builder::new()
            .name("cmf-server".into())
            .spawn(move || {
                let _ = rt.block_on(crate::conn::serve(listener, shared, async {
                    let _ = rx.await;
                }));
                // Connections still open after the deadline are dropped with the runtime.
                rt.shutdown_timeout(Duration::from_secs(1));
            })
            .map_err(|e| StartError::Other(format!("cannot start the server thread: {e}")))?;
        Ok(RunningServer {
            addr,
            state,
            metrics,
            shutdown: Some(tx),
            thread: Some(thread),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn stats(&self) -> &WorkerStats {
        &self.state.engine.stats
    }

    /// The HTTP side's counters (as `GET /metrics` shows them).
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    pub fn model_info(&self) -> &crate::worker::ModelInfo {
        &self.state.engine.info
    }

    /// Graceful shutdown: stops accepting, lets answers in flight finish, joins the threads.
    pub fn stop(mut self) {
        self.stop_inner();
    }

    fn stop_inner(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for RunningServer {
    fn drop(&mut self) {
        self.stop_inner();
    }
}
