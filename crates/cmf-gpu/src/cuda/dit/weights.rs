//! The DiT's weights on the device: the checks before anything is uploaded, the block planes
//! (bf16, or 8-bit with row scales for the 8-bit GEMM paths), their byte counts, and the upload.

use super::*;

/// One block's GEMM planes and norm weights (f32).
pub(super) struct Block {
    pub(super) qkv: Plane,
    pub(super) out: Plane,
    pub(super) w13: Plane,
    pub(super) w2: Plane,
    pub(super) norm_q: DBuf,
    pub(super) norm_k: DBuf,
    /// The e4m3 scale of K in the FP8 attention ([`k8_scale`]).
    pub(super) k8_scale: f32,
    pub(super) n1: DBuf,
    pub(super) n2: DBuf,
    pub(super) f1: DBuf,
    pub(super) f2: DBuf,
}

/// A block GEMM's weight plane `[n, k]`, resident once: bf16, or 8-bit (the encoding of the
/// model's [`Gemm8`]) when an 8-bit path is on (`gemm8_request`) and cuBLASLt can run this
/// shape on 8-bit operands ([`q8_fits`]). The 8-bit plane is made on the device from the bf16
/// one, which is freed then: nothing reads it afterwards (a failed 8-bit GEMM refuses the step,
/// and the CPU runs it from the host's weights). The GEMM runs in 8 bits exactly on `Q8`.
pub(super) enum Plane {
    Bf16(DBuf),
    Q8(Plane8),
}

impl Plane {
    pub(super) fn q8(&self) -> Option<&Plane8> {
        match self {
            Plane::Q8(p) => Some(p),
            Plane::Bf16(_) => None,
        }
    }

    pub(super) fn bytes(&self) -> usize {
        match self {
            Plane::Bf16(w) => w.len(),
            Plane::Q8(p) => p.q.len() + p.s.len(),
        }
    }
}

/// Whether cuBLASLt's 8-bit GEMMs take an `[n, k]` plane: its FP8 and IMMA kernels want every
/// operand and leading dimension 16-byte aligned (an 8-bit row of k values is k bytes) and find
/// no FP8 algorithm for dimensions that are not multiples of 16 (PyTorch's `_scaled_mm` checks
/// the same). The activation row count m is a multiple of 32 here (`pad_rows`).
pub(super) fn q8_fits(n: usize, k: usize) -> bool {
    n % 16 == 0 && k % 16 == 0
}

/// A block's four GEMM planes as `[n, k]`: q|k|v, O, w1|w3, w2.
pub(super) fn block_plane_shapes(g: &DitGeometry) -> [(usize, usize); 4] {
    let (d, f) = (g.dim, g.ffn);
    [(3 * d, d), (d, d), (2 * f, d), (d, f)]
}

/// Z-Image-Turbo's block GEMMs (D = 3840, F = 10240) as (name, n, k), in
/// [`block_plane_shapes`]' order: the shapes the GEMM tools (`cmf-gemm-tune`, `cmf-fp8-probe`)
/// time.
pub const TURBO_BLOCK_GEMMS: [(&str, usize, usize); 4] = [
    ("q|k|v", 11520, 3840),
    ("O", 3840, 3840),
    ("w1|w3", 20480, 3840),
    ("w2", 3840, 10240),
];

/// A weight plane as 8-bit rows with one f32 scale per row ([`Gemm8::quantize`]).
pub(super) struct Plane8 {
    pub(super) q: DBuf,
    pub(super) s: DBuf,
}

impl Plane8 {
    pub(super) fn of(
        dev: &Dev,
        g: &Gemm8,
        plane: &DBuf,
        rows: usize,
        cols: usize,
    ) -> DResult<Plane8> {
        let p = Plane8 {
            q: dev.alloc(rows * cols)?,
            s: dev.alloc(rows * 4)?,
        };
        g.quantize(plane.ptr(), rows, cols, cols, p.q.ptr(), p.s.ptr())?;
        Ok(p)
    }
}

/// The block GEMMs' 8-bit operand encodings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Gemm8Kind {
    /// e4m3 (FP8 tensor cores), with fast accumulation or not.
    Fp8 { fast: bool },
    /// s8 with exact s32 sums (int8 tensor cores).
    Int8,
}

/// Whether the blocks' q|k|v, O, w1|w3 and w2 GEMMs run on 8-bit operands with per-row scales
/// on weights and activations (cuBLASLt), each whose shape cuBLASLt takes ([`q8_fits`]; the
/// others stay bf16), and in which encoding: the model's [`DitPrecision`].
pub(super) fn gemm8_request(precision: DitPrecision) -> Option<Gemm8Kind> {
    match precision {
        DitPrecision::Bf16 => None,
        DitPrecision::Fp8 => Some(Gemm8Kind::Fp8 { fast: false }),
        DitPrecision::Fp8Fast => Some(Gemm8Kind::Fp8 { fast: true }),
        DitPrecision::Int8 => Some(Gemm8Kind::Int8),
    }
}

