//! A step's device buffers (activations, refined captions, the prepared items) and the row
//! layout that ties each row to its item and attention sequence.

use super::*;

/// A refined caption: `[lp, D]` rows of the residual stream's type.
pub(super) struct Cond {
    pub(super) rows: DBuf,
    pub(super) lp: usize,
}

/// Activation buffers for up to `rows` rows.
pub(super) struct Work {
    pub(super) rows: usize,
    /// The O and w2 GEMMs' output, bf16 `[rows, d]` (read by `residual_norm`).
    pub(super) o: DBuf,
    pub(super) hb: DBuf,
    pub(super) qkv: DBuf,
    /// Q for the attention; before the blocks, the embedding GEMMs' f32 output `[rows, d]`.
    pub(super) q: DBuf,
    pub(super) kc: DBuf,
    pub(super) vc: DBuf,
    pub(super) g: DBuf,
    /// 8-bit path: the 8-bit activation rows (up to max(D, F) wide) and their scales.
    pub(super) xq: Option<(DBuf, DBuf)>,
    /// int8 path: the s32 sums of the widest block GEMM (`[rows, max(3D, 2F)]`).
    pub(super) acc: Option<DBuf>,
    /// FP8 attention: its operands.
    pub(super) attn8: Option<Attn8Bufs>,
}

/// The FP8 attention's operands for up to `rows` rows in at most [`Attn8Bufs::SEGS`] items.
pub(super) struct Attn8Bufs {
    /// e4m3 Q rows `[rows, NH, 128]` and their f32 scales `[rows, NH]`.
    pub(super) q8: DBuf,
    pub(super) qsc: DBuf,
    /// e4m3 K, laid out as the f16 `kc`.
    pub(super) k8: DBuf,
    /// e4m3 Vᵀ, item after item, each `[NH, 128, lp]` (lp: its length rounded up to 128).
    pub(super) vt8: DBuf,
    /// u32 `[SEGS, NH]`: per item the V maxima of each head.
    pub(super) amax: DBuf,
}

impl Attn8Bufs {
    pub(super) const SEGS: usize = 8;
}

impl Work {
    /// The 8-bit input rows and scales of the GEMM on `w` when it runs in 8 bits.
    pub(super) fn q8_input(&self, w: &Plane) -> Option<(u64, u64)> {
        match (w.q8(), &self.xq) {
            (Some(_), Some((q, s))) => Some((q.ptr(), s.ptr())),
            _ => None,
        }
    }

    /// Where a row kernel writes the input of the GEMM on `w`: 8-bit rows when that GEMM runs
    /// in 8 bits, else bf16 rows in `hb`.
    pub(super) fn gemm_input(&self, w: &Plane) -> RowOut {
        match self.q8_input(w) {
            Some((q, scale)) => RowOut::Row8 { q, scale },
            None => RowOut::Bf16(self.hb.ptr()),
        }
    }
}

/// A pass of blocks over `rows` rows of `x`.
pub(super) struct Pass<'p> {
    pub(super) x: u64,
    pub(super) rows: usize,
    pub(super) map: u64,
    pub(super) cos: u64,
    pub(super) sin: u64,
    /// Every item's attention sequence.
    pub(super) segs: &'p [Seg],
}

/// One item's attention sequence: joint rows `j .. j + l`; its first `np` rows are X rows
/// `img_row0 ..`, the rest X rows `cap_row0 ..`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Seg {
    pub(super) j: usize,
    pub(super) l: usize,
    pub(super) img_row0: usize,
    pub(super) np: usize,
    pub(super) cap_row0: usize,
}

impl Seg {
    /// Whether the item's keys are consecutive X rows (its caption right after its image, or
    /// no caption keys): true at batch 1, where attn_full_ws reads V from the GEMM's rows.
    pub(super) fn keys_contiguous(&self) -> bool {
        self.l == self.np || self.cap_row0 == self.img_row0 + self.np
    }
}

/// What `prepare` set up.
pub(super) struct Prepared {
    pub(super) ni: usize,
    pub(super) np: usize,
    /// Per item: caption, its padded length, its first row in the RoPE tables.
    pub(super) items: Vec<(CondId, usize, usize)>,
    pub(super) cos: DBuf,
    pub(super) sin: DBuf,
    pub(super) x: DBuf,
    pub(super) work: Work,
    pub(super) map_main: DBuf,
    pub(super) map_nr: DBuf,
    pub(super) patches: DBuf,
    pub(super) temb: DBuf,
    pub(super) temb_silu: DBuf,
    pub(super) modv: DBuf,
    pub(super) fscale: DBuf,
    pub(super) out: DBuf,
    /// Where the step's output is read back to (pinned; `None`: pinned memory was refused, the
    /// readback goes to pageable memory).
    pub(super) out_host: Option<PinnedBuf>,
    /// The active slots the maps were last built for (the last step's).
    pub(super) maps_for: Vec<usize>,
    /// The step graph and the active slots it was captured for.
    pub(super) graph: Option<(Vec<usize>, Graph)>,
}

