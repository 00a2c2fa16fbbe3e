//! How GPU tests skip.
//!
//! A test that needs a CUDA device prints `SKIPPED: <reason>` and passes where none opens (CI has
//! none), so a plain `cargo test` stays green. On the GPU machine the bench scripts set
//! `CMF_REQUIRE_GPU=1`: there a device that fails to open is a failure, never a silent `ok`.

use std::fmt::Display;

/// Set to `1` where a device must answer (the device scripts under bench/ set it).
pub const REQUIRE_GPU: &str = "CMF_REQUIRE_GPU";

/// Whether `CMF_REQUIRE_GPU=1` is set.
pub fn gpu_required() -> bool {
    std::env::var(REQUIRE_GPU).as_deref() == Ok("1")
}

/// A GPU test cannot run because no device (or no driver, NVRTC, …) answers: prints
/// `SKIPPED: <reason>` so the caller can return, or panics when `CMF_REQUIRE_GPU=1`.
pub fn skip_no_device(reason: impl Display) {
    if gpu_required() {
        panic!("{REQUIRE_GPU}=1 but {reason}");
    }
    eprintln!("SKIPPED: {reason}");
}

/// The opened device, or None after [`skip_no_device`] with the error as the reason.
pub fn device_or_skip<T, E: Display>(opened: Result<T, E>) -> Option<T> {
    match opened {
        Ok(d) => Some(d),
        Err(why) => {
            skip_no_device(format!("no CUDA device ({why})"));
            None
        }
    }
}

/// A test (or part of one) that the open device cannot run, e.g. FP8 on a card without it:
/// prints `SKIPPED: <reason>` whatever `CMF_REQUIRE_GPU` says, since the card is working.
pub fn skip_unsupported(reason: impl Display) {
    eprintln!("SKIPPED: {reason}");
}