/// The block GEMMs' 8-bit path, loaded.
pub(super) enum Gemm8 {
    /// e4m3 operands, with fast accumulation or not.
    Fp8(Fp8Gemm, bool),
    /// s8 operands.
    Int8(Int8Gemm),
}

impl Gemm8 {
    pub(super) fn new(dev: &Arc<Dev>, kind: Gemm8Kind) -> DResult<Gemm8> {
        Ok(match kind {
            Gemm8Kind::Fp8 { fast } => Gemm8::Fp8(Fp8Gemm::new(dev)?, fast),
            Gemm8Kind::Int8 => Gemm8::Int8(Int8Gemm::new(dev)?),
        })
    }

    /// `rows` bf16 rows of `cols` values (row stride `ld`) at `x` to 8-bit rows at `q` and
    /// their scales at `s`.
    pub(super) fn quantize(
        &self,
        x: u64,
        rows: usize,
        cols: usize,
        ld: usize,
        q: u64,
        s: u64,
    ) -> DResult<()> {
        match self {
            Gemm8::Fp8(g, _) => g.quantize(x, rows, cols, ld, q, s),
            Gemm8::Int8(g) => g.quantize(x, rows, cols, ld, q, s),
        }
    }
}

/// Checks the geometry and every weight before anything is uploaded.
pub(super) fn check_model(m: &DitModel) -> Result<(), Refusal> {
    let g = &m.geo;
    let op = "dit.load";
    if g.n_heads == 0 || g.dim % g.n_heads != 0 {
        return Err(refuse(op, "n_heads must divide dim"));
    }
    let hd = g.head_dim();
    if hd > 128 || hd % 16 != 0 || !hd.is_power_of_two() {
        return Err(refuse(
            op,
            format!("head dim {hd}: the device kernels need a power of two from 16 to 128"),
        ));
    }
    if g.dim % 8 != 0 {
        return Err(refuse(op, "dim must be a multiple of 8"));
    }
    let mut all: Vec<(String, &Weight)> = vec![
        ("x_embedder".into(), &m.x_embedder.w),
        ("cap_embedder".into(), &m.cap_embedder.w),
        ("final_ada".into(), &m.final_ada.w),
        ("final_linear".into(), &m.final_linear.w),
    ];
    for (part, blocks) in [
        ("noise_refiner", &m.noise_refiner),
        ("context_refiner", &m.context_refiner),
        ("layers", &m.layers),
    ] {
        for (i, b) in blocks.iter().enumerate() {
            let p = format!("{part}.{i}");
            for (n, w) in [
                ("to_q", &b.to_q),
                ("to_k", &b.to_k),
                ("to_v", &b.to_v),
                ("to_out", &b.to_out),
                ("w1", &b.w1),
                ("w2", &b.w2),
                ("w3", &b.w3),
            ] {
                all.push((format!("{p}.{n}"), w));
            }
            if let Some(a) = &b.ada {
                all.push((format!("{p}.adaLN"), &a.w));
            }
            if (b.ada.is_some()) != (part != "context_refiner") {
                return Err(refuse(
                    op,
                    format!("{p}: adaLN presence does not match the part"),
                ));
            }
        }
    }
    // Any column count: matrices whose columns the device dequantiser cannot take (not a
    // multiple of 32, e.g. the tiny fixture's FFN of 341) are expanded to bf16 on the host.
    for (name, w) in all {
        DevCodec::of(w.dtype).map_err(|r| Refusal::new(op, r))?;
        if w.rows == 0 || w.cols == 0 {
            return Err(refuse(op, format!("{name}: empty matrix")));
        }
    }
    let (d, f) = (g.dim, g.ffn);
    for b in m
        .noise_refiner
        .iter()
        .chain(&m.context_refiner)
        .chain(&m.layers)
    {
        let shapes_ok = [&b.to_q, &b.to_k, &b.to_v, &b.to_out]
            .iter()
            .all(|w| (w.rows, w.cols) == (d, d))
            && (b.w1.rows, b.w1.cols) == (f, d)
            && (b.w3.rows, b.w3.cols) == (f, d)
            && (b.w2.rows, b.w2.cols) == (d, f);
        if !shapes_ok {
            return Err(refuse(
                op,
                "a block's matrix shapes do not match the geometry",
            ));
        }
    }
    Ok(())
}

