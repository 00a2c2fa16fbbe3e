//! Host → device copies through pinned staging buffers.
//!
//! A copy from pageable memory (a memory-mapped model file) runs at a fraction of the link's
//! rate: the driver stages it itself, one thread faults the source pages in, nothing overlaps,
//! and it may wait for the stream's earlier work first. Here the bytes are copied into two
//! pinned buffers used as a ring (large pieces by several threads, on rayon's pool) and sent
//! from there by the DMA engine, asynchronously: an upload returns once its bytes sit in pinned
//! memory, so the next one's host copy overlaps this one's DMA, and a model's many weights
//! stream without a wait between them. A buffer is reused only after its last DMA finished (one
//! event per buffer). Each uploading thread takes a ring of its own (`Dev`'s pool), so
//! concurrent loaders fill in parallel. When pinned memory cannot be had, the caller falls back
//! to the plain copy.
//!
//! Bytes that lie in a mapped model file are read into the pinned buffer with `pread`
//! (`cmf_format::mapped`) rather than copied out of the map: as fast on the H200's host, and
//! the process does not map (and count in its resident set) gigabytes of weights it only
//! passes through.
//!
//! Sizes (H200, 2026-12-02): with four loader threads a model, rings of 8 MiB buffers
//! uploaded the Z-Image text encoder and DiT in 0.65–0.67 s, of 16 MiB in 0.70–0.78, of 32 MiB
//! in 0.77–0.95: pinning many large buffers at once holds the driver, and the other threads'
//! copy calls wait behind it.

use super::error::{Ctx, DResult};
use cudarc::driver::{result as dr, sys};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

/// Page-locked host memory: device → host copies into it run at the link's rate, where a copy
/// into pageable memory goes through the driver's own staging (a DiT step's 1 MB readback took
/// 0.35–0.8 ms so).
pub struct PinnedBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a plain host allocation owned by this value; `&mut self` guards every write.
unsafe impl Send for PinnedBuf {}

impl PinnedBuf {
    pub fn new(len: usize) -> DResult<PinnedBuf> {
        let n = len.max(1);
        // SAFETY: a fresh pinned allocation of n bytes, freed in Drop.
        let ptr = unsafe { dr::malloc_host(n, 0) }
            .ctx(|| format!("pinning {n} bytes of host memory"))? as *mut u8;
        Ok(PinnedBuf { ptr, len })
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: ptr holds len bytes, exclusively borrowed here.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in new(); every copy into it was waited for (Dev::download).
        unsafe {
            let _ = dr::free_host(self.ptr as *mut std::ffi::c_void);
        }
    }
}

/// Bytes per staging buffer (two in a ring).
const CHUNK: usize = 8 << 20;
/// Pieces at least this large are filled by several threads.
const PARALLEL_MIN: usize = 2 << 20;

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
        let t = Instant::now();
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
        add_since(&TOTALS.pin_ns, t);
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
                let t = Instant::now();
                unsafe { dr::event::synchronize(self.done[b]) }
                    .ctx(|| "waiting for a staging buffer".into())?;
                add_since(&TOTALS.wait_ns, t);
            }
            let n = (CHUNK - self.off).min(src.len() - done);
            let piece = &src[done..done + n];
            // off..off + n is past every byte a pending DMA of this buffer reads (the ring only
            // restarts a buffer after waiting for it).
            let pinned = &mut self.bufs[b].bytes_mut()[self.off..self.off + n];
            let t = Instant::now();
            fill(piece, pinned);
            add_since(&TOTALS.fill_ns, t);
            TOTALS.bytes.fetch_add(n as u64, Relaxed);
            // SAFETY: dst + done has room (the caller sized the buffer for src); the pinned
            // bytes stay untouched until the event recorded next has fired.
            let t = Instant::now();
            unsafe {
                dr::memcpy_htod_async(dst + done as u64, &*pinned, stream)
                    .ctx(|| format!("uploading {n} bytes (staged)"))?;
                dr::event::record(self.done[b], stream).ctx(|| "cuEventRecord".into())?;
            }
            add_since(&TOTALS.enqueue_ns, t);
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

/// What the staged uploads of this process have done so far (all threads together).
struct Totals {
    bytes: AtomicU64,
    /// Bytes of those that were read from a file rather than copied out of memory.
    read_bytes: AtomicU64,
    /// Filling pinned buffers (reads or copies).
    fill_ns: AtomicU64,
    /// Waiting for a buffer's DMA to finish before refilling it.
    wait_ns: AtomicU64,
    /// Pinning the rings' buffers.
    pin_ns: AtomicU64,
    /// In the driver's copy and event calls.
    enqueue_ns: AtomicU64,
}

