//! The inference worker: one OS thread owns the model and its KV cache and runs one request at a
//! time, taken from a bounded queue.
//!
//! Why one thread: the model and its state are not re-entrant, and a CPU forward pass already
//! uses every core through the kernels' thread pool, so running two requests at once would only
//! make both slower. The HTTP side stays responsive on its own small tokio runtime.
//!
//! A request is a [`Job`]: the prompt's ids, the generation config, and the sending end of an
//! unbounded channel of [`Event`]s (text pieces, then `Done` or `Failed`). The HTTP handler holds
//! the receiving end; when the client goes away the handler (or the response stream) is dropped,
//! the channel closes, and the worker sees it before the next forward pass or prefill piece
//! (`cmf_llm::guided::generate_guided`) and stops: a client that disconnects cancels its
//! generation within one token, or one piece of a long prompt. A job whose client left while it
//! waited is skipped. The KV cache is cleared for every request (no prefix reuse across requests).
//!
//! With `parallel` > 1 the same thread runs the batched engine instead ([`crate::batched`]).

use crate::error::ApiError;
use crate::observe::{current_record, RequestRecord};
use cmf_format::CmfModel;
use cmf_kernels::KvDtype;
use cmf_llm::batch::{DeviceBatch, PoolSize};
use cmf_llm::chat::TextAssets;
use cmf_llm::engine::{CpuEngine, Engine as LlmEngine};
use cmf_llm::generate::{FinishReason, GenerationStats};
use cmf_llm::{Model, ModelConfig};
use std::panic::AssertUnwindSafe;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;
use tokio::sync::mpsc;

pub use crate::generation::{Event, Job, JobOptions};

#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Tokens one request may occupy (default 4096), capped at the model's maximum positions.
    pub ctx: Option<usize>,
    pub kv_dtype: KvDtype,
    /// Requests that may wait while `parallel` run; one more gets 503.
    pub queue_capacity: usize,
    /// Requests generated at once. 1: one at a time on the engine `build_engine` makes (the
    /// GPU's when placed there). More: the batched CPU engine (`cmf_llm::batch`), whose KV pool
    /// holds `kv_pool_bytes` (default: `parallel` full contexts).
    pub parallel: usize,
    pub kv_pool_bytes: Option<usize>,
    /// Bytes of a hybrid model's recurrent-state checkpoints, its prefix reuse (`parallel` > 1;
    /// 0: off; default: [`crate::batched::STATE_CACHE_PER_STREAM`] checkpoints per stream).
    pub state_cache_bytes: Option<usize>,
    /// Sleep before every forward pass. Only for tests of queueing and cancellation, which need
    /// a tiny model to be slow; not exposed on the command line.
    #[doc(hidden)]
    pub token_pacing: Option<Duration>,
    /// Builds the generation engine once the worker has bound the weights (the CLI's puts the
    /// model on the GPU when `--gpu` allows it). None: the CPU engine.
    pub build_engine: Option<EngineBuilder>,
    /// Puts the batched engine (`parallel` > 1) on a device when it answers. None: the CPU.
    pub build_batch_device: Option<BatchDeviceBuilder>,
}

/// A function from the loaded model, the longest sequence, the rows per step and the pool size
/// to the device that runs the batched engine's steps, or None (the CPU runs them); called on the
/// worker thread. An error stops the server from starting.
#[derive(Clone)]
pub struct BatchDeviceBuilder(Arc<BatchDeviceFn>);

type BatchDeviceFn =
    dyn Fn(&Model, usize, usize, PoolSize) -> Result<Option<DeviceBatch>, String> + Send + Sync;

impl BatchDeviceBuilder {
    pub fn new<F>(f: F) -> BatchDeviceBuilder
    where
        F: Fn(&Model, usize, usize, PoolSize) -> Result<Option<DeviceBatch>, String>
            + Send
            + Sync
            + 'static,
    {
        BatchDeviceBuilder(Arc::new(f))
    }

    pub(crate) fn build(
        &self,
        model: &Model,
        ctx: usize,
        rows: usize,
        pool: PoolSize,
    ) -> Result<Option<DeviceBatch>, String> {
        (self.0)(model, ctx, rows, pool)
    }
}

impl std::fmt::Debug for BatchDeviceBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BatchDeviceBuilder(..)")
    }
}

/// A function from the loaded model, the context length and the KV-cache type to the engine
/// that runs it; called on the worker thread (GPU state is per thread).
#[derive(Clone)]
pub struct EngineBuilder(Arc<BuildFn>);

