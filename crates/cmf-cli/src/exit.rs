//! Exit codes of `cmf`, one place for all subcommands:
//!
//! | code | meaning |
//! | --- | --- |
//! | 0 | success |
//! | 1 | runtime error: I/O, a file that cannot be read, a model that cannot be run |
//! | 2 | usage error: bad flags or arguments (clap's own errors included) |
//! | 3 | verification failed: `cmf verify` found a corrupt or invalid file |
//!
//! Commands return `anyhow::Error`; wrapping the cause in [`UsageError`] or
//! [`VerificationFailed`] selects codes 2 and 3, anything else is 1.

pub const RUNTIME: u8 = 1;
pub const USAGE: u8 = 2;
pub const VERIFY: u8 = 3;

/// The user asked for something that makes no sense (exit 2).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
#[allow(dead_code)] // for subcommands that validate their own arguments
pub struct UsageError(pub String);

/// A check the user asked for did not pass (exit 3).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct VerificationFailed(pub String);

pub fn code_for(e: &anyhow::Error) -> u8 {
    if e.downcast_ref::<VerificationFailed>().is_some() {
        VERIFY
    } else if e.downcast_ref::<UsageError>().is_some() {
        USAGE
    } else {
        RUNTIME
    }
}
