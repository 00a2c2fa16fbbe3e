//! Accepting and keeping connections, with limits a hostile or broken client cannot get around:
//!
//! - at most `max_connections` open: one more is answered 503 and closed at once, so file
//!   descriptors never run out and the server stays reachable;
//! - a connection must send a complete request head within `header` of its first byte, and a
//!   keep-alive connection waiting for its next request is closed after `idle`;
//! - a request's body must arrive within `body` of its head (else 408);
//! - on shutdown, idle connections close at once and answers in flight get until the deadline.
//!
//! Every request passes through [`handle`]: request id, the per-request record the worker fills
//! in, and the log line and counters once its answer is over ([`crate::observe`]).

use crate::error::ApiError;
use crate::observe::{self, Metrics, RequestLine, RequestLog, RequestRecord};
use axum::body::Body;
use axum::http::{Request, Response, StatusCode};
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, Semaphore};

/// Limits on connections; see the module documentation.
#[derive(Debug, Clone)]
pub struct ConnLimits {
    pub max_connections: usize,
    pub header: Duration,
    pub body: Duration,
    pub idle: Duration,
    /// How long answers in flight may take to finish after a stop signal.
    pub shutdown: Duration,
}

impl Default for ConnLimits {
    fn default() -> Self {
        ConnLimits {
            max_connections: 1024,
            header: Duration::from_secs(10),
            body: Duration::from_secs(30),
            idle: Duration::from_secs(60),
            shutdown: Duration::from_secs(30),
        }
    }
}

/// What [`serve`] shares with every connection.
pub struct Shared {
    pub app: axum::Router,
    pub limits: ConnLimits,
    pub metrics: Arc<Metrics>,
    pub log: RequestLog,
}

/// How a stop went.
#[derive(Debug, PartialEq, Eq)]
pub enum Stopped {
    /// Every connection finished within the deadline.
    Drained,
    /// The deadline passed with this many connections still open (they are dropped).
    DeadlinePassed(usize),
}

/// Accepts until `stop` resolves, then shuts down gracefully within `limits.shutdown`.
pub async fn serve(
    listener: TcpListener,
    shared: Arc<Shared>,
    stop: impl Future<Output = ()>,
) -> Stopped {
    let slots = Arc::new(Semaphore::new(shared.limits.max_connections));
    // Refusals being written: a flood past the limit must not hold descriptors either.
    let refusals = Arc::new(Semaphore::new(64));
    let graceful = GracefulShutdown::new();
    let mut last_accept_error: Option<Instant> = None;
    tokio::pin!(stop);
    loop {
        let accepted = tokio::select! {
            _ = &mut stop => break,
            a = listener.accept() => a,
        };
        let stream = match accepted {
            Ok((s, _)) => s,
            Err(e) => {
                // EMFILE and friends: say so (once a second at most) and back off instead of
                // spinning; the connections holding descriptors time out.
                if last_accept_error.is_none_or(|t| t.elapsed() > Duration::from_secs(1)) {
                    eprintln!("cmf serve: cannot accept a connection: {e}");
                    last_accept_error = Some(Instant::now());
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            shared
                .metrics
                .connections_refused
                .fetch_add(1, Ordering::Relaxed);
            if let Ok(permit) = refusals.clone().try_acquire_owned() {
                tokio::spawn(async move {
                    refuse(stream).await;
                    drop(permit);
                });
            }
            continue;
        };
        shared
            .metrics
            .connections_accepted
            .fetch_add(1, Ordering::Relaxed);
        let conn = connection(stream, shared.clone(), &graceful);
        tokio::spawn(async move {
            conn.await;
            drop(slot);
        });
    }
    drop(listener);
    let open = graceful.count();
    if open == 0 {
        return Stopped::Drained;
    }
    let deadline = shared.limits.shutdown;
    eprintln!(
        "cmf serve: waiting up to {} s for {open} connection(s) to finish (--shutdown-timeout)",
        deadline.as_secs_f64()
    );
    match tokio::time::timeout(deadline, graceful.shutdown()).await {
        Ok(()) => Stopped::Drained,
        Err(_) => {
            Stopped::DeadlinePassed(shared.metrics.connections_open.load(Ordering::Relaxed) as usize)
        }
    }
}

/// The answer to a connection over the limit: written without reading the request.
async fn refuse(mut stream: TcpStream) {
    let mut e = ApiError::internal("too many open connections; retry later")
        .with_code("too_many_connections");
    e.status = StatusCode::SERVICE_UNAVAILABLE;
    let body = e.body().to_string();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         retry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        stream.shutdown().await
    })
    .await;
}

