//! The device as the rest of the backend sees it: one context, one stream, raw allocations
//! with byte accounting, copies, kernel launches and events.
//!
//! Buffers are addressed by raw device pointers (`u64`) once allocated: kernels take pointers,
//! graph capture copies launch parameters, and nothing here tracks events per buffer (cudarc's
//! event tracking is switched off: everything runs in order on one stream).

pub use super::error::{Ctx, DResult, DevError};
pub use super::func::Func;
pub use super::staging::PinnedBuf;
use super::staging::Staging;
use crate::facade::devices::MemStats;
use cudarc::driver::{result as dr, sys, CudaContext, CudaSlice, CudaStream, DevicePtr};
use std::ffi::c_void;
use std::sync::Arc;

/// A device allocation; freed on drop (and un-counted from `resident`).
pub struct DBuf {
    slice: CudaSlice<u8>,
    ptr: u64,
    stats: Arc<MemStats>,
}

impl DBuf {
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    pub fn len(&self) -> usize {
        self.slice.len()
    }
    pub fn is_empty(&self) -> bool {
        self.slice.is_empty()
    }
    /// Pointer `off` bytes in.
    pub fn at(&self, off: usize) -> u64 {
        debug_assert!(off <= self.len());
        self.ptr + off as u64
    }
}

impl Drop for DBuf {
    fn drop(&mut self) {
        self.stats.sub_resident(self.slice.len() as u64);
    }
}

/// One kernel argument. Each occupies an 8-byte slot; the driver reads `sizeof(param)` bytes
/// from the slot's start, which on little-endian hosts is the value for 4-byte params too.
/// Structs passed by value use [`Arg::Bytes`].
#[derive(Debug, Clone)]
pub enum Arg {
    Ptr(u64),
    I32(i32),
    F32(f32),
    U64(u64),
    Bytes(Vec<u8>),
}

pub struct Dev {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub stats: Arc<MemStats>,
    pub name: String,
    pub ordinal: usize,
    pub count: usize,
    /// (major, minor) compute capability.
    pub cc: (i32, i32),
    pub sm_count: u32,
    pub total_bytes: u64,
    /// Idle staging buffer sets (pinned): each uploading thread takes one, a new one if none is
    /// idle, so concurrent loaders (the text encoder, the DiT, the VAE) copy in parallel. When
    /// pinned memory cannot be had the upload falls back to the plain copy (and the next one
    /// tries again).
    staging: std::sync::Mutex<Vec<Staging>>,
}