impl CudaDit {
    /// Drops the prepared run, keeping its activation buffers for the next (`spare_work`).
    pub(super) fn keep_work(&mut self) {
        if let Some(p) = self.prep.take() {
            self.spare_work = Some(p.work);
        }
    }

    pub(super) fn new_work(&self, rows: usize) -> DResult<Work> {
        let g = &self.geo;
        let (d, f) = (g.dim, g.ffn);
        let hb_w = d.max(f).max(g.cap_feat_dim).max(g.patch_dim);
        Ok(Work {
            rows,
            o: self.dev.alloc(rows * d * 2)?,
            hb: self.dev.alloc(rows * hb_w * 2)?,
            qkv: self.dev.alloc(rows * 3 * d * 2)?,
            q: self.dev.alloc(rows * d * 4)?,
            kc: self.dev.alloc(rows * d * 2)?,
            vc: self.dev.alloc(rows * d * 2)?,
            g: self.dev.alloc(rows * 2 * f * 2)?,
            xq: match self.gemm8_planes() {
                0 => None,
                _ => Some((self.dev.alloc(rows * d.max(f))?, self.dev.alloc(rows * 4)?)),
            },
            acc: match (&self.gemm8, self.gemm8_planes()) {
                (Some(Gemm8::Int8(_)), 1..) => Some(self.dev.alloc(rows * (3 * d).max(2 * f) * 4)?),
                _ => None,
            },
            attn8: match self.k.attn8 {
                Some(_) => Some(Attn8Bufs {
                    q8: self.dev.alloc(rows * d)?,
                    qsc: self.dev.alloc(rows * g.n_heads * 4)?,
                    k8: self.dev.alloc(rows * d)?,
                    vt8: self.dev.alloc((rows + Attn8Bufs::SEGS * W8_KEYS) * d)?,
                    amax: self.dev.alloc_zeroed(Attn8Bufs::SEGS * g.n_heads * 4)?,
                }),
                None => None,
            },
        })
    }
}

/// Row maps and attention segments of a step over the `active` prepared items.
pub(super) fn layout_rows(np: usize, items: &[(CondId, usize, usize)], active: &[usize]) -> Layout {
    let n = active.len();
    let mut main = vec![0i32; 0];
    let mut nr = vec![0i32; 0];
    let mut segs_main = Vec::with_capacity(n);
    let mut segs_nr = Vec::with_capacity(n);
    let mut cap_rows = Vec::with_capacity(n);
    let mut joint = 0;
    let mut caps = Vec::with_capacity(n);
    for (k, &s) in active.iter().enumerate() {
        let (_, lp, ro) = items[s];
        segs_nr.push(Seg {
            j: k * np,
            l: np,
            img_row0: k * np,
            np,
            cap_row0: 0,
        });
        caps.push((k, joint, lp, ro));
        joint += np + lp;
    }
    // X rows: [img of each active item] then [caption of each].
    for &(k, j, lp, ro) in &caps {
        for q in 0..np {
            main.extend([k, j, np + lp, q, ro + q].map(|v| v as i32));
            nr.extend([k, k * np, np, q, ro + q].map(|v| v as i32));
        }
    }
    let mut cap_row = n * np;
    for &(k, j, lp, ro) in &caps {
        cap_rows.push(cap_row);
        segs_main.push(Seg {
            j,
            l: np + lp,
            img_row0: k * np,
            np,
            cap_row0: cap_row,
        });
        for q in 0..lp {
            let pos = np + q;
            main.extend([k, j, np + lp, pos, ro + pos].map(|v| v as i32));
        }
        cap_row += lp;
    }
    Layout {
        main,
        nr,
        segs_main,
        segs_nr,
        cap_rows,
        rows: cap_row,
    }
}

pub(super) struct Layout {
    pub(super) main: Vec<i32>,
    pub(super) nr: Vec<i32>,
    pub(super) segs_main: Vec<Seg>,
    pub(super) segs_nr: Vec<Seg>,
    /// First X row of each active item's caption.
    pub(super) cap_rows: Vec<usize>,
    pub(super) rows: usize,
}