/// Serves one connection until it ends, its client is too slow, or the shutdown deadline.
fn connection(
    stream: TcpStream,
    shared: Arc<Shared>,
    graceful: &GracefulShutdown,
) -> impl Future<Output = ()> + Send + 'static {
    let clock = Arc::new(ConnClock::new());
    let io = TokioIo::new(Watched {
        inner: stream,
        clock: clock.clone(),
    });
    let svc = {
        let (shared, clock) = (shared.clone(), clock.clone());
        hyper::service::service_fn(move |req| handle(req, shared.clone(), clock.clone()))
    };
    let mut builder = hyper::server::conn::http1::Builder::new();
    // The head deadline is ours (it starts at the first byte, not at the end of the previous
    // answer); hyper's would also cut idle keep-alive connections.
    builder.timer(TokioTimer::new()).header_read_timeout(None);
    let conn = graceful.watch(builder.serve_connection(io, svc));
    async move {
        let metrics = &shared.metrics;
        metrics.connections_open.fetch_add(1, Ordering::Relaxed);
        tokio::select! {
            _ = conn => {}
            expired = watchdog(&clock, &shared.limits) => match expired {
                Phase::Head => {
                    metrics.header_timeouts.fetch_add(1, Ordering::Relaxed);
                    eprintln!(
                        "cmf serve: closed a connection that sent no complete request head within \
                         {} s (--header-timeout)",
                        shared.limits.header.as_secs_f64()
                    );
                }
                _ => {
                    metrics.idle_timeouts.fetch_add(1, Ordering::Relaxed);
                }
            },
        }
        metrics.connections_open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Where a connection is in its request cycle, and since when.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for the first byte of a request (a fresh or keep-alive connection).
    Idle,
    /// Some of a request head has arrived.
    Head,
    /// A request is being answered (its body has its own deadline; answers have none).
    Busy,
}

/// The phase and when it began; `changed` wakes the watchdog, whose deadline depends on it.
struct ConnClock {
    phase: Mutex<(Phase, Instant)>,
    changed: Notify,
}

impl ConnClock {
    fn new() -> ConnClock {
        ConnClock {
            phase: Mutex::new((Phase::Idle, Instant::now())),
            changed: Notify::new(),
        }
    }

