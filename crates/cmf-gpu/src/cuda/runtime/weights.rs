//! Weights resident on the device in their storage codec (never expanded to f32 planes).
//!
//! Each codec's sections go to separate allocations so every plane is aligned for vector
//! loads: q8_row = int8 plane + f16 row scales; q8_2f = the same + f16 column field;
//! q4_block = nibble plane + f16 group scales (verbatim); q4_tiled is re-laid out on upload into
//! that same pair of planes (identical values and size: its 18-byte tiles would defeat
//! 16-byte loads); bf16/f16/f32 are one plane. q4tp has no device kernel and is refused.

use super::device::{grid1, Arg, DBuf, DResult, Dev};
use super::kernels::Func;
use crate::facade::refusal::{Refusal, RefusalReason};
use cmf_format::Dtype;
use cmf_kernels::Weight;

/// The codec numbers the kernels switch on (`CODEC_*` in common.cuh).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DevCodec {
    Q8 = 0,
    Q4 = 1,
    Bf16 = 2,
    F16 = 3,
    F32 = 4,
}

impl DevCodec {
    /// The device codec for a storage codec, or the refusal that names it.
    pub fn of(dtype: Dtype) -> Result<DevCodec, RefusalReason> {
        match dtype {
            Dtype::Q8Row | Dtype::Q8_2f => Ok(DevCodec::Q8),
            Dtype::Q4Block | Dtype::Q4Tiled => Ok(DevCodec::Q4),
            Dtype::Bf16 => Ok(DevCodec::Bf16),
            Dtype::F16 => Ok(DevCodec::F16),
            Dtype::F32 => Ok(DevCodec::F32),
            other => Err(RefusalReason::UnsupportedCodec(other)),
        }
    }

    /// Whether prefill GEMMs take this codec through bf16 tensor cores (else f32 SGEMM, kept
    /// for f32/f16 models where parity with the CPU path matters more than speed).
    pub fn gemm_in_bf16(self) -> bool {
        matches!(self, DevCodec::Q8 | DevCodec::Q4 | DevCodec::Bf16)
    }
}

/// Checks a weight can live on the device; `name` goes into the refusal.
pub fn check(w: &Weight, name: &str) -> Result<DevCodec, Refusal> {
    check_cols(w, name, 32)
}

/// [`check`] that accepts float-codec (bf16, f16, f32) matrices whose columns are a multiple of
/// 8: the matvec, the dequantisation and the GEMMs read such rows in 16-byte groups. The 8-bit
/// codecs keep 32 (their quantisation blocks).
pub fn check_narrow(w: &Weight, name: &str) -> Result<DevCodec, Refusal> {
    check_cols(w, name, 8)
}

fn check_cols(w: &Weight, name: &str, float_cols: usize) -> Result<DevCodec, Refusal> {
    let codec = DevCodec::of(w.dtype).map_err(|r| Refusal::new("llm.load", r))?;
    let multiple = match codec {
        DevCodec::Q8 | DevCodec::Q4 => 32,
        _ => float_cols,
    };
    if w.cols % multiple != 0 || w.rows == 0 {
        return Err(Refusal::new(
            "llm.load",
            RefusalReason::UnsupportedShape(format!(
                "{name}: [{}, {}] in {} (cols must be a multiple of {multiple})",
                w.rows, w.cols, w.dtype
            )),
        ));
    }
    Ok(codec)
}

/// Device bytes a weight takes.
pub fn device_bytes(w: &Weight) -> u64 {
    w.data.len() as u64
}

pub struct DevWeight {
    pub codec: DevCodec,
    pub dtype: Dtype,
    pub rows: usize,
    pub cols: usize,
    pub main: DBuf,
    /// q8: row scales; q4: group scales.
    pub scales: Option<DBuf>,
    /// q8_2f column field.
    pub col: Option<DBuf>,
}

/// Where [`DevWeight::dequant`] writes rows: a bf16 plane or an f32 one.
#[derive(Clone, Copy)]
pub enum DequantTo {
    Bf16(u64),
    F32(u64),
}

