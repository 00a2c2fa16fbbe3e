//! Chat templates come inside model files, so `cmf` renders them in worker processes with capped
//! memory (`cmf_llm::chat::render_worker`): `install` points every render of this process at
//! `cmf __template-worker` (hidden from `--help`), which serves them over its stdin/stdout.

use std::path::PathBuf;

use cmf_llm::chat::render_worker::{self, WorkerSettings};

/// The hidden subcommand's name.
pub const COMMAND: &str = "__template-worker";

/// Every command but the worker itself renders through workers.
pub fn install() {
    render_worker::install(WorkerSettings::new(this_executable(), [COMMAND]));
}

pub fn run() -> anyhow::Result<()> {
    render_worker::serve_stdio().map_err(|e| anyhow::anyhow!("chat template render worker: {e}"))
}

/// This binary, even if its file was replaced or deleted since it started (through `/proc` where
/// it is mounted), so workers always speak this version's protocol.
fn this_executable() -> PathBuf {
    let proc_exe = PathBuf::from("/proc/self/exe");
    if proc_exe.exists() {
        proc_exe
    } else {
        std::env::current_exe().unwrap_or_else(|_| PathBuf::from("cmf"))
    }
}
