//! Honest refusal: a device entry point either does the whole job or returns a [`Refusal`]
//! before it has written anything the caller can see. The caller then runs the CPU path.
//!
//! Each distinct reason is logged once per process at debug verbosity (`CMF_LOG=debug`), so a
//! model that refuses on every token does not flood the terminal.

use cmf_format::Dtype;
use std::collections::HashSet;
use std::sync::Mutex;

/// Why a device entry point declined. The variants are coarse on purpose: one log line each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RefusalReason {
    /// No device backend is open (`--gpu off`, or `auto` found none).
    NoBackend,
    /// A [`pause_gpu`](super::pause_gpu) guard is alive somewhere in the process.
    Paused,
    /// The calling thread is inside a [`cpu_scope`](super::cpu_scope).
    CpuScope,
    /// A weight codec the device kernels do not implement.
    UnsupportedCodec(Dtype),
    /// A shape or geometry the kernels do not implement (named in the text).
    UnsupportedShape(String),
    /// The request does not fit the device memory budget.
    OutOfMemory { need: u64, budget: u64 },
    /// Position past the device KV cache, or a layer that is not resident.
    NotResident(String),
    /// The driver, NVRTC or cuBLAS failed before any output was written.
    Device(String),
    /// Injected by a test or by `CMF_GPU_INJECT_REFUSAL` (diagnostics).
    Injected,
    /// The contention guard tripped: device operations kept running over their time budget
    /// (another process shares the card), so the rest of the process runs on the CPU.
    Contended,
}

impl RefusalReason {
    /// The key a refusal is de-duplicated on in the log (the variant, plus the codec/class).
    fn log_key(&self) -> String {
        match self {
            RefusalReason::UnsupportedShape(s)
            | RefusalReason::NotResident(s)
            | RefusalReason::Device(s) => {
                format!("{}:{s}", self.kind())
            }
            RefusalReason::UnsupportedCodec(d) => format!("codec:{d}"),
            _ => self.kind().to_string(),
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            RefusalReason::NoBackend => "no-backend",
            RefusalReason::Paused => "paused",
            RefusalReason::CpuScope => "cpu-scope",
            RefusalReason::UnsupportedCodec(_) => "codec",
            RefusalReason::UnsupportedShape(_) => "shape",
            RefusalReason::OutOfMemory { .. } => "out-of-memory",
            RefusalReason::NotResident(_) => "not-resident",
            RefusalReason::Device(_) => "device",
            RefusalReason::Injected => "injected",
            RefusalReason::Contended => "contended",
        }
    }

    /// Whether the device ran out of memory: the budget said no, or an allocation failed on the
    /// device (another process took the memory after the budget was read, or the driver needed
    /// more than planned). The caller may try a smaller placement; the CPU path always works.
    pub fn is_out_of_memory(&self) -> bool {
        match self {
            RefusalReason::OutOfMemory { .. } => true,
            RefusalReason::Device(s) => {
                let s = s.to_ascii_lowercase();
                // Driver (CUDA_ERROR_OUT_OF_MEMORY), runtime and cuBLAS/cuBLASLt/cuDNN spellings.
                ["out_of_memory", "out of memory", "alloc_failed"]
                    .iter()
                    .any(|k| s.contains(k))
            }
            _ => false,
        }
    }
}

impl std::fmt::Display for RefusalReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RefusalReason::NoBackend => f.write_str("no GPU backend is open"),
            RefusalReason::Paused => f.write_str("the GPU is paused (pause_gpu)"),
            RefusalReason::CpuScope => f.write_str("this thread is in a cpu_scope"),
            RefusalReason::UnsupportedCodec(d) => write!(f, "codec {d} has no device kernel"),
            RefusalReason::UnsupportedShape(s) => write!(f, "unsupported shape: {s}"),
            RefusalReason::OutOfMemory { need, budget } => {
                write!(f, "needs {need} bytes of device memory, budget is {budget}")
            }
            RefusalReason::NotResident(s) => write!(f, "not resident on the device: {s}"),
            RefusalReason::Device(s) => write!(f, "device error: {s}"),
            RefusalReason::Injected => f.write_str("refusal injected for testing"),
            RefusalReason::Contended => f.write_str(
                "the device is contended (operations kept running over their time budget)",
            ),
        }
    }
}

/// A device entry point declined; nothing the caller passed in was modified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The entry point that refused (`llm.decode`, `llm.prefill`, …).
    pub op: &'static str,
    pub reason: RefusalReason,
}

impl Refusal {
    pub fn new(op: &'static str, reason: RefusalReason) -> Refusal {
        Refusal { op, reason }
    }

    /// Logs this refusal at debug verbosity unless its reason was logged before in this
    /// process. Returns `self` so call sites can write `return Err(r.logged())`.
    pub fn logged(self) -> Refusal {
        static SEEN: Mutex<Option<HashSet<String>>> = Mutex::new(None);
        let key = self.reason.log_key();
        let first = {
            let mut seen = SEEN.lock().unwrap_or_else(|p| p.into_inner());
            seen.get_or_insert_with(HashSet::new).insert(key)
        };
        if first {
            super::log::debug(&format!(
                "{}: refused, running on the CPU: {}",
                self.op, self.reason
            ));
        }
        self
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} refused: {}", self.op, self.reason)
    }
}

impl std::error::Error for Refusal {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_keys_separate_codecs_but_not_sizes() {
        let a = RefusalReason::UnsupportedCodec(Dtype::Q4Tp).log_key();
        let b = RefusalReason::UnsupportedCodec(Dtype::U8).log_key();
        assert_ne!(a, b);
        let m1 = RefusalReason::OutOfMemory { need: 1, budget: 2 }.log_key();
        let m2 = RefusalReason::OutOfMemory { need: 3, budget: 4 }.log_key();
        assert_eq!(m1, m2);
    }

    #[test]
    fn allocation_failures_count_as_out_of_memory() {
        for s in [
            "allocating 4096 bytes on the device: DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")",
            "cublasLt workspace: CUBLAS_STATUS_ALLOC_FAILED",
        ] {
            assert!(RefusalReason::Device(s.into()).is_out_of_memory(), "{s}");
        }
        assert!(RefusalReason::OutOfMemory { need: 2, budget: 1 }.is_out_of_memory());
        assert!(!RefusalReason::Device("CUDA_ERROR_ILLEGAL_ADDRESS".into()).is_out_of_memory());
        assert!(!RefusalReason::Injected.is_out_of_memory());
    }

    #[test]
    fn display_names_op_and_reason() {
        let r = Refusal::new("llm.decode", RefusalReason::UnsupportedCodec(Dtype::Q4Tp));
        assert_eq!(
            r.to_string(),
            "llm.decode refused: codec q4tp has no device kernel"
        );
    }
}
