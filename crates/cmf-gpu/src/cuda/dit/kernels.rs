//! The DiT's kernel sources (`kernels/` here) and the build constants of its attention.

/// Hopper-only (sm_90a): the DiT's attention on warpgroup MMA.
pub const ATTENTION_WG: &str = concat!(
    include_str!("../runtime/kernels/e4m3.cuh"),
    include_str!("kernels/qknorm.cuh"),
    include_str!("../runtime/kernels/attention_frag.cuh"),
    include_str!("kernels/attention_wg.cu"),
    include_str!("kernels/attention_ws8.cu")
);
/// The DiT's row kernels (with the e4m3 encoder: some write FP8 GEMM inputs).
pub const DIT: &str = concat!(
    include_str!("../runtime/kernels/e4m3.cuh"),
    include_str!("kernels/qknorm.cuh"),
    include_str!("kernels/dit.cu")
);

/// Keys per K/V tile of attn_full_ws (its `WS_KEYS` define; 176 is FlashAttention-3's tile for
/// head dim 128; 128 keys with 3 slots measured no faster). The TMA boxes of K and V
/// span this many keys.
pub const WS_KEYS: usize = 176;

/// K/V slots of attn_full_ws at `keys` keys a tile (its `WS_SLOTS` default): as many as fit in
/// 227 KiB, at most 3.
pub const fn ws_slots(keys: usize) -> usize {
    if keys <= 128 {
        3
    } else {
        2
    }
}

/// Dynamic shared memory of attn_full_ws at `keys` keys a tile: 1 KiB to align the swizzle
/// atoms, Q (128 rows × 128 dims, f16), the slots × (K + V) × keys × 128 dims, f16, then 4
/// mbarriers a slot (K and V full, K and V empty). 214 080 bytes at 176 keys.
pub const fn ws_smem(keys: usize) -> usize {
    1024 + 128 * 128 * 2 + ws_slots(keys) * 2 * keys * 128 * 2 + 4 * 8 * ws_slots(keys)
}
const _: () = assert!(ws_smem(WS_KEYS) <= 227 * 1024 && ws_smem(128) <= 227 * 1024);

/// K/V slots of attn_full_ws8 (its `W8_SLOTS` default).
pub const WS8_SLOTS: usize = 4;

/// Dynamic shared memory of attn_full_ws8 (attention_ws8.cu, `W8_SMEM_BYTES`) with `slots`
/// slots: 1 KiB to align the swizzle atoms, Q (128 rows × 128 dims, e4m3), the slots × (K + Vᵀ
/// tiles of 128 keys × 128 dims, e4m3, and 1 KiB of ones rows), 4 mbarriers a slot, 128 f32 Q
/// row scales.
pub const fn ws8_smem(slots: usize) -> usize {
    1024 + 128 * 128 + slots * (2 * 128 * 128 + 1024) + 4 * 8 * slots + 128 * 4
}
const _: () = assert!(ws8_smem(6) <= 227 * 1024);
