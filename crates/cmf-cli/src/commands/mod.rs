//! One module per subcommand: `Args` (clap derive) and `run(args) -> anyhow::Result<()>`.

pub mod bench;
pub mod convert;
pub mod convert_zimage;
pub mod imagine;
pub mod import_gguf;
pub mod info;
mod llm_opts;
pub mod ppl;
pub mod run;
pub mod serve;
mod stdin_prompt;
pub mod synth;
pub mod template_worker;
pub mod verify;

/// `1.23 GB`-style size (decimal units, as disk tools print them).
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "kB", "MB", "GB", "TB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1000.0 && u + 1 < UNITS.len() {
        v /= 1000.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}
