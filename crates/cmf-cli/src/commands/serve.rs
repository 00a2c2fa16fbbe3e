//! `cmf serve FILE`: an OpenAI-compatible HTTP API over one LLM (see `docs/server.md`). The
//! model loads first; the port opens once it is ready. Ctrl-C stops accepting, lets answers in
//! flight finish (within `--shutdown-timeout`), and exits; a second one exits at once.
//! `--gpu` / `--gpu-layers` place the model as for `cmf run`.

use std::path::PathBuf;
use std::time::Duration;

use cmf_server::{BatchDeviceBuilder, ConnLimits, EngineBuilder, EngineOptions, ServerConfig};

use super::llm_opts::EngineOpts;
use crate::exit::UsageError;

/// Serve an LLM over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions).
#[derive(clap::Args)]
pub struct Args {
    /// A .cmf LLM file (or any shard of a set).
    file: PathBuf,
    /// Address to listen on (use 0.0.0.0 to accept other machines: then set --api-key).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// TCP port (0 picks a free one and prints it).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// max_tokens for requests that do not set it (always capped by what the context leaves).
    #[arg(long, value_name = "N", default_value_t = 512)]
    max_tokens_default: usize,
    /// Tokens one request may occupy, prompt and answer (default: 4096, capped at the model's maximum).
    #[arg(short = 'c', long, value_name = "N")]
    ctx: Option<usize>,
    /// Require `Authorization: Bearer KEY` on /v1/* (or set CMF_API_KEY).
    #[arg(long, value_name = "KEY", env = "CMF_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Requests that may wait while one is generated; more get 503.
    #[arg(long, value_name = "N", default_value_t = 16)]
    queue: usize,
    /// Requests generated at once. More than 1 runs the batched engine (paged KV cache, prefix
    /// reuse), on the GPU for dense and MoE models when one is used, else on the CPU.
    #[arg(long, value_name = "N", default_value_t = 1)]
    parallel: usize,
    /// KV-cache pool of the batched engine in MiB (default: --parallel full contexts).
    #[arg(long = "kv-pool", value_name = "MIB")]
    kv_pool: Option<usize>,
    /// Recurrent-state checkpoints of a hybrid (Qwen3-Next) model in MiB, for its prefix reuse
    /// with --parallel (0: off; default: 8 per stream).
    #[arg(long = "state-cache", value_name = "MIB")]
    state_cache: Option<usize>,
    /// Largest request body in bytes; larger ones get 413.
    #[arg(long, value_name = "BYTES", default_value_t = 1 << 20)]
    max_body: usize,
    /// Client connections open at once; one more is answered 503 and closed.
    #[arg(long, value_name = "N", default_value_t = 1024)]
    max_connections: usize,
    /// Seconds a request head may take from its first byte; slower connections are closed.
    #[arg(long, value_name = "SECS", default_value_t = 10.0)]
    header_timeout: f64,
    /// Seconds a request body may take after its head; slower requests get 408.
    #[arg(long, value_name = "SECS", default_value_t = 30.0)]
    body_timeout: f64,
    /// Seconds a keep-alive connection may wait for its next request.
    #[arg(long, value_name = "SECS", default_value_t = 60.0)]
    idle_timeout: f64,
    /// Seconds answers in flight get to finish after Ctrl-C or SIGTERM.
    #[arg(long, value_name = "SECS", default_value_t = 30.0)]
    shutdown_timeout: f64,
    /// Let browsers on this origin call the API (repeatable; `*` allows any). Off by default.
    #[arg(long = "cors-origin", value_name = "ORIGIN")]
    cors_origin: Vec<String>,
    #[command(flatten)]
    engine: EngineOpts,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let kv_dtype = args.engine.apply()?;
    args.engine.gpu_settings()?; // bad --gpu / --gpu-layers values fail before loading
    if args.max_tokens_default == 0 {
        return Err(UsageError("--max-tokens-default must be at least 1".into()).into());
    }
    if args.queue == 0 {
        return Err(UsageError("--queue must be at least 1".into()).into());
    }
    if args.parallel == 0 {
        return Err(UsageError("--parallel must be at least 1".into()).into());
    }
    if args.kv_pool == Some(0) {
        return Err(UsageError("--kv-pool must be at least 1 MiB".into()).into());
    }
    let parallel = args.parallel;
    if args.max_body < 1024 {
        return Err(UsageError("--max-body must be at least 1024 bytes".into()).into());
    }
    if args.max_connections == 0 {
        return Err(UsageError("--max-connections must be at least 1".into()).into());
    }
    let limits = ConnLimits {
        max_connections: args.max_connections,
        header: seconds("--header-timeout", args.header_timeout)?,
        body: seconds("--body-timeout", args.body_timeout)?,
        idle: seconds("--idle-timeout", args.idle_timeout)?,
        shutdown: seconds("--shutdown-timeout", args.shutdown_timeout)?,
    };
    if args.ctx == Some(0) || args.ctx == Some(1) {
        return Err(UsageError("--ctx must be at least 2".into()).into());
    }
    if let Some(o) = args
        .cors_origin
        .iter()
        .find(|o| o.is_empty() || o.chars().any(|c| c.is_whitespace() || c.is_control()))
    {
        return Err(UsageError(format!(
            "--cors-origin {o:?} is not an origin (e.g. http://localhost:3000, or *)"
        ))
        .into());
    }
    if args.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
        return Err(UsageError("--api-key must not be empty".into()).into());
    }
    let cfg = ServerConfig {
        host: args.host.clone(),
        port: args.port,
        engine: EngineOptions {
            ctx: args.ctx,
            kv_dtype,
            queue_capacity: args.queue,
            parallel,
            kv_pool_bytes: args.kv_pool.map(|m| m << 20),
            state_cache_bytes: args.state_cache.map(|m| m << 20),
            token_pacing: None,
            build_engine: Some(engine_builder(args.engine.clone())),
            build_batch_device: Some(batch_device_builder(args.engine.clone())),
        },
        max_tokens_default: args.max_tokens_default,
        api_key: args.api_key.clone(),
        max_body_bytes: args.max_body,
        limits,
        cors_origins: args.cors_origin.clone(),
        ..ServerConfig::new(&args.file)
    };
    let auth = if cfg.api_key.is_some() {
        "API key required"
    } else {
        "no API key"
    };
    cmf_server::run_until_ctrl_c(cfg, |addr, info| {
        eprintln!(
            "serving {} (context {} tokens, {auth}) on http://{addr}/v1 — Ctrl-C stops",
            info.id, info.ctx
        );
    })?;
    Ok(())
}

/// A timeout flag's value: more than 0 and at most a day.
fn seconds(flag: &str, v: f64) -> anyhow::Result<Duration> {
    if !(v > 0.0 && v <= 86_400.0) {
        return Err(UsageError(format!(
            "{flag} must be more than 0 and at most 86400 seconds (got {v})"
        ))
        .into());
    }
    Ok(Duration::from_secs_f64(v))
}

/// The batched engine (`--parallel` > 1) on the GPU when `--gpu` allows it, else the CPU.
fn batch_device_builder(opts: EngineOpts) -> BatchDeviceBuilder {
    BatchDeviceBuilder::new(move |model, ctx, rows, pool| {
        opts.batch_device(model, ctx, rows, pool)
            .map_err(|e| format!("{e:#}"))
    })
}

/// The model on the GPU when `--gpu` / `--gpu-layers` allow it (as `cmf run`), else the CPU.
fn engine_builder(opts: EngineOpts) -> EngineBuilder {
    EngineBuilder::new(move |model, ctx, kv_type| {
        opts.engine(model, ctx, kv_type)
            .map_err(|e| format!("{e:#}"))
    })
}
