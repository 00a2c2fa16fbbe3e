//! The shape of a GatedDeltaNet layer (Qwen3-Next), shared by the CPU model (cmf-llm) and the
//! device description (cmf-gpu).

/// The shape of a GatedDeltaNet layer (transformers' `linear_*` config fields): `num_k_heads`
/// q/k heads of `k_head_dim`, `num_v_heads` value heads of `v_head_dim` (a multiple of the key
/// heads; value head h reads key head h / (v_heads / k_heads)), and a causal convolution of
/// `conv_kernel` taps over q|k|v.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdnGeometry {
    pub num_k_heads: usize,
    pub num_v_heads: usize,
    pub k_head_dim: usize,
    pub v_head_dim: usize,
    pub conv_kernel: usize,
}

impl GdnGeometry {
    /// Kd = k_heads · dk.
    pub fn key_dim(&self) -> usize {
        self.num_k_heads * self.k_head_dim
    }
    /// Vd = v_heads · dv.
    pub fn value_dim(&self) -> usize {
        self.num_v_heads * self.v_head_dim
    }
    /// Channels of the convolution: q | k | v.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
    /// Rows of the fused q|k|v|z projection.
    pub fn qkvz_dim(&self) -> usize {
        2 * self.key_dim() + 2 * self.value_dim()
    }
    /// Value heads per key head.
    pub fn v_per_k(&self) -> usize {
        self.num_v_heads / self.num_k_heads.max(1)
    }
    /// Floats of one sequence's recurrent state: the conv ring `[C, W − 1]` and the delta
    /// state `[v_heads, dk, dv]`.
    pub fn state_floats(&self) -> (usize, usize) {
        (
            self.conv_dim() * self.conv_kernel.saturating_sub(1),
            self.num_v_heads * self.k_head_dim * self.v_head_dim,
        )
    }
}
