//! Host → device copies through pinned staging buffers.
//!
//! A copy from pageable memory (a memory-mapped model file) runs at a fraction of the link's
//! rate: the driver stages it itself, one thread faults the source pages in, nothing overlaps,
//! and it may wait for the stream's earlier work first. Here the bytes are copied into two
//! pinned buffers used as a ring (large pieces by several threads, which also spreads the page
//! faults) and sent from there by the DMA engine, asynchronously: an upload returns once its
//! bytes sit in pinned memory, so the next one's host copy overlaps this one's DMA, and a
//! model's many weights stream without a wait between them. A buffer is reused only after its
//! last DMA finished (one event per buffer). When pinned memory cannot be had, the caller falls
//! back to the plain copy.

use super::device::{Ctx, DResult, PinnedBuf};
use cudarc::driver::{result as dr, sys};

/// Uploads at least this large go through the staging buffers; smaller ones (a decode step's
/// token ids and the like) keep the plain copy and its wait.
pub const STAGED_MIN: usize = 4 << 10;
/// Bytes per staging buffer (two of them).
const CHUNK: usize = 32 << 20;
/// Pieces at least this large are copied into pinned memory by several threads.
const PARALLEL_MIN: usize = 4 << 20;

/// Two pinned host buffers used as a ring, and the events that say when the last DMA from
/// each finished.
pub struct Staging {
    /// Freed after `Drop` has waited for their last DMA (fields drop after `drop` runs).
    bufs: [PinnedBuf; 2],
    done: [sys::CUevent; 2],
    /// Whether `done[b]` was recorded since the buffer was last waited for.
    pending: [bool; 2],
    /// The buffer being filled and the first free byte in it.
    cur: usize,
    off: usize,
}

// SAFETY: the events are owned by this value; the Dev keeps it behind a Mutex, so one thread at a
// time uses it.
unsafe impl Send for Staging {}

impl Staging {
    pub fn new() -> DResult<Staging> {
        // Drop frees whatever was made when a later step fails.
        let mut s = Staging {
            bufs: [PinnedBuf::new(CHUNK)?, PinnedBuf::new(CHUNK)?],
            done: [std::ptr::null_mut(); 2],
            pending: [false; 2],
            cur: 0,
            off: 0,
        };
        for b in 0..2 {
            s.done[b] = dr::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .ctx(|| "cuEventCreate".into())?;
        }
        Ok(s)
    }

    /// Queues the copy of `src` to device address `dst` on `stream`. Returns once `src` has
    /// been copied into pinned memory (the caller may drop it); the DMA completes in stream
    /// order, before any work queued after it on `stream`.
    pub fn upload(&mut self, stream: sys::CUstream, dst: u64, src: &[u8]) -> DResult<()> {
        let mut done = 0;
        while done < src.len() {
            if self.off == CHUNK {
                self.cur ^= 1;
                self.off = 0;
            }
            let b = self.cur;
            if self.off == 0 && std::mem::take(&mut self.pending[b]) {
                // SAFETY: recorded below on the stream; not destroyed until Drop.
                unsafe { dr::event::synchronize(self.done[b]) }
                    .ctx(|| "waiting for a staging buffer".into())?;
            }
            let n = (CHUNK - self.off).min(src.len() - done);
            let piece = &src[done..done + n];
            // off..off + n is past every byte a pending DMA of this buffer reads (the ring only
            // restarts a buffer after waiting for it).
            let pinned = &mut self.bufs[b].bytes_mut()[self.off..self.off + n];
            if n >= PARALLEL_MIN {
                parallel_copy(piece, pinned);
            } else {
                pinned.copy_from_slice(piece);
            }
            // SAFETY: dst + done has room (the caller sized the buffer for src); the pinned
            // bytes stay untouched until the event recorded next has fired.
            unsafe {
                dr::memcpy_htod_async(dst + done as u64, &*pinned, stream)
                    .ctx(|| format!("uploading {n} bytes (staged)"))?;
                dr::event::record(self.done[b], stream).ctx(|| "cuEventRecord".into())?;
            }
            self.pending[b] = true;
            self.off += n;
            done += n;
        }
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        for b in 0..2 {
            // SAFETY: created in new(); the buffers are freed after this returns, once their
            // last DMA finished.
            unsafe {
                if self.pending[b] {
                    let _ = dr::event::synchronize(self.done[b]);
                }
                if !self.done[b].is_null() {
                    let _ = dr::event::destroy(self.done[b]);
                }
            }
        }
    }
}

/// `dst.copy_from_slice(src)` split over up to 8 threads (page faults on a mapped source are
/// the slow part, and they run in parallel).
fn parallel_copy(src: &[u8], dst: &mut [u8]) {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(8);
    let part = src.len().div_ceil(threads).max(1 << 20);
    if threads == 1 || src.len() <= part {
        dst.copy_from_slice(src);
        return;
    }
    std::thread::scope(|s| {
        for (d, c) in dst.chunks_mut(part).zip(src.chunks(part)) {
            s.spawn(move || d.copy_from_slice(c));
        }
    });
}

#[cfg(test)]
mod tests {
    #[test]
    fn parallel_copy_copies_every_byte() {
        let src: Vec<u8> = (0..(5 << 20) + 123).map(|i| (i * 7 % 251) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        super::parallel_copy(&src, &mut dst);
        assert!(src == dst);
    }
}
