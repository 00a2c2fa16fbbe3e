//! `cmf convert --model DIR --quant q8 --output F`: a Hugging Face checkpoint directory
//! (config.json, safetensors, tokenizer files) → one CMF file. See docs/convert.md.
//! `cmf convert --zimage DIR --output F`: a diffusers Z-Image tree → one pack (`convert_zimage`,
//! docs/zimage.md).

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Instant;

use cmf_convert::{ConvertError, Options, Progress, Quant, Report};
use indicatif::{ProgressBar, ProgressStyle};

use super::human_bytes;
use crate::exit::UsageError;

/// Convert a Hugging Face model directory (llama, qwen2, qwen3, mistral, qwen2_moe, qwen3_moe) to CMF.
#[derive(clap::Args)]
pub struct Args {
    /// Directory with config.json, model.safetensors (or a sharded index) and tokenizer.json.
    #[arg(long, required_unless_present = "zimage", conflicts_with = "zimage")]
    model: Option<PathBuf>,
    /// A diffusers Z-Image / Z-Image-Turbo directory (`ZImagePipeline`) instead of `--model`.
    #[arg(long, value_name = "DIR")]
    zimage: Option<PathBuf>,
    /// Codec for weight matrices: q8 (q8_row), q8_2f, q4 (q4_tiled), f16, bf16, f32.
    /// Norms and biases always stay f32.
    #[arg(long, default_value = "q8")]
    quant: String,
    /// Output .cmf file (written to a temporary file, then renamed).
    #[arg(long, short)]
    output: PathBuf,
    /// Decode every encoded tensor again and print the error against the source values.
    #[arg(long)]
    measure_error: bool,
    #[command(flatten)]
    zimage_args: super::convert_zimage::ZimageArgs,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let model = match (&args.model, &args.zimage) {
        (_, Some(dir)) => return super::convert_zimage::run(dir, &args.output, &args.zimage_args),
        (Some(m), None) => m,
        (None, None) => return Err(UsageError("pass --model DIR or --zimage DIR".into()).into()),
    };
    let quant = parse_quant(&args.quant)?;
    let start = Instant::now();
    let bar = Bar::new();
    let opts = Options {
        quant: Some(quant),
        measure_error: args.measure_error,
        progress: &bar,
    };
    let report = cmf_convert::hf::convert(model, &args.output, &opts).map_err(into_anyhow)?;
    print_report(&report, start, args.measure_error);
    Ok(())
}

pub fn parse_quant(s: &str) -> anyhow::Result<Quant> {
    s.parse::<Quant>()
        .map_err(|e| UsageError(format!("--quant: {e}")).into())
}

/// Option errors are usage errors (exit 2); bad or unreadable input files are runtime errors (1).
pub fn into_anyhow(e: ConvertError) -> anyhow::Error {
    match e {
        ConvertError::Option { .. } => UsageError(e.to_string()).into(),
        e => e.into(),
    }
}

pub fn print_report(r: &Report, start: Instant, measured: bool) {
    for n in &r.notes {
        eprintln!("note: {n}");
    }
    let size = std::fs::metadata(&r.output)
        .map(|m| m.len())
        .unwrap_or(r.total.bytes);
    println!(
        "wrote {}: {} tensors, {} in {:.1} s",
        r.output.display(),
        r.tensors.len(),
        human_bytes(size),
        start.elapsed().as_secs_f64()
    );
    if measured {
        let mut worst = r.tensors.iter().collect::<Vec<_>>();
        worst.sort_by(|a, b| b.2.relative_rms().total_cmp(&a.2.relative_rms()));
        println!(
            "relative RMS error over all tensors: {:.5}",
            r.total.relative_rms()
        );
        for (name, dtype, s) in worst.iter().take(3) {
            println!("  {:.5}  {name} ({dtype})", s.relative_rms());
        }
    }
}

/// A progress bar on stderr when it is a terminal; nothing otherwise.
pub struct Bar(ProgressBar);

impl Bar {
    pub fn new() -> Bar {
        if !std::io::stderr().is_terminal() {
            return Bar(ProgressBar::hidden());
        }
        let style = ProgressStyle::with_template("{bar:40} {percent:>3}% {msg:.dim} ({eta})")
            .expect("static template");
        Bar(ProgressBar::new(0).with_style(style))
    }
}

impl Progress for Bar {
    fn start(&self, total_elements: u64) {
        self.0.set_length(total_elements);
    }
    fn tensor_done(&self, name: &str, elements: u64) {
        self.0.set_message(name.to_owned());
        self.0.inc(elements);
    }
    fn finish(&self) {
        self.0.finish_and_clear();
    }
}