impl CudaDit {
    pub(super) fn upload(dev: Arc<Dev>, m: &DitModel) -> DResult<CudaDit> {
        let x_bf16 = RESIDUAL_BF16;
        let gemm8 = gemm8_request(m.precision).and_then(|kind| match Gemm8::new(&dev, kind) {
            Ok(g) => Some(g),
            Err(e) => {
                crate::facade::log::debug(&format!(
                    "dit: {kind:?} GEMMs unavailable, bf16 instead: {}",
                    e.0
                ));
                None
            }
        });
        let row8_s8 = matches!(gemm8, Some(Gemm8::Int8(_)));
        let hd = m.geo.head_dim();
        let k = Kernels::load(
            &dev,
            hd,
            attn8_request(m.precision, m.fp8_attention),
            x_bf16,
            row8_s8,
        )?;
        k.allow_rows(&m.geo)?;
        let blas = Blas::new(&dev)?;
        let up = Uploader {
            dev: &dev,
            dequant: &k.dequant,
            shapes: block_plane_shapes(&m.geo),
        };
        // Blocks upload on several threads (Dev::each_parallel) in bf16; where the 8-bit path
        // is on, this thread then turns their planes 8-bit on the device (Gemm8's cuBLASLt
        // state is not Sync), freeing each bf16 plane as it goes.
        let blocks = |bs: &[DitBlockWeights]| -> DResult<Vec<Block>> {
            let mut blocks = dev.each_parallel(bs, Dev::LOADER_THREADS, |b| up.block(b))?;
            if let Some(g) = &gemm8 {
                for b in &mut blocks {
                    up.to_q8(g, b)?;
                }
            }
            Ok(blocks)
        };
        let ada_ws: Vec<&DitLinear> = m
            .noise_refiner
            .iter()
            .chain(&m.layers)
            .map(|b| b.ada.as_ref().expect("checked"))
            .collect();
        let ada_bias: Vec<f32> = ada_ws
            .iter()
            .flat_map(|l| match l.b {
                Some(b) => b.to_vec(),
                None => vec![0.0; l.w.rows],
            })
            .collect();
        let ada_plane = up.plane(&ada_ws.iter().map(|l| &l.w).collect::<Vec<_>>())?;
        let ada_norms: Vec<f32> = m
            .noise_refiner
            .iter()
            .chain(&m.layers)
            .flat_map(|b| {
                [
                    b.attention_norm1,
                    b.attention_norm2,
                    b.ffn_norm1,
                    b.ffn_norm2,
                ]
                .into_iter()
                .flatten()
                .copied()
            })
            .collect();
        let dit = CudaDit {
            x_embed: up.linear(&m.x_embedder)?,
            x_pad: up.vec(m.x_pad_token)?,
            cap_norm: up.vec(m.cap_norm)?,
            cap_embed: up.linear(&m.cap_embedder)?,
            cap_pad: up.vec(m.cap_pad_token)?,
            ada: (ada_plane, up.vec(&ada_bias)?),
            ada_norms: up.vec(&ada_norms)?,
            final_ada: up.linear(&m.final_ada)?,
            final_lin: up.linear(&m.final_linear)?,
            noise: blocks(&m.noise_refiner)?,
            ctx: blocks(&m.context_refiner)?,
            layers: blocks(&m.layers)?,
            geo: m.geo.clone(),
            conds: Vec::new(),
            prep: None,
            prof: (std::env::var("CMF_DIT_PROFILE").as_deref() == Ok("1"))
                .then(|| RefCell::new([0.0; 3])),
            gemm8,
            x_bytes: if x_bf16 { 2 } else { 4 },
            no_graph: false,
            spare_work: None,
            blas,
            k,
            dev: dev.clone(),
        };
        dev.sync()?;
        Ok(dit)
    }
}

/// Device bytes of the weights as bf16 planes (the vectors not counted: a rounding error).
pub(super) fn bf16_weight_bytes(m: &DitModel) -> u64 {
    let w = |w: &Weight| (w.rows * w.cols * 2) as u64;
    let blk = |b: &DitBlockWeights| {
        [&b.to_q, &b.to_k, &b.to_v, &b.to_out, &b.w1, &b.w2, &b.w3]
            .iter()
            .map(|x| w(x))
            .sum::<u64>()
            + b.ada.as_ref().map_or(0, |a| w(&a.w))
    };
    let blocks: u64 = m
        .noise_refiner
        .iter()
        .chain(&m.context_refiner)
        .chain(&m.layers)
        .map(blk)
        .sum();
    blocks
        + [
            &m.x_embedder,
            &m.cap_embedder,
            &m.final_ada,
            &m.final_linear,
        ]
        .iter()
        .map(|l| w(&l.w))
        .sum::<u64>()
}

