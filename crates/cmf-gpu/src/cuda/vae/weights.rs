//! The decoder's weights on the device: the checks before upload, the resident layers (bf16
//! planes, 3×3 kernels tap-major), their byte count, and the upload.

use super::*;

/// A conv or Linear on the device: bf16 weight `[cout, cols]` (3×3: tap-major columns), f32 bias.
pub(super) struct DConv {
    pub(super) w: DBuf,
    pub(super) bias: DBuf,
    pub(super) cout: usize,
    pub(super) cols: usize,
}

pub(super) struct DNorm {
    pub(super) w: DBuf,
    pub(super) b: DBuf,
}

pub(super) struct DResnet {
    pub(super) norm1: DNorm,
    pub(super) conv1: DConv,
    pub(super) norm2: DNorm,
    pub(super) conv2: DConv,
    pub(super) shortcut: Option<DConv>,
    /// conv2's bias (+ the shortcut's): added once after the shortcut GEMM accumulated.
    pub(super) out_bias: DBuf,
    pub(super) cin: usize,
    pub(super) cout: usize,
}

pub(super) struct DAttn {
    pub(super) norm: DNorm,
    pub(super) q: DConv,
    pub(super) k: DConv,
    pub(super) v: DConv,
    pub(super) out: DConv,
}

pub(super) struct DUp {
    pub(super) resnets: Vec<DResnet>,
    pub(super) upsampler: Option<DConv>,
}

/// Bytes of the resident weights: bf16 planes, f32 biases and GroupNorm parameters.
pub(super) fn resident_bytes(model: &VaeModel) -> u64 {
    let mats: usize = model
        .weights()
        .iter()
        .map(|(_, c)| 2 * c.weight.rows * c.weight.cols + 4 * c.weight.rows)
        .sum();
    let resnets = model
        .mid_resnets
        .iter()
        .chain(model.up_blocks.iter().flat_map(|b| &b.resnets));
    // norm1 + norm2 (w and b), and the combined output bias.
    let mut vecs: usize = resnets
        .map(|r| 2 * r.norm1.weight.len() + 3 * r.norm2.weight.len())
        .sum();
    vecs += 2 * model.norm_out.weight.len();
    if let Some(a) = &model.mid_attention {
        vecs += 2 * a.norm.weight.len();
    }
    (mats + 4 * vecs) as u64
}

/// The codecs `dequant_rows` reads; q4 needs whole 32-value groups.
pub(super) fn check_codec(name: &str, c: &ConvW) -> Result<(), Refusal> {
    let w = &c.weight;
    DevCodec::of(w.dtype).map_err(|r| Refusal::new(OP_LOAD, r))?;
    if matches!(w.dtype, Dtype::Q4Block | Dtype::Q4Tiled) && (w.rows * w.cols) % 32 != 0 {
        return Err(shape_refusal(
            OP_LOAD,
            format!(
                "{name}: q4 weight [{}, {}] is not whole 32-value groups",
                w.rows, w.cols
            ),
        ));
    }
    Ok(())
}

/// Load-time uploads: weights to bf16 planes, vectors to f32.
pub(super) struct Uploader<'d> {
    pub(super) dev: &'d Dev,
    pub(super) k: &'d Kernels,
}

impl Uploader<'_> {
    pub(super) fn vec(&self, v: &[f32]) -> DResult<DBuf> {
        self.dev.upload_new(bytes_of(v))
    }

    pub(super) fn norm(&self, n: &GroupNormW) -> DResult<DNorm> {
        Ok(DNorm {
            w: self.vec(n.weight)?,
            b: self.vec(n.bias)?,
        })
    }

    /// A weight as a bf16 plane `[rows, cols]`; `taps`: a 3×3 kernel, permuted to tap-major.
    pub(super) fn conv(&self, c: &ConvW, taps: bool) -> DResult<DConv> {
        let w = &c.weight;
        let (rows, cols) = (w.rows, w.cols);
        let n = rows * cols;
        let dw = DevWeight::upload(self.dev, w)?;
        let plane = if dw.codec == DevCodec::Bf16 {
            None
        } else {
            let b = self.dev.alloc(2 * n)?;
            dw.dequant(
                self.dev,
                &self.k.dequant_rows,
                0,
                rows,
                DequantTo::Bf16(b.ptr()),
            )?;
            Some(b)
        };
        let src = plane.as_ref().map_or(dw.w(), |b| b.ptr());
        let wbuf = if taps {
            let out = self.dev.alloc(2 * n)?;
            self.dev.launch(
                &self.k.permute_taps,
                grid1(n, 256 * 4),
                (256, 1, 1),
                0,
                &[
                    Arg::Ptr(src),
                    Arg::U64(rows as u64),
                    Arg::I32((cols / 9) as i32),
                    Arg::Ptr(out.ptr()),
                ],
            )?;
            out
        } else {
            match plane {
                Some(b) => b,
                None => dw.main,
            }
        };
        // The transient planes are freed when this returns: wait for the kernels reading them.
        self.dev.sync()?;
        let bias = if c.bias.is_empty() {
            self.vec(&vec![0f32; rows])?
        } else {
            self.vec(c.bias)?
        };
        Ok(DConv {
            w: wbuf,
            bias,
            cout: rows,
            cols,
        })
    }

    pub(super) fn resnet(&self, r: &ResnetW) -> DResult<DResnet> {
        let conv2 = self.conv(&r.conv2, true)?;
        let shortcut = r
            .shortcut
            .as_ref()
            .map(|s| self.conv(s, false))
            .transpose()?;
        let cout = r.conv2.weight.rows;
        let mut out_bias: Vec<f32> = if r.conv2.bias.is_empty() {
            vec![0.0; cout]
        } else {
            r.conv2.bias.to_vec()
        };
        if let Some(s) = &r.shortcut {
            for (o, b) in out_bias.iter_mut().zip(s.bias) {
                *o += b;
            }
        }
        Ok(DResnet {
            norm1: self.norm(&r.norm1)?,
            conv1: self.conv(&r.conv1, true)?,
            norm2: self.norm(&r.norm2)?,
            conv2,
            shortcut,
            out_bias: self.vec(&out_bias)?,
            cin: r.conv1.weight.cols / 9,
            cout,
        })
    }
}
