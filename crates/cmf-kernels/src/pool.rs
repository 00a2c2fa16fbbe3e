//! The crate's own rayon thread pool, so that kernel parallelism does not depend on (or disturb) the
//! global pool an application may use for other work.
//!
//! `set_num_threads(n)` replaces the pool; calls already running keep the pool they started with.

use std::sync::{Arc, RwLock};

use rayon::{ThreadPool, ThreadPoolBuilder};

struct Pool {
    threads: usize,
    pool: Arc<ThreadPool>,
}

static POOL: RwLock<Option<Pool>> = RwLock::new(None);

fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

fn build(threads: usize) -> Arc<ThreadPool> {
    let pool = ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("cmf-kernels-{i}"))
        .build()
        .expect("cmf-kernels: could not start the worker threads");
    Arc::new(pool)
}

/// Sets the number of worker threads the kernels use (0 = available parallelism).
pub fn set_num_threads(n: usize) {
    let threads = if n == 0 { default_threads() } else { n };
    let mut slot = POOL.write().unwrap_or_else(|e| e.into_inner());
    if slot.as_ref().map(|p| p.threads) != Some(threads) {
        *slot = Some(Pool {
            threads,
            pool: build(threads),
        });
    }
}

/// The number of worker threads the kernels use.
pub fn num_threads() -> usize {
    pool().current_num_threads()
}

/// Runs `f` on a thread of the kernels' pool. Kernels called inside split their work on the
/// pool directly instead of handing it over from an outside thread each time (a wake-up and a
/// blocking wait per call): a model's decode step calls hundreds of kernels per token.
pub fn run_in_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    pool().install(f)
}

/// The current pool (created with the default size on first use).
pub(crate) fn pool() -> Arc<ThreadPool> {
    if let Some(p) = POOL.read().unwrap_or_else(|e| e.into_inner()).as_ref() {
        return p.pool.clone();
    }
    let mut slot = POOL.write().unwrap_or_else(|e| e.into_inner());
    slot.get_or_insert_with(|| {
        let threads = default_threads();
        Pool {
            threads,
            pool: build(threads),
        }
    })
    .pool
    .clone()
}

/// Runs `f(i)` for every `i` in `0..tasks` on the pool; serially when there is one task or one
/// thread (no pool round trip for small work).
pub(crate) fn for_each_task(tasks: usize, f: impl Fn(usize) + Sync + Send) {
    if tasks == 0 {
        return;
    }
    let p = pool();
    if tasks == 1 || p.current_num_threads() == 1 {
        (0..tasks).for_each(f);
        return;
    }
    p.install(|| {
        use rayon::prelude::*;
        (0..tasks).into_par_iter().for_each(f)
    });
}

/// A raw pointer that may be sent to worker threads. Each task writes a disjoint range, which is
/// what makes sharing it sound; every use site states the range it owns.
#[derive(Clone, Copy)]
pub(crate) struct SendPtr<T>(pub *mut T);
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// The pointer (a method, so closures capture the `Send` wrapper rather than the raw field).
    pub(crate) fn ptr(&self) -> *mut T {
        self.0
    }

    /// # Safety
    /// `start..start+len` must lie inside the allocation and no other task may touch it meanwhile.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice(&self, start: usize, len: usize) -> &mut [T] {
        std::slice::from_raw_parts_mut(self.0.add(start), len)
    }
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `n` floats of this thread's reusable scratch, returned to the thread when dropped (pool threads
/// live as long as the pool, so per-call buffers stop costing an allocation and a zeroing pass).
/// The contents are stale: callers write before they read. A guard, not a closure, so that the
/// kernels using it stay inside their `#[target_feature]` function.
pub(crate) struct Scratch {
    buf: Vec<f32>,
    n: usize,
}

impl Scratch {
    pub(crate) fn new(n: usize) -> Scratch {
        let mut buf = SCRATCH.with(|c| c.take());
        if buf.len() < n {
            buf.resize(n, 0.0);
        }
        Scratch { buf, n }
    }

    pub(crate) fn get(&mut self) -> &mut [f32] {
        &mut self.buf[..self.n]
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.buf);
        SCRATCH.with(|c| {
            if c.borrow().len() < buf.len() {
                *c.borrow_mut() = buf;
            }
        });
    }
}