type BuildFn = dyn for<'m, 'a> Fn(&'m Model<'a>, usize, KvDtype) -> Result<Box<dyn LlmEngine + 'm>, String>
    + Send
    + Sync;

impl EngineBuilder {
    pub fn new<F>(f: F) -> EngineBuilder
    where
        F: for<'m, 'a> Fn(&'m Model<'a>, usize, KvDtype) -> Result<Box<dyn LlmEngine + 'm>, String>
            + Send
            + Sync
            + 'static,
    {
        EngineBuilder(Arc::new(f))
    }
}

impl std::fmt::Debug for EngineBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EngineBuilder(..)")
    }
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            ctx: None,
            kv_dtype: KvDtype::F16,
            queue_capacity: 16,
            parallel: 1,
            kv_pool_bytes: None,
            state_cache_bytes: None,
            token_pacing: None,
            build_engine: None,
            build_batch_device: None,
        }
    }
}

/// What the server says about the loaded model.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// The `model` field of responses: the file name without `.cmf` (and shard suffix).
    pub id: String,
    /// The file's modification time (Unix seconds), as `created` of `/v1/models`.
    pub created: u64,
    pub ctx: usize,
    pub vocab_size: usize,
}

/// Counters for `/health` and the tests.
#[derive(Debug, Default)]
pub struct WorkerStats {
    pub busy: AtomicBool,
    /// Requests that ran to a normal end (or failed).
    pub finished: AtomicU64,
    /// Requests stopped because their client went away (while running or still queued).
    pub cancelled: AtomicU64,
    /// Tokens sampled over all requests, cancelled ones included.
    pub generated_tokens: AtomicU64,
    /// Requests being generated now.
    pub running: AtomicU64,
    /// Requests the batched engine accepted that wait for KV memory.
    pub waiting_for_memory: AtomicU64,
    /// The batched engine's KV pool: blocks held by requests, blocks in all.
    pub kv_blocks_in_use: AtomicU64,
    pub kv_blocks_total: AtomicU64,
    /// Prefix cache: full prompt blocks looked up, and found.
    pub prefix_queries: AtomicU64,
    pub prefix_hits: AtomicU64,
    /// Prompt tokens the batched engine computed (not those taken from the prefix cache or
    /// shared by a request's choices).
    pub prompt_tokens_computed: AtomicU64,
    /// Between consecutive text pieces of one answer.
    pub inter_token_latency: crate::observe::Histogram,
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Format(#[from] cmf_format::Error),
    #[error("{path}: {source}")]
    Llm {
        path: String,
        source: cmf_llm::LlmError,
    },
    #[error("{0}")]
    Other(String),
}

/// The loaded model behind its queue.
pub struct Engine {
    pub assets: Arc<TextAssets>,
    /// Grammars and the tool-call format (structured output, tool calling).
    pub guidance: Arc<crate::guidance::Guidance>,
    pub info: ModelInfo,
    pub stats: Arc<WorkerStats>,
    queue_capacity: usize,
    jobs: Option<mpsc::Sender<Queued>>,
    thread: Option<JoinHandle<()>>,
}

impl Engine {
    /// Opens `path`, reads its tokenizer and template, and starts the worker thread, which binds
    /// the weights; returns once the model is ready (or with the reason it cannot be run).
    pub fn start(path: &Path, opts: EngineOptions) -> Result<Engine, StartError> {
        let shown = path.display().to_string();
        let llm = |source| StartError::Llm {
            path: shown.clone(),
            source,
        };
        if opts.parallel == 0 {
            return Err(StartError::Other("--parallel must be at least 1".into()));
        }
        if opts.queue_capacity == 0 {
            return Err(StartError::Other(
                "the queue capacity must be at least 1".into(),
            ));
        }
        let file = CmfModel::open(path)?;
        let assets = Arc::new(TextAssets::from_cmf(&file).map_err(llm)?);
        let config = ModelConfig::from_cmf(&file).map_err(llm)?;
        let mut ctx = opts.ctx.unwrap_or(4096).min(config.max_position_embeddings);
        if opts.parallel > 1 {
            // One request can never hold more than the whole pool (less one position: its last
            // token is sampled, not stored), so prompts are checked against that.
            let bytes = crate::batched::pool_bytes(
                &config,
                opts.parallel,
                ctx,
                opts.kv_pool_bytes,
                opts.kv_dtype,
            );
            let held = crate::batched::pool_positions(&config, bytes, opts.kv_dtype);
            ctx = ctx.min(held.saturating_sub(1));
        }
        if ctx < 2 {
            return Err(StartError::Other(format!(
                "a context of {ctx} tokens leaves no room for a prompt and an answer"
            )));
        }
        let info = ModelInfo {
            id: model_id(path),
            created: std::fs::metadata(path)
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_secs()),
            ctx,
            vocab_size: config.vocab_size,
        };
        let guidance = Arc::new(crate::guidance::Guidance::new(
            &file,
            &assets,
            config.vocab_size,
        ));
        let (jobs, rx) = mpsc::channel(opts.queue_capacity);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let stats = Arc::new(WorkerStats::default());
        let worker = Worker {
            assets: assets.clone(),
            stats: stats.clone(),
            ctx,
            kv_dtype: opts.kv_dtype,
            pacing: opts.token_pacing,
            build: opts.build_engine.clone(),
            batch_device: opts.build_batch_device.clone(),
            path: shown.clone(),
            parallel: opts.parallel,
            kv_pool_bytes: opts.kv_pool_bytes,
            state_cache_bytes: opts.state_cache_bytes,
        };
        let thread = std::thread::Builder::new()
            .name("cmf-inference".into())
            .spawn(move || worker.run(file, ready_tx, rx))
            .map_err(|e| StartError::Other(format!("cannot start the inference thread: {e}")))?;
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e);
            }
            Err(_) => {
                let _ = thread.join();
                return Err(StartError::Other(
                    "the inference thread stopped while loading the model".into(),
                ));
            }
        }
        Ok(Engine {
            assets,
            guidance,
            info,
            stats,
            queue_capacity: opts.queue_capacity,
            jobs: Some(jobs),
            thread: Some(thread),
        })
    }

    /// Queues a job; 503 when the queue is full. The request's record (see
    /// [`crate::observe`]), when the caller runs under one, gets the job's token counts.
    pub fn submit(&self, job: Job) -> Result<(), ApiError> {
        let jobs = self.jobs.as_ref().expect("jobs is only taken in drop");
        let record = current_record();
        jobs.try_send(Queued { job, record }).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => ApiError::overloaded(self.queue_capacity),
            mpsc::error::TrySendError::Closed(_) => {
                ApiError::internal("the inference worker has stopped")
            }
        })
    }

    /// Requests waiting (not counting the one running).
    pub fn waiting(&self) -> usize {
        self.jobs
            .as_ref()
            .map_or(0, |j| j.max_capacity() - j.capacity())
    }

    pub fn queue_capacity(&self) -> usize {
        self.queue_capacity
    }
}

