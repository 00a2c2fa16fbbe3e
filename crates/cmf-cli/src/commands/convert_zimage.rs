//! The `--zimage DIR` part of `cmf convert`: its flags and its run (the packer itself is
//! `cmf_convert::zimage`). Kept apart so `convert.rs` only dispatches.

use std::path::Path;

use cmf_convert::zimage::{convert_zimage, Codec, ZimageOptions, DEFAULT_TE_KEEP};
use indicatif::{ProgressBar, ProgressStyle};

use super::human_bytes;
use crate::exit::UsageError;

/// Codec flags of a Z-Image pack (defaults: the reference's q8_2f projections, f32 VAE).
#[derive(clap::Args, Debug, Default)]
pub struct ZimageArgs {
    /// DiT projection codec: q8_2f (default, `q8`), q8_row, q4_block, q4_tiled, q4tp, bf16, f16,
    /// f32 (an exact pack: every DiT tensor f32), raw (the source type).
    #[arg(long, value_name = "CODEC", help_heading = "Z-Image")]
    dit_quant: Option<String>,
    /// Text-encoder projection codec (same names; default q8_2f).
    #[arg(long, value_name = "CODEC", help_heading = "Z-Image")]
    te_quant: Option<String>,
    /// VAE decoder codec: f32 (default), f16, bf16, raw.
    #[arg(long, value_name = "CODEC", help_heading = "Z-Image")]
    vae_quant: Option<String>,
    /// `te.embed_tokens` codec (default q8_row when the text encoder is quantized).
    #[arg(long, value_name = "CODEC", help_heading = "Z-Image")]
    te_embed_quant: Option<String>,
    /// Text-encoder projections kept at the source precision, comma separated
    /// (`layers.N.mlp.down_proj` or a suffix like `down_proj`; `none`; default layers.6.mlp.down_proj).
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "LIST",
        help_heading = "Z-Image"
    )]
    te_keep: Vec<String>,
    /// Recipe stored in the file: turbo or base (default: from the scheduler shift).
    #[arg(long, help_heading = "Z-Image")]
    variant: Option<String>,
}

pub fn run(dir: &Path, output: &Path, a: &ZimageArgs) -> anyhow::Result<()> {
    let usage = |e: cmf_convert::zimage::ZimagePackError| -> anyhow::Error {
        UsageError(e.to_string()).into()
    };
    let mut opts = ZimageOptions::default();
    if let Some(s) = &a.dit_quant {
        opts.dit = Codec::parse(s, "--dit-quant").map_err(usage)?;
    }
    if let Some(s) = &a.te_quant {
        opts.te = Codec::parse(s, "--te-quant").map_err(usage)?;
    }
    if let Some(s) = &a.vae_quant {
        opts.vae = Codec::parse(s, "--vae-quant").map_err(usage)?;
        if matches!(opts.vae, Codec::Quant(_)) {
            return Err(UsageError(format!(
                "--vae-quant: {s} is a matrix codec; use f32, f16, bf16 or raw"
            ))
            .into());
        }
    }
    if let Some(s) = &a.te_embed_quant {
        opts.te_embed = Some(Codec::parse(s, "--te-embed-quant").map_err(usage)?);
    }
    if !a.te_keep.is_empty() {
        opts.te_keep = a
            .te_keep
            .iter()
            .filter(|k| k.as_str() != "none")
            .cloned()
            .collect();
    } else {
        opts.te_keep = DEFAULT_TE_KEEP.iter().map(|s| s.to_string()).collect();
    }
    opts.variant = a.variant.clone();
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {bytes}/{total_bytes} read, {msg} [{elapsed}]")
            .expect("template")
            .progress_chars("=> "),
    );
    let report = convert_zimage(dir, output, &opts, &mut |p| {
        bar.set_length(p.bytes_total);
        bar.set_position(p.bytes_done);
        bar.set_message(format!("{}/{} tensors", p.tensors_done, p.tensors_total));
    })
    .map_err(|e| match e {
        cmf_convert::zimage::ZimagePackError::Option { .. } => usage(e),
        other => anyhow::Error::new(other),
    })?;
    bar.finish_and_clear();
    println!(
        "{}: z-image ({}), {} tensors, {}",
        report.path.display(),
        report.variant,
        report.tensors,
        human_bytes(report.bytes)
    );
    for (codec, bytes) in &report.by_codec {
        println!("  {codec:>8}: {}", human_bytes(*bytes));
    }
    Ok(())
}