impl Dev {
    /// Opens device `ordinal`. Never panics when the driver library is missing: that is
    /// checked first and reported as an error.
    pub fn open(ordinal: usize) -> Result<Dev, String> {
        // SAFETY: only tries to dlopen libcuda; no symbol is called.
        if !unsafe { sys::is_culib_present() } {
            return Err("libcuda (the NVIDIA driver library) is not installed".into());
        }
        let count = CudaContext::device_count().map_err(|e| format!("cuDeviceGetCount: {e:?}"))?;
        if count <= 0 {
            return Err("the driver reports no CUDA device".into());
        }
        if ordinal >= count as usize {
            return Err(format!("device {ordinal} requested, {count} present"));
        }
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| format!("creating a context on device {ordinal}: {e:?}"))?;
        // SAFETY: every buffer is used on the one stream below, in order; no cross-stream
        // synchronisation is needed, and graph capture must not see event records.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx
            .new_stream()
            .map_err(|e| format!("creating a stream: {e:?}"))?;
        let name = ctx.name().unwrap_or_else(|_| "CUDA device".into());
        let cc = ctx
            .compute_capability()
            .map_err(|e| format!("compute capability: {e:?}"))?;
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| format!("SM count: {e:?}"))? as u32;
        let total_bytes = ctx
            .total_mem()
            .map_err(|e| format!("total memory: {e:?}"))? as u64;
        Ok(Dev {
            ctx,
            stream,
            stats: Arc::new(MemStats::default()),
            name,
            ordinal,
            count: count as usize,
            cc,
            sm_count,
            total_bytes,
            staging: std::sync::Mutex::new(Vec::new()),
        })
    }

    /// The NVRTC target: `sm_90` on Hopper (the kernels use no sm_90a-only instruction).
    pub fn arch(&self) -> String {
        format!("sm_{}{}", self.cc.0, self.cc.1)
    }

    /// The arch-specific target where the device has one we use: `sm_90a` (wgmma) on Hopper.
    pub fn arch_specific(&self) -> Option<String> {
        (self.cc == (9, 0)).then(|| "sm_90a".to_string())
    }

    pub fn free_bytes(&self) -> u64 {
        self.ctx
            .mem_get_info()
            .map(|(free, _)| free as u64)
            .unwrap_or(0)
    }

    /// An uninitialised buffer of `bytes` (at least 1).
    pub fn alloc(&self, bytes: usize) -> DResult<DBuf> {
        let n = bytes.max(1);
        // SAFETY: the memory is uninitialised; every user writes before reading, or zeroes it.
        let slice = unsafe { self.stream.alloc::<u8>(n) }
            .ctx(|| format!("allocating {n} bytes on the device"))?;
        let ptr = {
            let (ptr, _sync) = slice.device_ptr(&self.stream);
            ptr
        };
        self.stats.add_resident(n as u64);
        Ok(DBuf {
            ptr,
            slice,
            stats: self.stats.clone(),
        })
    }

    /// A zeroed buffer.
    pub fn alloc_zeroed(&self, bytes: usize) -> DResult<DBuf> {
        let b = self.alloc(bytes)?;
        self.memset0(b.ptr(), b.len())?;
        Ok(b)
    }

    pub fn memset0(&self, ptr: u64, bytes: usize) -> DResult<()> {
        // SAFETY: ptr..ptr+bytes lies inside one of our allocations (callers pass DBuf ranges).
        unsafe { dr::memset_d8_async(ptr, 0, bytes, self.stream.cu_stream()) }
            .ctx(|| "cuMemsetD8Async".into())
    }

    /// Device → device, ordered on the stream.
    pub fn copy_d2d(&self, dst: u64, src: u64, bytes: usize) -> DResult<()> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: both ranges lie inside our allocations (callers pass DBuf ranges).
        unsafe { dr::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }
            .ctx(|| format!("copying {bytes} bytes on the device"))
    }

    /// Host → device in stream order; `src` may be dropped once this returns. Counted as
    /// uploaded. The copy goes through pinned staging buffers and returns before its DMA
    /// finishes (staging.rs); only where pinned memory cannot be had is it a plain copy,
    /// waited for. Refused inside a graph capture (a captured copy would read the staging
    /// buffer at replay).
    pub fn upload(&self, dst: u64, src: &[u8]) -> DResult<()> {
        if src.is_empty() {
            return Ok(());
        }
        let capturing = self
            .stream
            .capture_status()
            .map_err(|e| DevError(format!("cuStreamIsCapturing: {e:?}")))?;
        if capturing != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
            return Err(DevError(format!(
                "an upload of {} bytes inside a graph capture",
                src.len()
            )));
        }
        if self.upload_staged(dst, src)? {
            self.stats.add_uploaded(src.len() as u64);
            return Ok(());
        }
        // SAFETY: dst has room for src.len() bytes (callers size their buffers). The copy is
        // ordered on our (non-blocking) stream and waited for, so `src` may be freed afterwards.
        unsafe { dr::memcpy_htod_async(dst, src, self.stream.cu_stream()) }
            .ctx(|| format!("uploading {} bytes", src.len()))?;
        self.sync()?;
        self.stats.add_uploaded(src.len() as u64);
        Ok(())
    }

    /// Uploads through the staging buffers; false when pinned memory cannot be had (the
    /// caller copies the plain way).
    fn upload_staged(&self, dst: u64, src: &[u8]) -> DResult<bool> {
        let idle = self.staging.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let mut staging = match idle {
            Some(s) => s,
            None => match Staging::new() {
                Ok(s) => s,
                Err(e) => {
                    crate::facade::log::debug(&format!("plain uploads: {}", e.0));
                    return Ok(false);
                }
            },
        };
        // The copies are queued on our stream, behind any work that still reads `dst`.
        let r = staging.upload(self.stream.cu_stream(), dst, src);
        self.staging
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(staging);
        r.map(|()| true)
    }

    /// Makes the context current on the calling thread: every entry that may run on a thread
    /// of its own (loaders, handle set-up, the pipeline's preload) calls it first.
    pub fn bind_to_thread(&self) -> DResult<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| DevError(format!("binding the context: {e:?}")))
    }

    /// Threads a model loader uploads on ([`Dev::each_parallel`]). The Z-Image text encoder
    /// and DiT (10.4 GB) uploaded in 0.65–0.67 s on 4 each with 8 MiB rings, 0.69–0.72 on 2
    /// with 16 MiB, 0.81–0.84 on 1 with 32 MiB (H200, 2026-12-02); 8 were slower.
    pub const LOADER_THREADS: usize = 4;

    /// `f` over `items` on up to `threads` threads of their own, each with the context bound,
    /// taking the next item as they finish one; the results in `items`' order, or the error of
    /// the first item that failed (the others stop taking items then). Model loaders use it so
    /// that several weights are in flight at once: each thread's uploads fill a staging set of
    /// their own (staging.rs) while the others' DMAs and dequantisation run.
    pub fn each_parallel<I: Sync, T: Send>(
        &self,
        items: &[I],
        threads: usize,
        f: impl Fn(&I) -> DResult<T> + Sync,
    ) -> DResult<Vec<T>> {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
        let threads = threads.clamp(1, items.len().max(1));
        if threads == 1 {
            return items.iter().map(f).collect();
        }
        let (next, stop) = (AtomicUsize::new(0), AtomicBool::new(false));
        let work = || -> Vec<(usize, DResult<T>)> {
            if let Err(e) = self.bind_to_thread() {
                stop.store(true, Relaxed);
                return vec![(0, Err(e))];
            }
            let mut done = Vec::new();
            while !stop.load(Relaxed) {
                let i = next.fetch_add(1, Relaxed);
                let Some(item) = items.get(i) else { break };
                let r = f(item);
                if r.is_err() {
                    stop.store(true, Relaxed);
                }
                done.push((i, r));
            }
            done
        };
        let mut results: Vec<(usize, DResult<T>)> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads).map(|_| s.spawn(work)).collect();
            handles
                .into_iter()
                .flat_map(|h| {
                    h.join().unwrap_or_else(|_| {
                        vec![(0, Err(DevError("a loader thread panicked".into())))]
                    })
                })
                .collect()
        });
        // Items are taken in order, so in item order the first error is the first item's that
        // failed (a thread that could not bind reports item 0).
        results.sort_by_key(|(i, _)| *i);
        results.into_iter().map(|(_, r)| r).collect()
    }

    /// Uploads `src` into a new buffer.
    pub fn upload_new(&self, src: &[u8]) -> DResult<DBuf> {
        let b = self.alloc(src.len())?;
        self.upload(b.ptr(), src)?;
        Ok(b)
    }

    pub fn upload_f32(&self, dst: u64, src: &[f32]) -> DResult<()> {
        self.upload(dst, bytes_of(src))
    }

    /// Device → host after the stream's work so far; counted as downloaded.
    pub fn download(&self, dst: &mut [u8], src: u64) -> DResult<()> {
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: src holds dst.len() bytes; the copy is waited for before `dst` is returned.
        unsafe { dr::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }
            .ctx(|| format!("downloading {} bytes", dst.len()))?;
        self.sync()?;
        self.stats.add_downloaded(dst.len() as u64);
        Ok(())
    }

    pub fn download_f32(&self, dst: &mut [f32], src: u64) -> DResult<()> {
        // SAFETY: f32 has no invalid bit patterns; the byte view covers exactly `dst`.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(dst.as_mut_ptr() as *mut u8, std::mem::size_of_val(dst))
        };
        self.download(bytes, src)
    }

    /// `n` bf16 values at `src`, widened to f32 (test hooks and probes read kernel outputs so).
    pub fn download_bf16(&self, src: u64, n: usize) -> DResult<Vec<f32>> {
        let mut raw = vec![0u8; 2 * n];
        self.download(&mut raw, src)?;
        Ok(raw
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect())
    }

    pub fn sync(&self) -> DResult<()> {
        self.stream
            .synchronize()
            .ctx(|| "synchronising the stream".into())
    }

    /// Launches `f` on the stream.
    pub fn launch(
        &self,
        f: &Func,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        args: &[Arg],
    ) -> DResult<()> {
        self.launch_ex(f, grid, block, smem, args, false)
    }

    /// Launches `f`, with programmatic dependent launch when `pdl`: the kernel may start
    /// before its predecessor on the stream finishes, and must `pdl_wait()` (common.cuh)
    /// before reading what the predecessor wrote.
    pub fn launch_ex(
        &self,
        f: &Func,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        args: &[Arg],
        pdl: bool,
    ) -> DResult<()> {
        let mut slots: Vec<u64> = Vec::with_capacity(args.len());
        let mut blobs: Vec<Vec<u64>> = Vec::new();
        for a in args {
            slots.push(match a {
                Arg::Ptr(p) | Arg::U64(p) => *p,
                Arg::I32(v) => *v as u32 as u64,
                Arg::F32(v) => v.to_bits() as u64,
                Arg::Bytes(b) => {
                    // 8-aligned copy of the struct bytes; the slot is unused.
                    let mut words = vec![0u64; b.len().div_ceil(8)];
                    // SAFETY: words has at least b.len() bytes.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            b.as_ptr(),
                            words.as_mut_ptr() as *mut u8,
                            b.len(),
                        )
                    };
                    blobs.push(words);
                    0
                }
            });
        }
        let mut blob_i = 0;
        let mut params: Vec<*mut c_void> = Vec::with_capacity(args.len());
        for (i, a) in args.iter().enumerate() {
            params.push(match a {
                Arg::Bytes(_) => {
                    let p = blobs[blob_i].as_mut_ptr() as *mut c_void;
                    blob_i += 1;
                    p
                }
                _ => &mut slots[i] as *mut u64 as *mut c_void,
            });
        }
        let what = || format!("launching a kernel grid {grid:?} block {block:?}");
        if !pdl {
            // SAFETY: params point to live slots/blobs of the sizes the kernel signature
            // expects (each call site pairs a kernel with its argument list).
            return unsafe {
                dr::launch_kernel(
                    f.raw,
                    grid,
                    block,
                    smem,
                    self.stream.cu_stream(),
                    &mut params,
                )
            }
            .ctx(what);
        }
        // SAFETY: a zeroed attribute union is valid; we set the one field the id selects.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block.0,
            blockDimY: block.1,
            blockDimZ: block.2,
            sharedMemBytes: smem,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        // SAFETY: as above; cfg and attr outlive the call.
        unsafe { sys::cuLaunchKernelEx(&cfg, f.raw, params.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
            .ctx(what)
    }
}

