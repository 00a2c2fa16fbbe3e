//! Flags shared by `cmf run`, `cmf bench` and `cmf ppl`: threads and KV-cache element type.

use crate::exit::UsageError;
use cmf_kernels::KvDtype;

#[derive(clap::Args, Debug, Clone)]
pub struct EngineOpts {
    /// Worker threads for the kernels (default: all available cores).
    #[arg(short = 't', long, value_name = "N")]
    pub threads: Option<usize>,
    /// KV-cache element type: f16 (half the memory and bandwidth) or f32 (exact).
    #[arg(long = "kv-type", value_name = "TYPE", default_value = "f16")]
    pub kv_type: String,
}

impl EngineOpts {
    /// Applies the thread count; returns the KV type.
    pub fn apply(&self) -> anyhow::Result<KvDtype> {
        match self.threads {
            Some(0) => return Err(UsageError("--threads must be at least 1".into()).into()),
            Some(n) => cmf_kernels::set_num_threads(n),
            None => {}
        }
        KvDtype::from_name(&self.kv_type).ok_or_else(|| {
            UsageError(format!(
                "--kv-type {}: expected f16, bf16 or f32",
                self.kv_type
            ))
            .into()
        })
    }
}
