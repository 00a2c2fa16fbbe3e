//! `cmf ppl FILE --file TEXT --ctx 512`: perplexity over non-overlapping windows, computed as
//! llama-perplexity does (see `cmf_llm::perplexity`), so the two numbers are comparable.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use cmf_format::CmfModel;
use cmf_llm::chat::TextAssets;
use cmf_llm::perplexity::perplexity_on;
use cmf_llm::Model;
use serde_json::json;

use super::llm_opts::EngineOpts;
use crate::exit::UsageError;

/// Perplexity of a text file (llama-perplexity's method: second half of each window scored).
#[derive(clap::Args)]
pub struct Args {
    /// A .cmf LLM file (or any shard of a set).
    file: PathBuf,
    /// The text to score (UTF-8).
    #[arg(short = 'f', long = "file", value_name = "TEXT")]
    text: PathBuf,
    /// Window length in tokens.
    #[arg(short = 'c', long, default_value_t = 512)]
    ctx: usize,
    /// Score at most this many windows.
    #[arg(long)]
    chunks: Option<usize>,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    engine: EngineOpts,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    args.engine.apply()?;
    if args.chunks == Some(0) {
        return Err(UsageError("--chunks must be at least 1".into()).into());
    }
    let text = cmf_format::regular::read(&args.text)
        .with_context(|| format!("reading {}", args.text.display()))?;
    let text = String::from_utf8(text)
        .map_err(|_| UsageError(format!("{} is not UTF-8 text", args.text.display())))?;
    let file = CmfModel::open(&args.file)?;
    let model = Model::load(&file).with_context(|| args.file.display().to_string())?;
    let assets = TextAssets::from_cmf(&file)?;
    let tokens = assets.tokenizer.encode(&text, true)?;
    // llama-perplexity puts BOS at the start of every window when the vocabulary adds one.
    let bos = match assets.tokenizer.encode("", true)?.as_slice() {
        [b] => Some(*b),
        _ => None,
    };
    eprintln!(
        "{}: {} tokens, {} windows of {} (BOS per window: {})",
        args.text.display(),
        tokens.len(),
        tokens.len() / args.ctx.max(1),
        args.ctx,
        if bos.is_some() { "yes" } else { "no" }
    );
    let mut gpu = args.engine.gpu_model(&model, args.ctx)?;
    let r = perplexity_on(
        &model,
        gpu.as_mut(),
        &tokens,
        args.ctx,
        bos,
        args.chunks,
        &mut |c, ppl| {
            eprint!("[{c}]{ppl:.4},");
            let _ = std::io::stderr().flush();
        },
    )
    .map_err(|e| UsageError(format!("{}: {e}", args.text.display())))?;
    eprintln!();
    if args.json {
        let v = json!({
            "file": args.file.display().to_string(), "text": args.text.display().to_string(),
            "n_tokens": r.n_tokens, "ctx": r.ctx, "chunks": r.chunks, "scored_tokens": r.scored,
            "ppl": r.ppl, "ppl_stderr": r.ppl_stderr, "chunk_mean_nll": r.chunk_mean_nll,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!("Final estimate: PPL = {:.4} +/- {:.5}", r.ppl, r.ppl_stderr);
    }
    Ok(())
}