impl DevWeight {
    /// Expands rows `r0 .. r0 + rows` to `to` (row-major, from its start) with `dequant_rows`
    /// (rowops.cu; `f` is that kernel of the caller's module). Asynchronous on the stream.
    pub fn dequant(
        &self,
        dev: &Dev,
        f: &Func,
        r0: usize,
        rows: usize,
        to: DequantTo,
    ) -> DResult<()> {
        let (bf16, f32) = match to {
            DequantTo::Bf16(p) => (p, 0),
            DequantTo::F32(p) => (0, p),
        };
        dev.launch(
            f,
            grid1(rows * self.cols, 256 * 8),
            (256, 1, 1),
            0,
            &[
                Arg::I32(self.codec as i32),
                Arg::Ptr(self.w()),
                Arg::Ptr(self.rs()),
                Arg::Ptr(self.colp()),
                Arg::U64(self.cols as u64),
                Arg::U64(r0 as u64),
                Arg::U64(rows as u64),
                Arg::Ptr(bf16),
                Arg::Ptr(f32),
            ],
        )
    }

    pub fn upload(dev: &Dev, w: &Weight) -> DResult<DevWeight> {
        let codec = DevCodec::of(w.dtype).expect("checked before upload");
        let n = w.rows * w.cols;
        let d = w.data;
        let (main, scales, col) = match w.dtype {
            Dtype::Q8Row => (
                dev.upload_new(&d[..n])?,
                Some(dev.upload_new(&d[n..n + 2 * w.rows])?),
                None,
            ),
            Dtype::Q8_2f => (
                dev.upload_new(&d[..n])?,
                Some(dev.upload_new(&d[n..n + 2 * w.rows])?),
                Some(dev.upload_new(&d[n + 2 * w.rows..])?),
            ),
            Dtype::Q4Block => {
                let nib = n.div_ceil(32) * 16;
                (
                    dev.upload_new(&d[..nib])?,
                    Some(dev.upload_new(&d[nib..])?),
                    None,
                )
            }
            Dtype::Q4Tiled => {
                let (nib, sc) = untile_q4(d, n / 32);
                (dev.upload_new(&nib)?, Some(dev.upload_new(&sc)?), None)
            }
            _ => (dev.upload_new(d)?, None, None),
        };
        Ok(DevWeight {
            codec,
            dtype: w.dtype,
            rows: w.rows,
            cols: w.cols,
            main,
            scales,
            col,
        })
    }

    pub fn w(&self) -> u64 {
        self.main.ptr()
    }
    pub fn rs(&self) -> u64 {
        self.scales.as_ref().map_or(0, |b| b.ptr())
    }
    pub fn colp(&self) -> u64 {
        self.col.as_ref().map_or(0, |b| b.ptr())
    }
    pub fn bytes(&self) -> u64 {
        (self.main.len()
            + self.scales.as_ref().map_or(0, |b| b.len())
            + self.col.as_ref().map_or(0, |b| b.len())) as u64
    }
}

/// q4_tiled tiles `[f16 s][16 B nibbles]` → (nibble plane, f16 scale plane), same order.
pub fn untile_q4(d: &[u8], tiles: usize) -> (Vec<u8>, Vec<u8>) {
    let mut nib = Vec::with_capacity(tiles * 16);
    let mut sc = Vec::with_capacity(tiles * 2);
    for t in d.chunks_exact(18).take(tiles) {
        sc.extend_from_slice(&t[..2]);
        nib.extend_from_slice(&t[2..]);
    }
    (nib, sc)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llm::synth::random_matrix;
    use cmf_kernels::reference::decode_row;

    #[test]
    fn untiled_q4_decodes_like_q4_block() {
        let (rows, cols) = (3, 64);
        let tiled = random_matrix(Dtype::Q4Tiled, rows, cols, 0.1, 5);
        let (nib, sc) = untile_q4(&tiled, rows * cols / 32);
        let block = [nib, sc].concat();
        let a = Weight {
            dtype: Dtype::Q4Tiled,
            rows,
            cols,
            data: &tiled,
        };
        let b = Weight {
            dtype: Dtype::Q4Block,
            rows,
            cols,
            data: &block,
        };
        let (mut ra, mut rb) = (vec![0f32; cols], vec![0f32; cols]);
        for r in 0..rows {
            decode_row(&a, r, &mut ra);
            decode_row(&b, r, &mut rb);
            assert_eq!(ra, rb);
        }
    }

    #[test]
    fn refuses_q4tp_and_ragged_columns() {
        let w = Weight {
            dtype: Dtype::Q4Tp,
            rows: 1,
            cols: 32,
            data: &[],
        };
        assert!(matches!(
            check(&w, "x").unwrap_err().reason,
            RefusalReason::UnsupportedCodec(Dtype::Q4Tp)
        ));
        let w = Weight {
            dtype: Dtype::F32,
            rows: 1,
            cols: 20,
            data: &[0; 80],
        };
        let r = check(&w, "layer 0 q").unwrap_err();
        assert!(r.to_string().contains("layer 0 q"), "{r}");
    }
}