impl Drop for Engine {
    /// Closes the queue and waits for the worker: it finishes (or, with its client gone,
    /// cancels) the running job, drains the queue, and exits.
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A job and the record of the request it came from.
pub(crate) struct Queued {
    pub job: Job,
    pub record: Option<Arc<RequestRecord>>,
}

/// The worker thread's side.
pub(crate) struct Worker {
    pub assets: Arc<TextAssets>,
    pub stats: Arc<WorkerStats>,
    pub ctx: usize,
    pub kv_dtype: KvDtype,
    pub pacing: Option<Duration>,
    build: Option<EngineBuilder>,
    pub batch_device: Option<BatchDeviceBuilder>,
    /// The model file, for messages.
    pub path: String,
    pub parallel: usize,
    pub kv_pool_bytes: Option<usize>,
    pub state_cache_bytes: Option<usize>,
}

impl Worker {
    /// The engine for `model`: the builder's, else the CPU's.
    fn engine<'m, 'a>(&self, model: &'m Model<'a>) -> Result<Box<dyn LlmEngine + 'm>, String> {
        match &self.build {
            Some(b) => (b.0)(model, self.ctx, self.kv_dtype),
            None => Ok(Box::new(
                CpuEngine::new(model, self.ctx, self.kv_dtype).map_err(|e| e.to_string())?,
            )),
        }
    }

