//! `cmf verify FILE`: structure (everything `open` checks), then the hash chain: header and
//! directory hashes in the envelope, vocab hash in the header, and every tensor's hash64.
//! Then, when the file carries a tokenizer, that it loads and runs and that the chat template
//! renders within its limits (as `cmf run` will load them).
//! Exit 0 only when all hold; 3 when any hash fails (each failure is printed with the section or
//! tensor it concerns); 1 when the file cannot be read, is malformed (structure, tokenizer or
//! template), as for every other command.

use std::path::PathBuf;
use std::time::Instant;

use cmf_format::{CmfModel, Error};
use indicatif::{ProgressBar, ProgressStyle};

use super::human_bytes;
use crate::exit::VerificationFailed;

/// Check a model file's integrity: envelope, sections and every tensor's hash.
#[derive(clap::Args)]
pub struct Args {
    /// A .cmf file, or any shard of a shard set (all shards are checked).
    file: PathBuf,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let model = match CmfModel::open(&args.file) {
        Ok(m) => m,
        // Malformed is bad input (exit 1), like for every command; only hashes give 3.
        Err(e @ Error::Invalid { .. }) => {
            println!("INVALID {e}");
            return Err(anyhow::anyhow!(
                "{} is not a valid CMF v2 file",
                args.file.display()
            ));
        }
        Err(e) => return Err(e.into()),
    };
    let start = Instant::now();
    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} ({eta})")
            .expect("static template"),
    );
    let report = model.verify_with_progress(&mut |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    });
    bar.finish_and_clear();
    let secs = start.elapsed().as_secs_f64();

    for p in &report.problems {
        println!("FAILED  {p}");
    }
    let files = model.files().len();
    let sections = report.sections_checked.join(", ");
    let summary = format!(
        "{} tensors ({}) in {} file{}, sections [{}], {:.2} s",
        report.tensors_checked,
        human_bytes(report.bytes_hashed),
        files,
        if files == 1 { "" } else { "s" },
        sections,
        secs
    );
    if !report.sections_unrecorded.is_empty() {
        println!(
            "note: no hash recorded for: {}",
            report.sections_unrecorded.join(", ")
        );
    }
    if !report.is_ok() {
        return Err(VerificationFailed(format!(
            "{} problem(s) in {}; checked {summary}",
            report.problems.len(),
            args.file.display()
        ))
        .into());
    }
    let text = check_text_assets(&model)?;
    println!("OK      {summary}{text}");
    Ok(())
}

/// Loads the tokenizer and chat template the way `cmf run` does; a file without a vocab section
/// (nothing to load) passes. Returns what was checked, for the summary line.
fn check_text_assets(model: &CmfModel) -> anyhow::Result<&'static str> {
    let Some(vocab) = model.vocab() else {
        return Ok("");
    };
    let cfg = model.header().tokenizer_config.clone().unwrap_or_default();
    let origin = model.path().display().to_string();
    cmf_llm::chat::TextAssets::from_parts(&origin, vocab, &cfg).map_err(|e| {
        println!("INVALID {e}");
        anyhow::Error::new(e)
    })?;
    Ok(", tokenizer and chat template load")
}
