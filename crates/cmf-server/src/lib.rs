//! An OpenAI-compatible HTTP API over one CMF LLM: `cmf serve`.
//!
//! Layout, from the wire inwards:
//! - [`routes`]: axum routes, API key, bounded body reading, JSON and server-sent-event answers;
//! - [`request`]: strict parsing and validation of the untrusted request bodies;
//! - [`prompt`]: chat template + tokenizer, and the context checks that need the token count;
//! - [`tools`]: tool definitions, the model's tool-call syntax parsed into OpenAI `tool_calls`;
//!   [`guidance`]: grammars (JSON schemas, forced tool calls) compiled for the vocabulary;
//! - [`generation`]: one request's choices with logit bias, constraints and log-probabilities;
//! - [`worker`]: the single inference thread that owns the model, fed by a bounded queue;
//!   a client that disconnects cancels its generation within one token; [`batched`]: the same
//!   thread running many requests at once on `cmf_llm::batch` (`--parallel`);
//! - [`openai`]: response and stream-chunk shapes; [`error`]: OpenAI's error body and statuses;
//! - [`conn`]: accepting connections: the connection limit, header/body/idle timeouts, the
//!   shutdown deadline; [`observe`]: request ids, one log line per request, `/metrics`;
//! - [`server`]: start (model first, then the port), serve, graceful shutdown.
//!
//! The user-facing description (endpoints, flags, examples, what is not supported) is
//! `docs/server.md`.

pub mod batched;
pub mod conn;
pub mod error;
pub mod generation;
pub mod guidance;
pub mod observe;
pub mod openai;
pub mod prompt;
pub mod request;
pub mod routes;
pub mod server;
pub mod tools;
pub mod worker;

pub use conn::ConnLimits;
pub use error::ApiError;
pub use observe::{Metrics, RequestLog};
pub use server::{run_until_ctrl_c, RunningServer, ServerConfig};
pub use worker::{
    BatchDeviceBuilder, EngineBuilder, EngineOptions, ModelInfo, StartError, WorkerStats,
};
