//! Scoped switches that send work back to the CPU.
//!
//! - [`cpu_scope`]: while the guard lives, device entry points called *from this thread*
//!   refuse (nesting is counted). For code that must run on the CPU, e.g. a reference check.
//! - [`pause_gpu`]: while any guard lives, device entry points on *every thread* refuse. It is
//!   a counter, not a flag, so two independent pausers cannot un-pause each other.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

thread_local! {
    static CPU_SCOPE_DEPTH: Cell<usize> = const { Cell::new(0) };
}
static PAUSES: AtomicUsize = AtomicUsize::new(0);

/// Tests that create a pause, or that need none alive, hold this lock (pause is process-wide).
#[cfg(test)]
pub(crate) static TEST_PAUSE_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Keeps this thread's device entry points on the CPU until dropped.
#[must_use = "the scope ends when the guard is dropped"]
pub struct CpuScope {
    // Not Send: the guard must be dropped on the thread whose counter it raised.
    _not_send: std::marker::PhantomData<*const ()>,
}

pub fn cpu_scope() -> CpuScope {
    CPU_SCOPE_DEPTH.with(|d| d.set(d.get() + 1));
    CpuScope {
        _not_send: std::marker::PhantomData,
    }
}

impl Drop for CpuScope {
    fn drop(&mut self) {
        CPU_SCOPE_DEPTH.with(|d| d.set(d.get() - 1));
    }
}

/// Whether the calling thread is inside a [`cpu_scope`].
pub fn in_cpu_scope() -> bool {
    CPU_SCOPE_DEPTH.with(|d| d.get() > 0)
}

/// Pauses the device for the whole process until dropped.
#[must_use = "the pause ends when the guard is dropped"]
pub struct GpuPause(());

pub fn pause_gpu() -> GpuPause {
    PAUSES.fetch_add(1, Ordering::SeqCst);
    GpuPause(())
}

impl Drop for GpuPause {
    fn drop(&mut self) {
        PAUSES.fetch_sub(1, Ordering::SeqCst);
    }
}

/// How many [`pause_gpu`] guards are alive.
pub fn pause_count() -> usize {
    PAUSES.load(Ordering::SeqCst)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_scope_nests_and_is_per_thread() {
        assert!(!in_cpu_scope());
        let a = cpu_scope();
        let b = cpu_scope();
        assert!(in_cpu_scope());
        std::thread::spawn(|| assert!(!in_cpu_scope()))
            .join()
            .unwrap();
        drop(a);
        assert!(in_cpu_scope());
        drop(b);
        assert!(!in_cpu_scope());
    }

    #[test]
    fn pause_is_counted() {
        let _lock = TEST_PAUSE_LOCK.lock().unwrap_or_else(|p| p.into_inner());
        let before = pause_count();
        let p1 = pause_gpu();
        let p2 = pause_gpu();
        assert!(pause_count() >= before + 2);
        drop(p1);
        assert!(pause_count() > before);
        drop(p2);
    }
}
