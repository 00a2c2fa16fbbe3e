//! `cmf synth`: random-weight models with real geometry, for benchmarks where no weights can be
//! downloaded.
//!
//! A preset ([`presets`]) describes a model as a [`SynthSpec`]: a header, a tokenizer and a list
//! of tensors with how to fill them. Values are N(0, 0.02) for matrices (the usual
//! `initializer_range`), 1.0 for norm weights, 0 for biases. Each row is drawn from its own
//! generator seeded by (seed, tensor name, row), so the output does not depend on the number of
//! threads or the chunking, and tensors are generated and encoded in parallel chunks of rows
//! ([`crate::emit`]) — memory stays at a few chunks whatever the model size.
//!
//! Extension point: another model family (e.g. the Z-Image engineer's `z-image-turbo`) adds a
//! [`Preset`] entry to [`presets::PRESETS`] whose `build` returns its own header and tensors.

pub mod presets;
pub mod rng;
pub mod tokenizer;
pub mod zimage;

use std::path::Path;

use cmf_format::{CmfWriter, Header};
use serde_json::json;

use crate::emit::{rows_cols, write_tensor, TensorStats};
use crate::error::{ConvertError, Result};
use crate::quant::Quant;
use crate::{Options, Report};
pub use presets::{find_preset, Preset, PRESETS};

/// How a tensor's values are made.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// Independent N(0, std²) values.
    Normal { std: f32 },
    /// Every value the same (norm weights 1.0, biases 0.0).
    Const(f32),
}

#[derive(Debug, Clone)]
pub struct SynthTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub init: Init,
    /// Stored codec; `None` = the `--quant` choice for matrices, f32 for vectors.
    pub dtype: Option<cmf_format::Dtype>,
}

/// Everything `synth` writes.
pub struct SynthSpec {
    /// `tokenizer_config` and `arch` filled in; `quant_type` and `provenance` are set by [`write`].
    pub header: Header,
    /// `tokenizer.json` bytes for the vocab section.
    pub tokenizer_json: Option<Vec<u8>>,
    pub tensors: Vec<SynthTensor>,
    /// Raw u8 tensors (JSON blobs) written before the others.
    pub blobs: Vec<(String, Vec<u8>)>,
}

/// Arguments a preset's `build` receives.
pub struct SynthArgs<'a> {
    /// A `tokenizer.json` to embed instead of the generated one (its ids must fit the vocab).
    pub tokenizer: Option<&'a Path>,
}

/// Writes `spec` to `output` with `opts.quant` (default q8) and `seed`.
pub fn write(
    spec: SynthSpec,
    preset: &str,
    output: &Path,
    seed: u64,
    opts: &Options,
) -> Result<Report> {
    let quant = opts.quant.unwrap_or(Quant::Q8);
    let mut header = spec.header;
    header.quant_type = quant.header_quant_type();
    header.provenance = Some(json!({
        "converter": concat!("cmf-convert ", env!("CARGO_PKG_VERSION")),
        "source": {"format": "synthetic", "preset": preset, "seed": seed,
                   "init": "matrices N(0, 0.02), norms 1, biases 0"},
        "quant": quant.name(),
        "codecs": {"matrices": quant.matrix_dtype().name(), "vectors": "f32"},
        "note": "random weights: for benchmarks only, the model produces noise",
    }));
    let mut w = CmfWriter::create(output, header)?;
    if let Some(t) = spec.tokenizer_json {
        w.set_vocab(t);
    }
    let total: u64 = spec
        .tensors
        .iter()
        .map(|t| t.shape.iter().product::<usize>() as u64)
        .sum();
    opts.progress.start(total);
    let mut stats = TensorStats::default();
    let mut per_tensor = Vec::with_capacity(spec.tensors.len());
    let source = Path::new("<synth>");
    for (name, bytes) in &spec.blobs {
        w.add_tensor(name, cmf_format::Dtype::U8, &[bytes.len()], bytes)?;
    }
    for t in &spec.tensors {
        let dtype = t.dtype.unwrap_or_else(|| quant.dtype_for(&t.shape));
        let (_, cols) = rows_cols(&t.shape);
        let name_hash = rng::hash_str(&t.name);
        let s = write_tensor(
            &mut w,
            source,
            &t.name,
            dtype,
            &t.shape,
            opts.measure_error,
            &|r0, r1, out| {
                match t.init {
                    Init::Const(v) => out.fill(v),
                    Init::Normal { std } => {
                        for (k, row) in out.chunks_exact_mut(cols).enumerate() {
                            rng::normal_row(seed, name_hash, (r0 + k) as u64, std, row);
                        }
                    }
                }
                debug_assert_eq!(out.len(), (r1 - r0) * cols);
                Ok(())
            },
        )?;
        stats.add(s);
        per_tensor.push((t.name.clone(), dtype, s));
        opts.progress
            .tensor_done(&t.name, t.shape.iter().product::<usize>() as u64);
    }
    let output = w.finish()?;
    opts.progress.finish();
    Ok(Report {
        output,
        tensors: per_tensor,
        total: stats,
        notes: vec![],
    })
}

/// Looks up `preset`, builds it and writes it.
pub fn synth(
    preset: &str,
    output: &Path,
    seed: u64,
    args: &SynthArgs,
    opts: &Options,
) -> Result<Report> {
    let p = find_preset(preset).ok_or_else(|| ConvertError::Option {
        flag: "--preset".into(),
        message: format!(
            "unknown preset '{preset}' (known: {})",
            PRESETS
                .iter()
                .map(|p| p.name)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    })?;
    let spec = (p.build)(args)?;
    write(spec, preset, output, seed, opts)
}
