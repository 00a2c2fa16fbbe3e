//! Large host → device copies through pinned staging buffers.
//!
//! A copy from pageable memory (a memory-mapped model file) runs at a fraction of the link's
//! rate: the driver stages it itself, one thread faults the source pages in, and nothing
//! overlaps. Here a chunk is copied into one of two pinned buffers by several threads (which
//! also spreads the page faults) while the DMA engine sends the other buffer. Used for every
//! upload of at least [`STAGED_MIN`] bytes; when pinned memory cannot be had, the caller falls
//! back to the plain copy.

use super::device::{Ctx, DResult};
use cudarc::driver::{result as dr, sys};
use std::ffi::c_void;

/// Uploads at least this large go through the staging buffers.
pub const STAGED_MIN: usize = 4 << 20;
/// Bytes per staging buffer (two of them).
const CHUNK: usize = 32 << 20;

/// Two pinned host buffers and the events that say when their last DMA finished.
pub struct Staging {
    bufs: [*mut u8; 2],
    done: [sys::CUevent; 2],
    used: [bool; 2],
}

// SAFETY: the pointers are pinned host allocations owned by this value; the Dev keeps it behind
// a Mutex, so one thread at a time uses it.
unsafe impl Send for Staging {}

impl Staging {
    pub fn new() -> DResult<Staging> {
        // Drop frees whatever was made when a later step fails.
        let mut s = Staging {
            bufs: [std::ptr::null_mut(); 2],
            done: [std::ptr::null_mut(); 2],
            used: [false; 2],
        };
        for b in 0..2 {
            // SAFETY: a fresh pinned allocation, freed in Drop.
            s.bufs[b] = unsafe { dr::malloc_host(CHUNK, 0) }
                .ctx(|| format!("pinning {CHUNK} bytes of host memory"))?
                as *mut u8;
            s.done[b] = dr::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .ctx(|| "cuEventCreate".into())?;
        }
        Ok(s)
    }

    /// Copies `src` to device address `dst` on `stream` and waits for it.
    pub fn upload(&mut self, stream: sys::CUstream, dst: u64, src: &[u8]) -> DResult<()> {
        for (i, chunk) in src.chunks(CHUNK).enumerate() {
            let b = i % 2;
            if self.used[b] {
                // SAFETY: recorded below on this stream; not destroyed until Drop.
                unsafe { dr::event::synchronize(self.done[b]) }
                    .ctx(|| "waiting for a staging buffer".into())?;
            }
            // SAFETY: bufs[b] holds CHUNK bytes and no DMA reads it now (waited above).
            let pinned = unsafe { std::slice::from_raw_parts_mut(self.bufs[b], chunk.len()) };
            parallel_copy(chunk, pinned);
            // SAFETY: dst + offset has room (the caller sized the buffer for src); the pinned
            // source stays untouched until the event recorded next has fired.
            unsafe {
                dr::memcpy_htod_async(dst + (i * CHUNK) as u64, &*pinned, stream)
                    .ctx(|| format!("uploading {} bytes (staged)", chunk.len()))?;
                dr::event::record(self.done[b], stream).ctx(|| "cuEventRecord".into())?;
            }
            self.used[b] = true;
        }
        for b in 0..2 {
            if std::mem::take(&mut self.used[b]) {
                // SAFETY: as above.
                unsafe { dr::event::synchronize(self.done[b]) }
                    .ctx(|| "waiting for a staging buffer".into())?;
            }
        }
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        for b in 0..2 {
            // SAFETY: created in new(); every DMA was waited for before upload() returned.
            unsafe {
                if !self.bufs[b].is_null() {
                    let _ = dr::free_host(self.bufs[b] as *mut c_void);
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