    fn get(&self) -> (Phase, Instant) {
        *self.phase.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn set(&self, phase: Phase) {
        *self.phase.lock().unwrap_or_else(|p| p.into_inner()) = (phase, Instant::now());
        self.changed.notify_one();
    }

    /// Bytes arrived: an idle connection starts a request head.
    fn on_read(&self) {
        let mut g = self.phase.lock().unwrap_or_else(|p| p.into_inner());
        if g.0 == Phase::Idle {
            *g = (Phase::Head, Instant::now());
            self.changed.notify_one();
        }
    }
}

/// Resolves with the phase that ran past its limit.
async fn watchdog(clock: &ConnClock, limits: &ConnLimits) -> Phase {
    loop {
        let (phase, since) = clock.get();
        let wait = match phase {
            Phase::Idle => limits.idle,
            Phase::Head => limits.header,
            // An answer may take as long as it needs.
            Phase::Busy => {
                clock.changed.notified().await;
                continue;
            }
        };
        let deadline = since + wait;
        if Instant::now() >= deadline {
            return phase;
        }
        tokio::select! {
            _ = tokio::time::sleep_until(deadline.into()) => {}
            _ = clock.changed.notified() => {}
        }
    }
}

/// The socket, telling the connection's clock when bytes arrive.
struct Watched {
    inner: TcpStream,
    clock: Arc<ConnClock>,
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.clock.on_read();
        }
        r
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// One request: id, body deadline, the app, then the id on the answer and the log line when the
/// answer's body is over.
async fn handle(
    req: Request<Incoming>,
    shared: Arc<Shared>,
    clock: Arc<ConnClock>,
) -> Result<Response<Body>, std::convert::Infallible> {
    clock.set(Phase::Busy);
    let start = Instant::now();
    let id = observe::request_id(req.headers());
    let method = req.method().to_string();
    let path = observe::loggable_path(req.uri().path());
    let timed_out = Arc::new(AtomicBool::new(false));
    let req = req.map(|b| {
        Body::new(DeadlineBody {
            inner: b,
            sleep: Box::pin(tokio::time::sleep(shared.limits.body)),
            timed_out: timed_out.clone(),
            limit: shared.limits.body,
        })
    });
    let record = Arc::new(RequestRecord::default());
    // Logged when dropped: if the client leaves before the answer starts, hyper drops this
    // future and the line says 499 (nginx's "client closed request").
    let mut done = Done {
        line: RequestLine {
            id: id.clone(),
            method,
            path,
            status: CLIENT_CLOSED,
            start,
            record: record.clone(),
            client_left: true,
        },
        shared: shared.clone(),
        clock,
    };
    let app = shared.app.clone();
    let call = tower_service::Service::call(&mut app.clone(), req);
    let mut resp = match observe::with_record(record.clone(), call).await {
        Ok(r) => r,
        Err(never) => match never {},
    };
    if timed_out.load(Ordering::Relaxed) {
        shared.metrics.body_timeouts.fetch_add(1, Ordering::Relaxed);
        let mut e = ApiError::bad_request(format!(
            "the request body did not arrive within {} s",
            shared.limits.body.as_secs_f64()
        ))
        .with_code("request_timeout");
        e.status = StatusCode::REQUEST_TIMEOUT;
        resp = axum::response::IntoResponse::into_response(e);
        // The rest of the body is not coming in time; do not wait for it.
        resp.headers_mut().insert(
            axum::http::header::CONNECTION,
            axum::http::HeaderValue::from_static("close"),
        );
    }
    resp.headers_mut().insert("x-request-id", id);
    done.line.status = resp.status();
    done.line.client_left = false;
    Ok(resp.map(|inner| {
        Body::new(LoggedBody {
            inner,
            ended: false,
            _done: done,
        })
    }))
}

/// The status logged and counted for a request whose client left before its answer started.
const CLIENT_CLOSED: StatusCode = match StatusCode::from_u16(499) {
    Ok(s) => s,
    Err(_) => StatusCode::BAD_REQUEST,
};

/// A request body that fails once its deadline has passed.
struct DeadlineBody {
    inner: Incoming,
    sleep: Pin<Box<tokio::time::Sleep>>,
    timed_out: Arc<AtomicBool>,
    limit: Duration,
}

impl hyper::body::Body for DeadlineBody {
    type Data = axum::body::Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        if let Poll::Ready(r) = Pin::new(&mut self.inner).poll_frame(cx) {
            return Poll::Ready(r.map(|f| f.map_err(Into::into)));
        }
        if self.sleep.as_mut().poll(cx).is_ready() {
            self.timed_out.store(true, Ordering::Relaxed);
            let msg = format!(
                "the body did not arrive within {} s (--body-timeout)",
                self.limit.as_secs_f64()
            );
            return Poll::Ready(Some(Err(msg.into())));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// What to do when a request is over: count and log it, and start the connection's idle time.
struct Done {
    line: RequestLine,
    shared: Arc<Shared>,
    clock: Arc<ConnClock>,
}

impl Drop for Done {
    fn drop(&mut self) {
        self.line.finish(&self.shared.metrics, &self.shared.log);
        self.clock.set(Phase::Idle);
    }
}

/// An answer body that logs its request when it has been sent or dropped (client gone).
struct LoggedBody {
    inner: Body,
    /// The last frame was handed out.
    ended: bool,
    _done: Done,
}

impl hyper::body::Body for LoggedBody {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let r = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(None) = r {
            self.ended = true;
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for LoggedBody {
    /// Runs before `_done` is dropped (and logs): an answer cut short is marked.
    fn drop(&mut self) {
        if !(self.ended || hyper::body::Body::is_end_stream(&self.inner)) {
            self._done.line.client_left = true;
        }
    }
}

/// Spare descriptors beside the connections: the model's files, the runtime's, the standard
/// streams.
pub const SPARE_FDS: u64 = 64;

/// Raises this process's open-file limit (the soft one is often 1024) towards `want`, as far as
/// the hard limit allows; returns the limit now in force.
#[cfg(unix)]
#[allow(clippy::unnecessary_cast)] // rlim_t is u64 on Linux, not on every Unix
pub fn raise_fd_limit(want: u64) -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read and write the struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return u64::MAX;
        }
        if (lim.rlim_cur as u64) < want {
            let before = lim.rlim_cur;
            lim.rlim_cur = (want as libc::rlim_t).min(lim.rlim_max);
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                lim.rlim_cur = before;
            }
        }
    }
    lim.rlim_cur as u64
}

#[cfg(not(unix))]
pub fn raise_fd_limit(_want: u64) -> u64 {
    u64::MAX
}

/// `max_connections`, lowered (and said so on stderr) when the open-file limit cannot hold that
/// many sockets: running out of descriptors would make the server unreachable.
pub fn connection_cap(max_connections: usize) -> usize {
    let want = max_connections as u64 + SPARE_FDS;
    let limit = raise_fd_limit(want);
    if limit >= want {
        return max_connections;
    }
    let cap = limit.saturating_sub(SPARE_FDS).max(1) as usize;
    eprintln!(
        "cmf serve: the open-file limit is {limit}: accepting at most {cap} connections \
         (--max-connections {max_connections}; raise the limit with ulimit -n)"
    );
    cap
}