/// A captured CUDA graph, instantiated and uploaded. cudarc's holds raw handles; its owner (a
/// model) is used by one thread at a time.
pub struct Graph(cudarc::driver::CudaGraph);
// SAFETY: see above; the models' device methods take &mut self, so a graph is never used
// concurrently.
unsafe impl Send for Graph {}

impl Graph {
    /// Replays the graph on the stream it was captured from.
    pub fn launch(&self) -> DResult<()> {
        self.0
            .launch()
            .map_err(|e| DevError(format!("graph launch: {e:?}")))
    }
}

impl Dev {
    /// Captures what `enqueue` puts on the stream (thread-local capture mode) as a graph, which
    /// then runs only when launched. The capture ends whether `enqueue` succeeds or not.
    ///
    /// A capture that another thread's work invalidated (an implicitly synchronising call on the
    /// same context, such as freeing pinned memory, while this thread captures: seen once in the
    /// GPU parity tests, whose models load and capture on parallel threads) is taken again, up
    /// to [`CAPTURE_ATTEMPTS`] times: nothing captured has run, so `enqueue` can simply repeat.
    pub fn capture(&self, enqueue: impl Fn() -> DResult<()>) -> DResult<Graph> {
        let mut attempt = 1;
        loop {
            match self.capture_once(&enqueue) {
                Err(e) if attempt < CAPTURE_ATTEMPTS && e.0.contains("CAPTURE_INVALIDATED") => {
                    crate::facade::log::debug(&format!(
                        "graph capture {attempt} invalidated, capturing again: {}",
                        e.0
                    ));
                    attempt += 1;
                }
                r => return r,
            }
        }
    }

