//! Debug logging for the facade: one line to stderr, only when asked for.
//!
//! Verbosity comes from `CMF_LOG` (`debug` or `trace` turn it on; read once) or from
//! [`set_debug`], which the CLI calls for `-v`. No logging framework: the engine has none, and
//! the facade logs a handful of lines per process at most. Each line carries the seconds since
//! [`mark_start`] (the CLI calls it first thing; else the first line's time), so a cold run's
//! timeline can be read from the log.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

static START: OnceLock<Instant> = OnceLock::new();

/// Sets the zero of the debug lines' clock (the first call wins).
pub fn mark_start() {
    START.get_or_init(Instant::now);
}

const UNSET: u8 = 0;
const OFF: u8 = 1;
const ON: u8 = 2;
static DEBUG: AtomicU8 = AtomicU8::new(UNSET);

/// Turns debug lines on or off for the rest of the process (overrides `CMF_LOG`).
pub fn set_debug(on: bool) {
    DEBUG.store(if on { ON } else { OFF }, Ordering::Relaxed);
}

pub fn debug_enabled() -> bool {
    match DEBUG.load(Ordering::Relaxed) {
        ON => true,
        OFF => false,
        _ => {
            let on = std::env::var("CMF_LOG")
                .map(|v| v.contains("debug") || v.contains("trace"))
                .unwrap_or(false);
            // A racing set_debug wins over the environment.
            let _ = DEBUG.compare_exchange(
                UNSET,
                if on { ON } else { OFF },
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
            DEBUG.load(Ordering::Relaxed) == ON
        }
    }
}

/// Writes `cmf-gpu: [seconds] {msg}` to stderr at debug verbosity.
pub fn debug(msg: &str) {
    if debug_enabled() {
        let t = START.get_or_init(Instant::now).elapsed().as_secs_f64();
        eprintln!("cmf-gpu: [{t:7.3} s] {msg}");
    }
}

/// Writes `cmf-gpu: warning: {msg}` to stderr whatever the verbosity: for the few events a user
/// must hear about (the device given up for the rest of the process).
pub fn warn(msg: &str) {
    eprintln!("cmf-gpu: warning: {msg}");
}
