//! The neutral description of a Z-Image-style DiT that a backend can make resident
//! (`Gpu::load_dit`): geometry plus borrowed weights, filled by the model crate (cmf-zimage's
//! `ZImageDit::device_model`). Nothing here depends on a model crate.
//!
//! What runs where (see `docs/gpu.md`): the device does the caption embedding + context
//! refiner (`condition`), and every step's embed → noise refiner → joint layers → final layer;
//! the host computes the tiny timestep MLP, patchifies the latent and unpatchifies the output.

use cmf_kernels::Weight;

/// Sizes and constants of the transformer.
#[derive(Debug, Clone, PartialEq)]
pub struct DitGeometry {
    pub dim: usize,
    pub n_heads: usize,
    /// Hidden width of the SwiGLU feed-forward (w1/w3 rows).
    pub ffn: usize,
    /// RMSNorm eps of the block norms and the caption norm.
    pub norm_eps: f32,
    /// RMSNorm eps of the per-head q/k norms.
    pub qk_eps: f32,
    /// LayerNorm eps of the final layer.
    pub final_eps: f32,
    /// Features of one patch (2·2·latent channels).
    pub patch_dim: usize,
    pub cap_feat_dim: usize,
    /// Width of the adaLN conditioning vector (the t-embedding).
    pub adaln_dim: usize,
}

impl DitGeometry {
    pub fn head_dim(&self) -> usize {
        self.dim / self.n_heads
    }
}

/// `y = x · Wᵀ (+ b)`.
#[derive(Clone, Copy)]
pub struct DitLinear<'a> {
    pub w: Weight<'a>,
    pub b: Option<&'a [f32]>,
}

/// One transformer block; `ada` (`adaLN_modulation`, `[4·dim, adaln_dim]` + bias) is `None` for
/// the unmodulated context refiner.
pub struct DitBlockWeights<'a> {
    pub to_q: Weight<'a>,
    pub to_k: Weight<'a>,
    pub to_v: Weight<'a>,
    pub to_out: Weight<'a>,
    pub w1: Weight<'a>,
    pub w2: Weight<'a>,
    pub w3: Weight<'a>,
    pub norm_q: &'a [f32],
    pub norm_k: &'a [f32],
    pub attention_norm1: &'a [f32],
    pub attention_norm2: &'a [f32],
    pub ffn_norm1: &'a [f32],
    pub ffn_norm2: &'a [f32],
    pub ada: Option<DitLinear<'a>>,
}

/// Precision of the DiT blocks' GEMMs on the device (`cmf imagine --dit-precision`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DitPrecision {
    /// bf16 operands, f32 accumulation.
    #[default]
    Bf16,
    /// e4m3 operands with one scale per row of each (FP8 tensor cores; planes whose shape the
    /// FP8 GEMM does not take stay bf16), f32 accumulation.
    Fp8,
    /// [`DitPrecision::Fp8`] with the tensor cores' fast accumulation (fewer promotions to f32).
    Fp8Fast,
    /// s8 operands with one scale per row of each (int8 tensor cores; planes whose shape the
    /// int8 GEMM does not take stay bf16), exact s32 sums scaled to bf16.
    Int8,
}

impl DitPrecision {
    pub const NAMES: &'static str = "bf16, fp8, fp8-fast, int8";

    pub fn parse(s: &str) -> Option<DitPrecision> {
        match s {
            "bf16" => Some(DitPrecision::Bf16),
            "fp8" => Some(DitPrecision::Fp8),
            "fp8-fast" => Some(DitPrecision::Fp8Fast),
            "int8" => Some(DitPrecision::Int8),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DitPrecision::Bf16 => "bf16",
            DitPrecision::Fp8 => "fp8",
            DitPrecision::Fp8Fast => "fp8-fast",
            DitPrecision::Int8 => "int8",
        }
    }

    /// The block GEMMs' operand encoding: bf16, e4m3 or s8.
    pub fn operand(self) -> &'static str {
        match self {
            DitPrecision::Bf16 => "bf16",
            DitPrecision::Fp8 | DitPrecision::Fp8Fast => "e4m3",
            DitPrecision::Int8 => "s8",
        }
    }
}

/// Where the device DiT runs its attention in FP8 (`attn_full_ws8`: Hopper, head dim 128; the
/// bf16 attention elsewhere).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fp8Attention {
    /// With the FP8 GEMMs (`--dit-precision fp8`, `fp8-fast`), for items of at least 1024 keys:
    /// what `cmf imagine` runs.
    #[default]
    Auto,
    /// At every length and with any GEMM precision: tests that hold the kernel to its reference
    /// at small sizes and beside bf16 GEMMs.
    Always,
    /// Never: the bf16 attention.
    Never,
}

pub struct DitModel<'a> {
    pub geo: DitGeometry,
    /// What the blocks' GEMMs run in (a device without FP8 tensor cores runs bf16).
    pub precision: DitPrecision,
    /// Where the attention runs in FP8.
    pub fp8_attention: Fp8Attention,
    pub x_embedder: DitLinear<'a>,
    pub x_pad_token: &'a [f32],
    pub cap_norm: &'a [f32],
    pub cap_embedder: DitLinear<'a>,
    pub cap_pad_token: &'a [f32],
    pub noise_refiner: Vec<DitBlockWeights<'a>>,
    pub context_refiner: Vec<DitBlockWeights<'a>>,
    pub layers: Vec<DitBlockWeights<'a>>,
    /// `all_final_layer.2-1.adaLN_modulation.1` (input: SiLU of the t-embedding).
    pub final_ada: DitLinear<'a>,
    pub final_linear: DitLinear<'a>,
}

/// RoPE rows as cos/sin tables `[rows, head_dim / 2]` (interleaved pairs).
#[derive(Clone, Copy)]
pub struct RopeRows<'a> {
    pub cos: &'a [f32],
    pub sin: &'a [f32],
}

/// One item of a prepared batch: a resident caption and the RoPE rows of its joint sequence
/// `[image (Np) ; caption (Lp)]`.
#[derive(Clone, Copy)]
pub struct DitItemSetup<'a> {
    pub cond: CondId,
    pub rope: RopeRows<'a>,
}

/// One item of a step: which prepared item, its patchified latent `[Ni, patch_dim]`, and its
/// t-embedding `[adaln_dim]` (the output of the timestep MLP).
#[derive(Clone, Copy)]
pub struct DitStepItem<'a> {
    pub slot: usize,
    pub patches: &'a [f32],
    pub t_emb: &'a [f32],
}

/// A caption refined and resident on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CondId(pub usize);

/// Rows are padded to a multiple of this (diffusers `SEQ_MULTI_OF`).
pub const SEQ_MULTI_OF: usize = 32;

pub fn pad_rows(n: usize) -> usize {
    n.div_ceil(SEQ_MULTI_OF) * SEQ_MULTI_OF
}

#[cfg(test)]
mod tests {
    use super::DitPrecision;

    /// `NAMES` (the error message's list) names exactly what `parse` takes, in order.
    #[test]
    fn precision_names_parse_back() {
        let all = [
            DitPrecision::Bf16,
            DitPrecision::Fp8,
            DitPrecision::Fp8Fast,
            DitPrecision::Int8,
        ];
        for p in all {
            assert_eq!(DitPrecision::parse(p.name()), Some(p));
        }
        let names: Vec<&str> = all.iter().map(|p| p.name()).collect();
        assert_eq!(DitPrecision::NAMES, names.join(", "));
        assert_eq!(DitPrecision::parse("int4"), None);
    }
}