static TOTALS: Totals = Totals {
    bytes: AtomicU64::new(0),
    read_bytes: AtomicU64::new(0),
    fill_ns: AtomicU64::new(0),
    wait_ns: AtomicU64::new(0),
    pin_ns: AtomicU64::new(0),
    enqueue_ns: AtomicU64::new(0),
};

fn add_since(counter: &AtomicU64, since: Instant) {
    counter.fetch_add(since.elapsed().as_nanos() as u64, Relaxed);
}

/// One line on the staged uploads so far, for the debug log (times summed over threads).
pub fn report() -> String {
    let gb = |b: &AtomicU64| b.load(Relaxed) as f64 / 1e9;
    let s = |ns: &AtomicU64| ns.load(Relaxed) as f64 / 1e9;
    let (bytes, fill) = (gb(&TOTALS.bytes), s(&TOTALS.fill_ns));
    format!(
        "staged uploads so far: {bytes:.2} GB ({:.2} GB read from the file); thread-seconds \
         filling pinned buffers {fill:.2} ({:.1} GB/s), waiting for DMAs {:.2}, pinning {:.2}, \
         in the driver's copy calls {:.2}",
        gb(&TOTALS.read_bytes),
        if fill > 0.0 { bytes / fill } else { 0.0 },
        s(&TOTALS.wait_ns),
        s(&TOTALS.pin_ns),
        s(&TOTALS.enqueue_ns),
    )
}

/// Fills `dst` with `src`: read from the file that holds `src` when it is a mapped model file,
/// else copied; large pieces split over rayon's threads.
fn fill(src: &[u8], dst: &mut [u8]) {
    let file = cmf_format::mapped::file_range(src);
    let one = |s: &[u8], d: &mut [u8], at: usize| {
        let read = file
            .as_ref()
            .is_some_and(|(f, off)| read_at(f, d, off + at as u64));
        if read {
            TOTALS.read_bytes.fetch_add(d.len() as u64, Relaxed);
        } else {
            d.copy_from_slice(s);
        }
    };
    if src.len() < PARALLEL_MIN {
        one(src, dst, 0);
        return;
    }
    use rayon::prelude::*;
    let part = src.len().div_ceil(8);
    dst.par_chunks_mut(part)
        .zip(src.par_chunks(part))
        .enumerate()
        .for_each(|(i, (d, c))| one(c, d, i * part));
}

/// `pread` of exactly `dst.len()` bytes at `off`; false on any error (the caller copies instead).
#[cfg(unix)]
fn read_at(f: &std::fs::File, dst: &mut [u8], off: u64) -> bool {
    use std::os::unix::fs::FileExt;
    f.read_exact_at(dst, off).is_ok()
}

#[cfg(not(unix))]
fn read_at(_: &std::fs::File, _: &mut [u8], _: u64) -> bool {
    false
}

#[cfg(test)]
mod tests {
    #[test]
    fn fill_copies_every_byte() {
        let src: Vec<u8> = (0..(5 << 20) + 123).map(|i| (i * 7 % 251) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        super::fill(&src, &mut dst);
        assert!(src == dst);
    }

    #[test]
    fn fill_reads_a_mapped_file_in_parallel_pieces() {
        use cmf_format::{Arch, CmfFile, CmfWriter, Dtype, Header, QuantType};
        use std::sync::atomic::Ordering::Relaxed;
        let dir = tempfile::tempdir().unwrap();
        let arch = Arch {
            arch_name: "llama".into(),
            ..Arch::default()
        };
        let mut w =
            CmfWriter::create(dir.path().join("t.cmf"), Header::new(arch, QuantType::F32)).unwrap();
        let values: Vec<f32> = (0..(9 << 18) + 77).map(|i| (i % 1013) as f32).collect();
        w.add_f32("t", Dtype::F32, &[values.len()], &values)
            .unwrap();
        let file = CmfFile::open(w.finish().unwrap()).unwrap();
        let src = file.get("t").unwrap().data;
        let before = super::TOTALS.read_bytes.load(Relaxed);
        let mut dst = vec![0u8; src.len() - 5];
        super::fill(&src[5..], &mut dst);
        assert!(dst == src[5..]);
        assert!(super::TOTALS.read_bytes.load(Relaxed) - before >= dst.len() as u64);
    }
}
