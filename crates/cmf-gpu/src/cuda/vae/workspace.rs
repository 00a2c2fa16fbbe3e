//! The decoder's activation buffers for one image size (and cuDNN's), sized from the plan.

use super::*;

pub(super) struct AttnBufs {
    pub(super) proj: DBuf,
    pub(super) q: DBuf,
    pub(super) k: DBuf,
    pub(super) vt: DBuf,
}

/// Buffers of a decode, sized by `plan` (reused by any decode it covers).
pub(super) struct Workspace {
    pub(super) plan: VaePlan,
    pub(super) f: [DBuf; 3],
    pub(super) nb: DBuf,
    pub(super) scratch: DBuf,
    pub(super) partial: DBuf,
    pub(super) mean: DBuf,
    pub(super) inv: DBuf,
    pub(super) latent: DBuf,
    pub(super) image: DBuf,
    pub(super) attn: Option<AttnBufs>,
    pub(super) dnn: Option<DnnBufs>,
}

/// The cuDNN conv path's buffers: the upsampled input (bf16), the conv output (bf16, read by the
/// next row kernel) and cuDNN's workspace.
pub(super) struct DnnBufs {
    pub(super) up: DBuf,
    pub(super) y: DBuf,
    pub(super) ws: DBuf,
}

/// Bytes of [`DnnBufs`] for the convs of a decode: (upsampled input, output, workspace).
pub(super) fn dnn_sizes(
    dnn: &Cudnn,
    g: &VaeGeometry,
    h: usize,
    w: usize,
) -> DResult<(usize, usize, usize)> {
    let (mut up, mut y, mut ws) = (0usize, 0usize, 0usize);
    for (hh, ww, cin, cout, upsampled) in conv3_shapes(g, h, w) {
        if upsampled {
            up = up.max(2 * hh * ww * cin);
        }
        y = y.max(2 * hh * ww * cout);
        ws = ws.max(dnn.workspace_bytes((hh, ww, cin, cout))?);
    }
    Ok((up.max(16), y.max(16), ws.max(16)))
}

impl Workspace {
    pub(super) fn alloc(
        dev: &Dev,
        plan: &VaePlan,
        dnn: Option<(usize, usize, usize)>,
    ) -> DResult<Workspace> {
        let f32s = |n: usize| dev.alloc(4 * n);
        let attn = match plan.attn {
            Some(a) => Some(AttnBufs {
                proj: f32s(a.n * a.c)?,
                q: dev.alloc(2 * a.n * a.c)?,
                k: dev.alloc(2 * a.n * a.c)?,
                vt: dev.alloc(2 * a.n * a.c)?,
            }),
            None => None,
        };
        Ok(Workspace {
            plan: plan.clone(),
            f: [
                f32s(plan.act_f32)?,
                f32s(plan.act_f32)?,
                f32s(plan.act_f32)?,
            ],
            nb: dev.alloc(2 * plan.act_bf16)?,
            scratch: dev.alloc(plan.scratch_bytes)?,
            partial: f32s(plan.gn_partial)?,
            mean: f32s(plan.groups)?,
            inv: f32s(plan.groups)?,
            latent: f32s(plan.latent)?,
            // f32 values, or RGB bytes and the flag after them (≤ 4 · image + 4 bytes).
            image: dev.alloc(4 * plan.image + 4)?,
            attn,
            dnn: match dnn {
                Some((up, y, ws)) => Some(DnnBufs {
                    up: dev.alloc(up)?,
                    y: dev.alloc(y)?,
                    ws: dev.alloc(ws)?,
                }),
                None => None,
            },
        })
    }
}
