//! The runtime's error: a driver, NVRTC or library failure with what was being done.

use crate::facade::refusal::{Refusal, RefusalReason};

pub type DResult<T> = Result<T, DevError>;

/// A driver, NVRTC or cuBLAS failure, with what was being done.
#[derive(Debug, Clone)]
pub struct DevError(pub String);

impl std::fmt::Display for DevError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl DevError {
    pub fn refusal(self, op: &'static str) -> Refusal {
        Refusal::new(op, RefusalReason::Device(self.0))
    }
}

/// Adds context to a driver error: `ctx("cuMemAlloc 4096 B")?`.
pub trait Ctx<T> {
    fn ctx(self, what: impl FnOnce() -> String) -> DResult<T>;
}

impl<T, E: std::fmt::Debug> Ctx<T> for Result<T, E> {
    fn ctx(self, what: impl FnOnce() -> String) -> DResult<T> {
        self.map_err(|e| DevError(format!("{}: {e:?}", what())))
    }
}
