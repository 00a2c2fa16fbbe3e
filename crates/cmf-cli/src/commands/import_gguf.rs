//! `cmf import-gguf FILE --output F [--quant …]`: a llama.cpp GGUF model (llama, qwen2, qwen3, qwen3moe,
//! qwen3next) → one CMF file, with its tokenizer rebuilt as tokenizer.json. See docs/convert.md.

use std::path::PathBuf;
use std::time::Instant;

use cmf_convert::Options;

use super::convert::{into_anyhow, parse_quant, print_report, Bar};

/// Import a GGUF model. Default codecs: quantized tensors → q8_row, F16/BF16/F32 kept.
#[derive(clap::Args)]
pub struct Args {
    /// The .gguf file.
    file: PathBuf,
    /// Output .cmf file (written to a temporary file, then renamed).
    #[arg(long, short)]
    output: PathBuf,
    /// Codec for every weight matrix instead of the per-type default: q8, q8_2f, q4, f16, bf16, f32.
    #[arg(long)]
    quant: Option<String>,
    /// Decode every encoded tensor again and print the error against the dequantized GGUF values.
    #[arg(long)]
    measure_error: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let quant = args.quant.as_deref().map(parse_quant).transpose()?;
    let start = Instant::now();
    let bar = Bar::new();
    let opts = Options {
        quant,
        measure_error: args.measure_error,
        progress: &bar,
    };
    let report =
        cmf_convert::import_gguf::import(&args.file, &args.output, &opts).map_err(into_anyhow)?;
    print_report(&report, start, args.measure_error);
    Ok(())
}
