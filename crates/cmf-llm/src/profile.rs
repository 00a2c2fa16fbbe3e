//! Optional per-operation timing of the forward pass (diagnostics switch `CMF_LLM_PROFILE=1`).
//!
//! Each op accumulates wall time and the calling thread's CPU time. On a shared machine wall time
//! is inflated by other processes; with `--threads 1` the kernels run on the calling thread, so
//! its CPU time is the op's own cost whatever the load. Off by default: one relaxed atomic load
//! per op.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

#[derive(Clone, Copy, Debug)]
pub enum Op {
    Embed,
    Norm,
    Qkv,
    QkNormRope,
    Attention,
    OutProj,
    GateUp,
    Swiglu,
    Down,
    /// A MoE block: router, experts and shared expert.
    Experts,
    LmHead,
}

const OPS: [(Op, &str); 11] = [
    (Op::Embed, "embed"),
    (Op::Norm, "rmsnorm"),
    (Op::Qkv, "q/k/v proj"),
    (Op::QkNormRope, "qk-norm+rope"),
    (Op::Attention, "attention"),
    (Op::OutProj, "o proj"),
    (Op::GateUp, "gate/up proj"),
    (Op::Swiglu, "swiglu"),
    (Op::Down, "down proj"),
    (Op::Experts, "moe experts"),
    (Op::LmHead, "final norm+lm_head"),
];

static WALL: [AtomicU64; 11] = [const { AtomicU64::new(0) }; 11];
static CPU: [AtomicU64; 11] = [const { AtomicU64::new(0) }; 11];
static CALLS: [AtomicU64; 11] = [const { AtomicU64::new(0) }; 11];
static ENABLED: AtomicBool = AtomicBool::new(false);
static INIT: OnceLock<()> = OnceLock::new();

pub fn enabled() -> bool {
    INIT.get_or_init(|| {
        let on = std::env::var("CMF_LLM_PROFILE").is_ok_and(|v| !v.is_empty() && v != "0");
        ENABLED.store(on, Ordering::Relaxed);
    });
    ENABLED.load(Ordering::Relaxed)
}

/// Runs `f`, charging its time to `op` when profiling is on.
#[inline]
pub fn time<R>(op: Op, f: impl FnOnce() -> R) -> R {
    if !enabled() {
        return f();
    }
    let (w0, c0) = (Instant::now(), thread_cpu_ns());
    let r = f();
    let i = op as usize;
    WALL[i].fetch_add(w0.elapsed().as_nanos() as u64, Ordering::Relaxed);
    CPU[i].fetch_add(thread_cpu_ns().saturating_sub(c0), Ordering::Relaxed);
    CALLS[i].fetch_add(1, Ordering::Relaxed);
    r
}

/// Clears the counters.
pub fn reset() {
    for i in 0..OPS.len() {
        WALL[i].store(0, Ordering::Relaxed);
        CPU[i].store(0, Ordering::Relaxed);
        CALLS[i].store(0, Ordering::Relaxed);
    }
}

/// A table of the counters (ms and share of the total), or None when profiling is off.
pub fn report() -> Option<String> {
    if !enabled() {
        return None;
    }
    let total_w: u64 = WALL.iter().map(|a| a.load(Ordering::Relaxed)).sum();
    let total_c: u64 = CPU.iter().map(|a| a.load(Ordering::Relaxed)).sum();
    let mut s = format!(
        "{:<20} {:>10} {:>11} {:>6} {:>12} {:>6}\n",
        "op", "calls", "wall ms", "%", "thread-CPU ms", "%"
    );
    for (i, (_, name)) in OPS.iter().enumerate() {
        let (w, c, n) = (
            WALL[i].load(Ordering::Relaxed),
            CPU[i].load(Ordering::Relaxed),
            CALLS[i].load(Ordering::Relaxed),
        );
        let pct = |x: u64, t: u64| 100.0 * x as f64 / t.max(1) as f64;
        s += &format!(
            "{name:<20} {n:>10} {:>11.1} {:>6.1} {:>12.1} {:>6.1}\n",
            w as f64 / 1e6,
            pct(w, total_w),
            c as f64 / 1e6,
            pct(c, total_c)
        );
    }
    s += &format!(
        "{:<20} {:>10} {:>11.1} {:>6} {:>12.1}\n",
        "total",
        "",
        total_w as f64 / 1e6,
        "",
        total_c as f64 / 1e6
    );
    Some(s)
}

fn thread_cpu_ns() -> u64 {
    #[cfg(unix)]
    {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes one timespec; CLOCK_THREAD_CPUTIME_ID is always valid.
        let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        if rc == 0 {
            return ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64;
        }
    }
    0
}
