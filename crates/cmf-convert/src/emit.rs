//! Streaming a tensor into a [`CmfWriter`] in row chunks: bounded memory, multithreaded
//! generation and encoding, the same bytes as encoding the whole tensor at once.
//!
//! Every importer describes a tensor as a function that fills rows `r0..r1` with f32 values
//! (dequantize from a GGUF, widen from bf16, draw random numbers, ...). Chunks of rows are
//! produced and encoded in parallel with rayon, then written in order.
//!
//! The codecs' layouts (docs/CMF_V2_SPEC.md, cmf_format::codec) are concatenations of "parts",
//! each holding a fixed number of bytes per row, in row order: f32/f16/bf16 and q4_tiled are one
//! part; q8_row is `[i8 per row][f16 scale per row]`; q4_block (row length a multiple of 32) is
//! `[nibbles][f16 scales]`; q4tp is `[nibbles][lo, step][codes]`. Encoding a chunk of rows gives
//! the chunk's slice of each part, so part 0 is written as it comes and the later (small) parts
//! are kept and appended at the end. q8_2f's column scales depend on every row: it is encoded
//! whole. `tests/emit.rs` checks chunked and whole encodings are byte-identical for every codec.

use std::path::Path;

use cmf_format::{codec, CmfWriter, Dtype};
use rayon::prelude::*;

use crate::error::{ConvertError, Result};

/// f32 elements per chunk: 4 MiB of values, so a batch over all threads stays small.
const CHUNK_ELEMENTS: usize = 1 << 20;

/// Fills `out` (`(r1 - r0) × cols` values) with rows `r0..r1` of the tensor.
pub type RowFn<'a> =
    dyn Fn(usize, usize, &mut [f32]) -> std::result::Result<(), String> + Sync + 'a;

/// (rows, cols) of a row-major shape: leading dimensions fold into rows.
pub fn rows_cols(shape: &[usize]) -> (usize, usize) {
    match shape {
        [] => (1, 1),
        [c] => (1, *c),
        [lead @ .., c] => (lead.iter().product(), *c),
    }
}

/// Bytes per row of each part of `dtype`'s layout, or `None` when rows cannot be encoded
/// independently.
pub fn part_sizes(dtype: Dtype, cols: usize) -> Option<Vec<usize>> {
    let g = cols / 32;
    let whole_groups = cols.is_multiple_of(32);
    match dtype {
        Dtype::F32 => Some(vec![4 * cols]),
        Dtype::F16 | Dtype::Bf16 => Some(vec![2 * cols]),
        Dtype::U8 => Some(vec![cols]),
        Dtype::Q8Row => Some(vec![cols, 2]),
        Dtype::Q4Block if whole_groups => Some(vec![16 * g, 2 * g]),
        Dtype::Q4Tiled if whole_groups => Some(vec![18 * g]),
        Dtype::Q4Tp if whole_groups => Some(vec![16 * g, 4, (g * 5).div_ceil(8)]),
        _ => None,
    }
}

/// Writes one tensor whose rows come from `rows`; returns the bytes written.
/// What writing one tensor did. The error sums are filled only when measuring.
#[derive(Debug, Clone, Copy, Default)]
pub struct TensorStats {
    pub bytes: u64,
    /// Σ (decoded − source)², Σ source², over all elements.
    pub err_sq: f64,
    pub ref_sq: f64,
}

impl TensorStats {
    /// sqrt(Σ err² / Σ ref²); 0 for an all-zero tensor.
    pub fn relative_rms(&self) -> f64 {
        if self.ref_sq > 0.0 {
            (self.err_sq / self.ref_sq).sqrt()
        } else {
            0.0
        }
    }

    pub fn add(&mut self, o: TensorStats) {
        self.bytes += o.bytes;
        self.err_sq += o.err_sq;
        self.ref_sq += o.ref_sq;
    }
}

/// Decodes what was just encoded and sums the squared error (for `--measure-error`).
fn measure(
    dtype: Dtype,
    shape: &[usize],
    bytes: &[u8],
    values: &[f32],
) -> std::result::Result<(f64, f64), String> {
    let mut back = vec![0f32; values.len()];
    codec::decode(dtype, shape, bytes, &mut back)
        .map_err(|e| format!("decoding for error measurement: {e}"))?;
    let (mut e, mut r) = (0f64, 0f64);
    for (a, b) in values.iter().zip(&back) {
        e += ((a - b) as f64).powi(2);
        r += (*a as f64).powi(2);
    }
    Ok((e, r))
}

