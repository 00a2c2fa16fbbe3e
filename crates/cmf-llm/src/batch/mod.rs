//! Many sequences at once on one model: a paged KV cache with prefix reuse, a batched step and a
//! continuous-batching scheduler.
//!
//! - [`blocks`]: the block allocator and prefix cache (reference counts, content-hashed chain,
//!   LRU eviction of unreferenced blocks). Bookkeeping only.
//! - [`engine`]: [`BatchEngine`] owns every sequence's state (tokens, computed length, block
//!   table) and the KV pool (`cmf_kernels::KvBlocks`, one per layer); [`BatchEngine::step`] runs
//!   one forward pass over any mix of decode tokens and prompt chunks: one GEMM per linear layer
//!   over all rows, paged attention per sequence.
//! - `recurrent`: the recurrent-state slots of hybrid (GatedDeltaNet) models, one per
//!   sequence, taken and given back with its blocks.
//! - [`scheduler`]: [`Scheduler`] admits requests first come, first served, plans each step
//!   within a token budget, preempts the youngest sequence when the pool runs out, samples.
//! - [`bench`]: llama-batched-bench's PP / TG / total table on this engine (`cmf bench --parallel`).
//!
//! The single-sequence path (`CpuEngine`, `Model::prefill`) is separate and unchanged: it keeps
//! its contiguous cache and the matvec decode. A device engine implements the same step contract
//! (sequences with block tables in, logits or sampled ids out) over its own block pool.

pub mod bench;
pub mod blocks;
pub mod device;
pub mod engine;
mod recurrent;
pub mod scheduler;
pub mod state_cache;

pub use blocks::{BlockPool, PoolStats};
pub use device::{DeviceBatch, PoolSize};
pub use engine::{BatchConfig, BatchEngine, RowCounts, SeqId, Work};
pub use scheduler::{
    Event, Processors, Request, RequestId, Scheduler, SchedulerConfig, SchedulerStats,
};
pub use state_cache::StateCacheStats;
