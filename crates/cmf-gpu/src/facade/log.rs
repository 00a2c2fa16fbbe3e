//! Debug logging for the facade: one line to stderr, only when asked for.
//!
//! Verbosity comes from `CMF_LOG` (`debug` or `trace` turn it on; read once) or from
//! [`set_debug`], which the CLI calls for `-v`. No logging framework: the engine has none, and
//! the facade logs a handful of lines per process at most.

use std::sync::atomic::{AtomicU8, Ordering};

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

/// Writes `cmf-gpu: {msg}` to stderr at debug verbosity.
pub fn debug(msg: &str) {
    if debug_enabled() {
        eprintln!("cmf-gpu: {msg}");
    }
}