/// Device bytes of one block's 8-bit planes (rows and row scales; those that run in 8 bits).
pub(super) fn block_q8_bytes(g: &DitGeometry) -> u64 {
    block_plane_shapes(g)
        .iter()
        .filter(|&&(n, k)| q8_fits(n, k))
        .map(|&(n, k)| (n * k + 4 * n) as u64)
        .sum()
}

/// `w` decoded to bf16 bytes on the host (the slow path for odd column counts).
pub(super) fn host_bf16(w: &Weight) -> Vec<u8> {
    let mut row = vec![0f32; w.cols];
    let mut out = Vec::with_capacity(w.rows * w.cols * 2);
    for r in 0..w.rows {
        cmf_kernels::reference::decode_row(w, r, &mut row);
        out.extend(row.iter().flat_map(|&v| bf16::from_f32(v).to_le_bytes()));
    }
    out
}

/// Weight upload: any codec → a bf16 plane on the device; [`Uploader::to_q8`] turns a block's
/// GEMM planes 8-bit when an 8-bit path is on.
pub(super) struct Uploader<'u> {
    pub(super) dev: &'u Dev,
    /// `dequant_rows` (rowops.cu).
    pub(super) dequant: &'u Func,
    /// [`block_plane_shapes`] of the model.
    pub(super) shapes: [(usize, usize); 4],
}

impl Uploader<'_> {
    /// Stacks `ws` (same column count) row-wise into one bf16 plane.
    pub(super) fn plane(&self, ws: &[&Weight]) -> DResult<DBuf> {
        let cols = ws[0].cols;
        let rows: usize = ws.iter().map(|w| w.rows).sum();
        let plane = self.dev.alloc(rows * cols * 2)?;
        let mut r0 = 0;
        for w in ws {
            if w.cols != cols {
                return Err(DevError(
                    "stacked matrices must share their column count".into(),
                ));
            }
            let dst = plane.at(r0 * cols * 2);
            if w.dtype == Dtype::Bf16 {
                self.dev.upload(dst, w.data)?;
            } else if w.cols % 32 != 0 {
                self.dev.upload(dst, &host_bf16(w))?;
            } else {
                // The temporary codec planes are freed in stream order (after the kernel),
                // so the next weight's upload overlaps this one's.
                let tmp = DevWeight::upload(self.dev, w)?;
                tmp.dequant(self.dev, self.dequant, 0, w.rows, DequantTo::Bf16(dst))?;
            }
            r0 += w.rows;
        }
        Ok(plane)
    }

    pub(super) fn vec(&self, v: &[f32]) -> DResult<DBuf> {
        self.dev.upload_new(bytes_of(v))
    }

    pub(super) fn linear(&self, l: &DitLinear) -> DResult<(DBuf, DBuf)> {
        let b = match l.b {
            Some(b) => b.to_vec(),
            None => vec![0.0; l.w.rows],
        };
        Ok((self.plane(&[&l.w])?, self.vec(&b)?))
    }

    pub(super) fn block(&self, b: &DitBlockWeights) -> DResult<Block> {
        Ok(Block {
            qkv: Plane::Bf16(self.plane(&[&b.to_q, &b.to_k, &b.to_v])?),
            out: Plane::Bf16(self.plane(&[&b.to_out])?),
            w13: Plane::Bf16(self.plane(&[&b.w1, &b.w3])?),
            w2: Plane::Bf16(self.plane(&[&b.w2])?),
            norm_q: self.vec(b.norm_q)?,
            norm_k: self.vec(b.norm_k)?,
            k8_scale: k8_scale(b.norm_k, b.norm_k.len()),
            n1: self.vec(b.attention_norm1)?,
            n2: self.vec(b.attention_norm2)?,
            f1: self.vec(b.ffn_norm1)?,
            f2: self.vec(b.ffn_norm2)?,
        })
    }

    /// Each of `b`'s GEMM planes whose shape cuBLASLt runs in 8 bits, made 8-bit on the device;
    /// the bf16 plane is freed in stream order right after (so a load peaks at the bf16 planes
    /// plus one block's 8-bit ones, and keeps the 8-bit ones only).
    pub(super) fn to_q8(&self, g: &Gemm8, b: &mut Block) -> DResult<()> {
        let planes = [&mut b.qkv, &mut b.out, &mut b.w13, &mut b.w2];
        for (p, (n, k)) in planes.into_iter().zip(self.shapes) {
            if let (Plane::Bf16(w), true) = (&*p, q8_fits(n, k)) {
                *p = Plane::Q8(Plane8::of(self.dev, g, w, n, k)?);
            }
        }
        Ok(())
    }
}