/// Errors name `source` (the input file the rows come from) and the tensor.
pub fn write_tensor(
    w: &mut CmfWriter,
    source: &Path,
    name: &str,
    dtype: Dtype,
    shape: &[usize],
    measure_error: bool,
    rows: &RowFn,
) -> Result<TensorStats> {
    let (n_rows, cols) = rows_cols(shape);
    let tensor_err = |m: String| ConvertError::tensor(source, name, m);
    let rows_per_chunk = (CHUNK_ELEMENTS / cols.max(1)).clamp(1, n_rows.max(1));
    let Some(parts) = part_sizes(dtype, cols).filter(|_| n_rows > 1) else {
        // Whole tensor at once (1-D, single row, or a codec with cross-row statistics).
        // The rows still come in parallel chunks (q8_2f's column field needs them all first).
        let mut values = vec![0f32; n_rows * cols];
        values
            .par_chunks_mut((rows_per_chunk * cols).max(1))
            .enumerate()
            .try_for_each(|(c, out)| {
                let r0 = c * rows_per_chunk;
                rows(r0, r0 + out.len() / cols.max(1), out)
            })
            .map_err(tensor_err)?;
        let bytes = codec::encode(dtype, shape, &values)
            .map_err(|e| tensor_err(format!("encoding as {dtype}: {e}")))?;
        let (err_sq, ref_sq) = if measure_error {
            measure(dtype, shape, &bytes, &values).map_err(tensor_err)?
        } else {
            (0.0, 0.0)
        };
        w.add_tensor(name, dtype, shape, &bytes)?;
        return Ok(TensorStats {
            bytes: bytes.len() as u64,
            err_sq,
            ref_sq,
        });
    };
    let row_bytes: usize = parts.iter().sum();
    let n_chunks = n_rows.div_ceil(rows_per_chunk);
    let batch = rayon::current_num_threads().max(1) * 2;
    let mut tail_parts: Vec<Vec<u8>> = vec![Vec::new(); parts.len() - 1];
    w.begin_tensor(name, dtype, shape)?;
    let mut stats = TensorStats::default();
    for first in (0..n_chunks).step_by(batch) {
        let last = (first + batch).min(n_chunks);
        type Encoded = std::result::Result<(Vec<u8>, f64, f64), String>;
        let encoded: Vec<Encoded> = (first..last)
            .into_par_iter()
            .map(|c| {
                let r0 = c * rows_per_chunk;
                let r1 = (r0 + rows_per_chunk).min(n_rows);
                let mut values = vec![0f32; (r1 - r0) * cols];
                rows(r0, r1, &mut values)?;
                let bytes = codec::encode(dtype, &[r1 - r0, cols], &values)
                    .map_err(|e| format!("encoding rows {r0}..{r1} as {dtype}: {e}"))?;
                if bytes.len() != (r1 - r0) * row_bytes {
                    return Err(format!(
                        "codec {dtype} gave {} bytes for {} rows of {cols}, layout expects {}",
                        bytes.len(),
                        r1 - r0,
                        (r1 - r0) * row_bytes
                    ));
                }
                let (e, r) = if measure_error {
                    measure(dtype, &[r1 - r0, cols], &bytes, &values)?
                } else {
                    (0.0, 0.0)
                };
                Ok((bytes, e, r))
            })
            .collect();
        for (c, bytes) in (first..last).zip(encoded) {
            let (bytes, e, r) = bytes.map_err(tensor_err)?;
            stats.add(TensorStats {
                bytes: bytes.len() as u64,
                err_sq: e,
                ref_sq: r,
            });
            let chunk_rows = (n_rows - c * rows_per_chunk).min(rows_per_chunk);
            let mut at = 0;
            for (i, &p) in parts.iter().enumerate() {
                let part = &bytes[at..at + p * chunk_rows];
                if i == 0 {
                    w.write_chunk(part)?;
                } else {
                    tail_parts[i - 1].extend_from_slice(part);
                }
                at += p * chunk_rows;
            }
        }
    }
    for part in &tail_parts {
        w.write_chunk(part)?;
    }
    w.end_tensor()?;
    Ok(stats)
}
