//! `cmf convert`: import a model into CMF. Sources are dispatched to their importer modules;
//! `--zimage DIR` packs a diffusers Z-Image tree (see `convert_zimage`).

use std::path::PathBuf;

use crate::exit::UsageError;

/// Convert a model into a .cmf file.
#[derive(clap::Args)]
pub struct Args {
    /// A diffusers Z-Image / Z-Image-Turbo directory (`ZImagePipeline`: transformer/,
    /// text_encoder/, tokenizer/, vae/, scheduler/, model_index.json).
    #[arg(long, value_name = "DIR")]
    zimage: Option<PathBuf>,
    /// The .cmf to write (written to a temporary file and renamed when complete).
    #[arg(long, short)]
    output: PathBuf,
    #[command(flatten)]
    zimage_args: super::convert_zimage::ZimageArgs,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    match &args.zimage {
        Some(dir) => super::convert_zimage::run(dir, &args.output, &args.zimage_args),
        None => Err(UsageError("nothing to convert: pass --zimage DIR".into()).into()),
    }
}
