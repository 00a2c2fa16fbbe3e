//! The contention guard: when another process shares the card, device operations slow down by
//! whole multiples (time slicing) and the CPU may well be faster. After [`STRIKES`] device
//! operations in a row run over their time budget, the guard trips and every entry point
//! refuses from then on ([`RefusalReason::Contended`](super::RefusalReason::Contended)), so
//! the rest of the process runs on the CPU.
//!
//! An operation's budget comes from its own history: operations are grouped by entry point and
//! size class (work units rounded up to a power of two), the first call of a group (cold:
//! compilation, allocation, graph capture) is not counted, and the budget is [`FACTOR`] times
//! the group's fastest call, but never less than the fastest plus [`FLOOR`] (so microsecond
//! operations do not trip on scheduler noise). A call within budget resets the count.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// Over-budget operations in a row that trip the guard.
pub const STRIKES: u32 = 3;
/// An operation is over budget when it takes more than this many times its group's best...
pub const FACTOR: u32 = 4;
/// ...and more than the best plus this.
pub const FLOOR: Duration = Duration::from_millis(20);

#[derive(Debug, Default)]
struct Group {
    calls: u64,
    best: Option<Duration>,
}

#[derive(Debug, Default)]
pub struct ContentionGuard {
    groups: Mutex<HashMap<(&'static str, u32), Group>>,
    strikes: AtomicU32,
    tripped: AtomicBool,
}

impl ContentionGuard {
    /// Whether the guard has tripped (the device is no longer used).
    pub fn tripped(&self) -> bool {
        self.tripped.load(Ordering::Relaxed)
    }

    /// Records a device operation that succeeded in `took` over `units` of work (tokens,
    /// patches, pixels: whatever sizes the entry point). Returns true when this call tripped
    /// the guard.
    pub fn observe(&self, op: &'static str, units: usize, took: Duration) -> bool {
        if self.tripped() {
            return false;
        }
        let class = units.max(1).next_power_of_two().trailing_zeros();
        let over = {
            let mut groups = self.groups.lock().unwrap_or_else(|p| p.into_inner());
            let g = groups.entry((op, class)).or_default();
            g.calls += 1;
            match (g.calls, g.best) {
                (1, _) => return false, // cold
                (_, None) => {
                    g.best = Some(took);
                    false
                }
                (_, Some(best)) => {
                    let over = took > best * FACTOR && took > best + FLOOR;
                    if !over {
                        g.best = Some(best.min(took));
                    }
                    over
                }
            }
        };
        if !over {
            self.strikes.store(0, Ordering::Relaxed);
            return false;
        }
        let strikes = self.strikes.fetch_add(1, Ordering::Relaxed) + 1;
        if strikes >= STRIKES && !self.tripped.swap(true, Ordering::Relaxed) {
            super::log::warn(&format!(
                "the GPU looks contended ({strikes} operations in a row took over {FACTOR}x \
                 their usual time, the last `{op}` {:.1} ms): running on the CPU from now on",
                took.as_secs_f64() * 1e3
            ));
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn trips_after_three_slow_operations_in_a_row() {
        let g = ContentionGuard::default();
        assert!(
            !g.observe("llm.decode", 1, 900 * MS),
            "the cold call is not counted"
        );
        for _ in 0..5 {
            assert!(!g.observe("llm.decode", 1, 2 * MS));
        }
        assert!(!g.observe("llm.decode", 1, 50 * MS));
        assert!(!g.observe("llm.decode", 1, 50 * MS));
        assert!(!g.tripped());
        assert!(g.observe("llm.decode", 1, 50 * MS));
        assert!(g.tripped());
    }

    #[test]
    fn a_fast_operation_resets_the_count() {
        let g = ContentionGuard::default();
        for _ in 0..3 {
            g.observe("llm.decode", 1, 2 * MS);
        }
        for _ in 0..10 {
            g.observe("llm.decode", 1, 50 * MS);
            g.observe("llm.decode", 1, 50 * MS);
            g.observe("llm.decode", 1, 3 * MS);
        }
        assert!(!g.tripped());
    }

    #[test]
    fn budgets_are_per_operation_and_size_class() {
        let g = ContentionGuard::default();
        for _ in 0..3 {
            g.observe("llm.prefill", 8, 2 * MS);
            g.observe("llm.prefill", 4096, 300 * MS);
        }
        // A long prefill is not judged by a short one's time, nor is noise under the floor.
        for _ in 0..5 {
            g.observe("llm.prefill", 4000, 310 * MS);
            g.observe("llm.prefill", 8, 12 * MS);
        }
        assert!(!g.tripped());
    }
}
