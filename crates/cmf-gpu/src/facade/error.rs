//! The facade's own errors: settings it cannot use.

/// Errors of opening the facade (bad settings, or `cuda` demanded with no device).
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("{what}: `{value}` is not valid (expected {expected})")]
    BadSetting {
        what: String,
        value: String,
        expected: &'static str,
    },
    #[error("--gpu cuda: no usable CUDA device: {0}")]
    NoDevice(String),
}