    fn capture_once(&self, enqueue: &impl Fn() -> DResult<()>) -> DResult<Graph> {
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| DevError(format!("begin graph capture: {e:?}")))?;
        let enq = enqueue();
        let graph = self.stream.end_capture(sys::CUgraphInstantiate_flags(0));
        enq?;
        match graph {
            Ok(Some(g)) => {
                g.upload()
                    .map_err(|e| DevError(format!("graph upload: {e:?}")))?;
                Ok(Graph(g))
            }
            Ok(None) => Err(DevError("graph capture produced no graph".into())),
            Err(e) => Err(DevError(format!("end graph capture: {e:?}"))),
        }
    }
}

/// How many times [`Dev::capture`] tries a capture that was invalidated from outside.
const CAPTURE_ATTEMPTS: usize = 3;

/// Fills `dst` from little-endian f32 bytes (a readback through a pinned byte buffer).
pub fn f32s_from_le_bytes(dst: &mut [f32], src: &[u8]) {
    for (v, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
        *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}

/// A 1-D grid of `ceil(n / per_block)` blocks, clamped to 1 ..= 65535 (grid-stride kernels).
pub fn grid1(n: usize, per_block: usize) -> (u32, u32, u32) {
    (n.div_ceil(per_block).clamp(1, 65535) as u32, 1, 1)
}

/// The bytes of a plain-old-data slice.
pub fn bytes_of<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: callers use this for f32/u16/u32/i32 slices, which have no padding.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

/// A pair of events around a region of the stream (device-side timing).
pub struct Timer {
    start: sys::CUevent,
    end: sys::CUevent,
}

impl Timer {
    pub fn new() -> DResult<Timer> {
        let flags = sys::CUevent_flags::CU_EVENT_DEFAULT;
        let start = dr::event::create(flags).ctx(|| "cuEventCreate".into())?;
        let end = dr::event::create(flags).ctx(|| "cuEventCreate".into())?;
        Ok(Timer { start, end })
    }
    pub fn start(&self, dev: &Dev) -> DResult<()> {
        // SAFETY: the event and stream are live.
        unsafe { dr::event::record(self.start, dev.stream.cu_stream()) }
            .ctx(|| "cuEventRecord".into())
    }
    /// Records the end (see [`Timer::elapsed_ms`]).
    pub fn stop(&self, dev: &Dev) -> DResult<()> {
        // SAFETY: the event and stream are live.
        unsafe { dr::event::record(self.end, dev.stream.cu_stream()) }
            .ctx(|| "cuEventRecord".into())
    }

    /// Waits for the end record and returns milliseconds between the two records.
    pub fn elapsed_ms(&self) -> DResult<f32> {
        // SAFETY: the events are live and both recorded.
        unsafe {
            dr::event::synchronize(self.end).ctx(|| "cuEventSynchronize".into())?;
            dr::event::elapsed(self.start, self.end).ctx(|| "cuEventElapsedTime".into())
        }
    }

    /// Records the end and returns milliseconds between the two records.
    pub fn stop_ms(&self, dev: &Dev) -> DResult<f32> {
        self.stop(dev)?;
        self.elapsed_ms()
    }

    /// Runs `work` once to warm up, then `reps` times (at least once) each between two records,
    /// and returns the median of those milliseconds. Synchronises after every run.
    pub fn median_ms(
        &self,
        dev: &Dev,
        reps: usize,
        mut work: impl FnMut() -> DResult<()>,
    ) -> DResult<f32> {
        work()?;
        let mut t = Vec::with_capacity(reps.max(1));
        for _ in 0..reps.max(1) {
            self.start(dev)?;
            work()?;
            t.push(self.stop_ms(dev)?);
        }
        t.sort_by(|a, b| a.total_cmp(b));
        Ok(t[t.len() / 2])
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        // SAFETY: created in new(), destroyed once.
        unsafe {
            let _ = dr::event::destroy(self.start);
            let _ = dr::event::destroy(self.end);
        }
    }
}
