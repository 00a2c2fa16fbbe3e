//! The DiT's kernels: its sources (`kernels/` here), the build constants of its attention, and
//! the loaded functions a step launches.

use super::*;

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

pub(super) struct Kernels {
    pub(super) rows: RowKernels,
    pub(super) qk_norm_rope: Func,
    /// K (and V's maxima) where the attention makes Q and reads V from the rows.
    pub(super) k_norm_rope: Option<Func>,
    pub(super) bias_pad: Func,
    pub(super) ada_finish: Func,
    pub(super) add_bias: Func,
    pub(super) rms: Func,
    pub(super) final_norm: Func,
    /// The attention kernel ([`default_attention`]).
    pub(super) attn: AttnKernel,
    /// The FP8 attention, which replaces `attn` when loaded (see [`attn8_request`]).
    pub(super) attn8: Option<Attn8>,
    pub(super) dequant: Func,
    _mods: Vec<Module>,
}

impl Kernels {
    /// `row8_s8`: the row kernels write s8 GEMM rows (the int8 path) where they write 8-bit ones.
    pub(super) fn load(
        dev: &Dev,
        hd: usize,
        attn8: Option<usize>,
        x_bf16: bool,
        row8_s8: bool,
    ) -> DResult<Kernels> {
        let defs = vec![
            ("HD", hd.to_string()),
            ("GQA", "1".to_string()),
            ("KV_F32", "0".to_string()),
        ];
        let mut dit_defs = defs.clone();
        dit_defs.push(("X_BF16", (x_bf16 as u8).to_string()));
        if row8_s8 {
            dit_defs.push(("ROW8_S8", "1".to_string()));
        }
        let variant = default_attention(dev, hd);
        // Every module compiles at once (a first run on a machine), then each loads.
        let arch = dev.arch();
        let attn8_job = attn8.and_then(|_| Attn8::job(dev, hd, &defs));
        let mut jobs = vec![
            Job::new("dit", DIT, &dit_defs, &arch),
            Job::new("rowops", ROWOPS, &defs, &arch),
            attention_job(dev, &variant, &defs),
        ];
        jobs.extend(attn8_job.as_ref().map(|(j, _)| j.clone()));
        compile_parallel(&jobs);
        let dit = Module::load_job(dev, &jobs[0])?;
        let rows = Module::load_job(dev, &jobs[1])?;
        let attn = load_attention(dev, hd, variant, &jobs[2])?;
        let attn8 = match (attn8, attn8_job) {
            (Some(min_keys), Some(job)) => {
                Some(Attn8::load(dev, job, min_keys, attn.split.clone())?)
            }
            _ => None,
        };
        Ok(Kernels {
            rows: RowKernels::load(&dit)?,
            qk_norm_rope: dit.func("qk_norm_rope")?,
            k_norm_rope: Some(dit.func("k_norm_rope")?),
            bias_pad: dit.func("bias_pad_rows")?,
            ada_finish: dit.func("ada_finish")?,
            add_bias: dit.func("add_bias")?,
            rms: dit.func("rms_bf16")?,
            final_norm: dit.func("final_norm_bf16")?,
            attn,
            attn8,
            dequant: rows.func("dequant_rows")?,
            _mods: vec![dit, rows],
        })
    }

    /// Lets the row kernels keep a row of the model's widths in shared memory (the updated row
    /// of `residual_norm`, the e4m3 stashes).
    pub(super) fn allow_rows(&self, g: &DitGeometry) -> DResult<()> {
        self.rows.allow_rows(g.dim, g.ffn)
    }
}
