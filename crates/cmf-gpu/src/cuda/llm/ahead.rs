//! Decoding one token ahead.
//!
//! The sampler at the end of a token's graph writes the token it drew into the device-side
//! decode inputs, so the next token's graph can start without the host: when the caller feeds
//! every sampled token back (greedy or seeded generation), the graph for position `p + 1` is
//! launched before the host has read the token of position `p`, and the host's per-token work
//! (reading the token, returning up the stack, the next launch) overlaps the device's.
//!
//! Correctness does not depend on the caller: a graph launched ahead is kept only when the next
//! call asks for exactly that step (same position, the token it was fed, same sampler, no
//! logits wanted). Otherwise the host waits for it and runs the step as asked, which rewrites
//! everything the speculative graph wrote (the KV rows at that position, the decode inputs).
//!
//! The sampler also writes each (position, token) pair into [`TokenRing`], a small pinned,
//! device-mapped host buffer, so reading a token needs no copy on the stream that would queue
//! behind the graph running ahead.

use crate::cuda::runtime::device::{Ctx, DResult, DevError};
use crate::llm::Sampler;
use cudarc::driver::{result as dr, sys};

/// Slots in the token ring (a power of two; at most two graphs are in flight).
pub const RING_SLOTS: usize = 4;

/// `RING_SLOTS` pairs of i32 (position, token) in pinned host memory the device writes to.
pub struct TokenRing {
    host: *mut i32,
    dev: u64,
}

// SAFETY: the pointer is a pinned allocation owned by this value, used by one thread at a time
// (CudaLlm methods take &mut self).
unsafe impl Send for TokenRing {}

impl TokenRing {
    pub fn new() -> DResult<TokenRing> {
        let bytes = RING_SLOTS * 2 * 4;
        // SAFETY: a fresh pinned, device-mapped allocation, freed in Drop.
        let host = unsafe { dr::malloc_host(bytes, sys::CU_MEMHOSTALLOC_DEVICEMAP) }
            .ctx(|| format!("pinning {bytes} bytes of mapped host memory"))?
            as *mut i32;
        let mut ring = TokenRing { host, dev: 0 };
        // SAFETY: `host` is a live allocation of `bytes`; no device work uses it yet. Position
        // -1 marks an empty slot.
        unsafe { std::ptr::write_bytes(host, 0xff, RING_SLOTS * 2) };
        // SAFETY: `host` came from cuMemHostAlloc with DEVICEMAP.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut ring.dev, host as *mut _, 0) }
            .result()
            .ctx(|| "cuMemHostGetDevicePointer".into())?;
        Ok(ring)
    }

    /// The device address the sampler writes to.
    pub fn dev_ptr(&self) -> u64 {
        self.dev
    }

    /// The token sampled at `pos`, once the graph that drew it has completed; None when the
    /// slot holds another position's (a bug: the caller turns it into an error).
    pub fn token_at(&self, pos: usize) -> Option<u32> {
        let slot = pos & (RING_SLOTS - 1);
        // SAFETY: slot < RING_SLOTS; volatile because the device wrote it behind our back.
        let (p, t) = unsafe {
            (
                std::ptr::read_volatile(self.host.add(2 * slot)),
                std::ptr::read_volatile(self.host.add(2 * slot + 1)),
            )
        };
        (p as i64 == pos as i64 && t >= 0).then_some(t as u32)
    }
}

impl Drop for TokenRing {
    fn drop(&mut self) {
        // SAFETY: allocated in new(); the owner settles device work before dropping it.
        unsafe {
            let _ = dr::free_host(self.host as *mut _);
        }
    }
}

/// A graph launched ahead: the step it computes and the event recorded after it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct InFlight {
    pub pos: usize,
    /// The token its embedding reads (the one sampled at `pos - 1`).
    pub fed: u32,
    pub sampler: Sampler,
}

/// Decode-ahead state: the token ring, one completion event per ring parity, the graph in
/// flight (if any).
pub struct DecodeAhead {
    /// Launch the next graph ahead: on unless a test turns it off. Measured on the H200
    /// (2026-12-01, Qwen3-0.6B q8 from context 128): 1500.8 / 1502.5 tok/s against 1479.6 /
    /// 1489.8 step by step.
    pub enabled: bool,
    pub ring: TokenRing,
    events: [sys::CUevent; 2],
    pub in_flight: Option<InFlight>,
}

// SAFETY: as TokenRing; the events are owned by this value.
unsafe impl Send for DecodeAhead {}

impl DecodeAhead {
    /// Launching ahead on; the ring is used either way.
    pub fn new() -> DResult<DecodeAhead> {
        let ring = TokenRing::new()?;
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING;
        let e0 = dr::event::create(flags).ctx(|| "cuEventCreate".into())?;
        let e1 = dr::event::create(flags).inspect_err(|_| {
            // SAFETY: created above, never recorded.
            unsafe {
                let _ = dr::event::destroy(e0);
            }
        });
        Ok(DecodeAhead {
            enabled: true,
            ring,
            events: [e0, e1.ctx(|| "cuEventCreate".into())?],
            in_flight: None,
        })
    }

    /// Records the completion event of the graph for `pos` (just launched on `stream`).
    pub fn record(&self, pos: usize, stream: sys::CUstream) -> DResult<()> {
        // SAFETY: the event and stream are live.
        unsafe { dr::event::record(self.events[pos & 1], stream) }.ctx(|| "cuEventRecord".into())
    }

    /// Waits for the graph for `pos` and returns the token it sampled.
    pub fn wait_token(&self, pos: usize) -> DResult<u32> {
        // SAFETY: recorded by `record(pos)`; not destroyed until Drop.
        unsafe { dr::event::synchronize(self.events[pos & 1]) }
            .ctx(|| "waiting for the decode graph".into())?;
        self.ring.token_at(pos).ok_or_else(|| {
            DevError(format!(
                "the sampler's token for position {pos} is missing from the token ring"
            ))
        })
    }

    /// Takes the graph in flight if it computes exactly this step.
    pub fn take_matching(&mut self, pos: usize, fed: u32, sampler: &Sampler) -> bool {
        let want = InFlight {
            pos,
            fed,
            sampler: *sampler,
        };
        if self.in_flight == Some(want) {
            self.in_flight = None;
            true
        } else {
            false
        }
    }
}

impl Drop for DecodeAhead {
    fn drop(&mut self) {
        // SAFETY: created in new(), destroyed once; the owner settles device work first.
        unsafe {
            for e in self.events {
                let _ = dr::event::destroy(e);
            }
        }
    }
}