    fn run(
        self,
        file: CmfModel,
        ready: std::sync::mpsc::Sender<Result<(), StartError>>,
        mut rx: mpsc::Receiver<Queued>,
    ) {
        let model = match Model::load(&file) {
            Ok(m) => m,
            Err(source) => {
                let path = self.path.clone();
                let _ = ready.send(Err(StartError::Llm { path, source }));
                return;
            }
        };
        if self.parallel > 1 {
            return crate::batched::run(&self, &model, ready, rx);
        }
        // One engine (and KV cache) for all requests, cleared before each (its buffers stay
        // allocated).
        let mut engine = match self.engine(&model) {
            Ok(e) => e,
            Err(e) => {
                let _ = ready.send(Err(StartError::Other(format!("{}: {e}", self.path))));
                return;
            }
        };
        let _ = ready.send(Ok(()));
        drop(ready);
        while let Some(Queued { job, record }) = rx.blocking_recv() {
            if job.events.is_closed() {
                self.stats.cancelled.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            self.stats.busy.store(true, Ordering::Relaxed);
            self.stats.running.store(1, Ordering::Relaxed);
            let panicked = self.serve_one(&mut *engine, job, record);
            self.stats.busy.store(false, Ordering::Relaxed);
            self.stats.running.store(0, Ordering::Relaxed);
            if panicked {
                // The engine may be mid-step: start over from a new one (the CPU's if the
                // builder now fails).
                drop(engine);
                // The CPU engine was built once at start-up with these sizes, so it builds again.
                engine = self.engine(&model).unwrap_or_else(|e| {
                    eprintln!("cmf serve: {e}; continuing on the CPU");
                    Box::new(
                        CpuEngine::new(&model, self.ctx, self.kv_dtype)
                            .expect("the same CPU engine was built at start-up"),
                    )
                });
            }
        }
    }

    /// Runs one job alone on `engine` from an empty cache and sends its outcome; true when it
    /// panicked (the engine must then be rebuilt). A panic in one request must not take the
    /// server down: it is reported to that client.
    pub(crate) fn serve_one(
        &self,
        engine: &mut dyn LlmEngine,
        job: Job,
        record: Option<Arc<RequestRecord>>,
    ) -> bool {
        engine.truncate(0);
        let record = record.unwrap_or_default();
        record
            .prompt_tokens
            .store(job.ids.len() as u64, Ordering::Relaxed);
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
            self.run_job(&mut *engine, &job, &record)
        }));
        let panicked = result.is_err();
        let event = match result {
            Ok(Ok(stats)) => {
                record
                    .generated_tokens
                    .store(stats.generated_tokens as u64, Ordering::Relaxed);
                self.stats
                    .generated_tokens
                    .fetch_add(stats.generated_tokens as u64, Ordering::Relaxed);
                if stats.finish == FinishReason::Cancelled {
                    self.stats.cancelled.fetch_add(1, Ordering::Relaxed);
                    return false;
                }
                Event::Done(stats)
            }
            Ok(Err(e)) => Event::Failed(format!("generation failed: {e}")),
            Err(panic) => Event::Failed(format!(
                "internal error: the inference worker panicked: {}",
                panic_message(&panic)
            )),
        };
        self.stats.finished.fetch_add(1, Ordering::Relaxed);
        let _ = job.events.send(event);
        panicked
    }

    fn run_job(
        &self,
        engine: &mut dyn LlmEngine,
        job: &Job,
        record: &RequestRecord,
    ) -> cmf_llm::Result<GenerationStats> {
        let cancelled = || {
            if let Some(d) = self.pacing {
                std::thread::sleep(d);
            }
            job.events.is_closed()
        };
        // The first text sent is the request's time to first token in its log line; the gaps
        // between pieces are the inter-token latencies.
        let last = std::cell::Cell::new(None);
        let first_text = || {
            let now = std::time::Instant::now();
            record.first_text.get_or_init(|| now);
            if let Some(t) = last.replace(Some(now)) {
                self.stats.inter_token_latency.observe(now - t);
            }
        };
        crate::generation::run_job(engine, &self.assets.tokenizer, job, &cancelled, &first_text)
    }
}

pub(crate) fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

/// `dir/smollm2-135m-instruct.cmf` → `smollm2-135m-instruct`; a shard set's
/// `name-00001-of-00003.cmf` → `name`.
pub fn model_id(path: &Path) -> String {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let stem = name.strip_suffix(".cmf").unwrap_or(&name);
    // "-NNNNN-of-NNNNN" is 15 ASCII bytes.
    let b = stem.as_bytes();
    if b.len() > 15 {
        let t = &b[b.len() - 15..];
        let digits = |r: &[u8]| r.iter().all(u8::is_ascii_digit);
        if t[0] == b'-' && digits(&t[1..6]) && &t[6..10] == b"-of-" && digits(&t[10..]) {
            return stem[..stem.len() - 15].to_string();
        }
    }
    stem.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_ids() {
        assert_eq!(model_id(Path::new("/a/b/smol.cmf")), "smol");
        assert_eq!(model_id(Path::new("big-00001-of-00003.cmf")), "big");
        assert_eq!(model_id(Path::new("x-1-of-2.cmf")), "x-1-of-2");
        assert_eq!(model_id(Path::new("noext")), "noext");
        assert_eq!(model_id(Path::new("é-00001-of-00002.cmf")), "é");
    }
}
