//! End-to-end tests of `cmf serve`'s HTTP API on loopback, against the tiny qwen2 fixture
//! (`fixtures/llm/qwen2-tiny`, converted to CMF f32 once per run), plus a fuzz-style test of the
//! request parser. Every test bounds its time (socket timeouts, deadlines on polling loops).

mod api;
mod batched;
mod client;
mod features;
mod fixture;
mod hostile;
mod python_clients;
mod request_fuzz;
