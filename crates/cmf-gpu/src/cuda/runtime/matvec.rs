//! The decode matvec (`kernels/matvec.cu`, y = W·x on a codec plane with fused prologue and
//! epilogue): its source, build shapes, loaded functions, and the host side that packs the
//! segment table and picks the grid.

use super::device::{Arg, DResult, Dev};
use super::kernels::{Func, Module};
use super::weights::{DevCodec, DevWeight};

pub const MATVEC: &str = include_str!("kernels/matvec.cu");

/// Build and launch shape of the matvecs (matvec.cu): 16-byte chunks of a row in flight per
/// lane (`MV_U`), the resident blocks per SM the register allocation must allow (`MV_MINB`),
/// and the most blocks per SM the grid uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatvecConfig {
    pub chunks_in_flight: usize,
    pub min_blocks: usize,
    pub blocks_per_sm: usize,
}

impl MatvecConfig {
    /// Two blocks of 256 threads per SM need at most 128 registers a thread: say so to ptxas
    /// (NVRTC 13.5 gives the q8 kernel 132 without the bound, and the grid then runs in two
    /// waves: 996 against 1294 tok/s on Qwen3-0.6B q8, H200).
    pub const DEFAULT: MatvecConfig = MatvecConfig {
        chunks_in_flight: 4,
        min_blocks: 2,
        blocks_per_sm: 2,
    };

    /// Small weights (a launch of at most [`Self::SMALL_BYTES`]: Qwen3-0.6B's layers) are
    /// latency-bound: two chunks in flight leave 80 registers, so three blocks fit an SM and the
    /// jobs of the largest (gate|up, 3072 row pairs) take one round, every first load issued
    /// before the wait for the previous kernel. Measured side by side on the H200 (whole model in
    /// either shape): Qwen3-0.6B q8 1325 against 1272 tok/s; Qwen3-8B q8 369 against 386 and
    /// Qwen3-0.6B bf16 1101 against 1147, hence the byte limit. Rows of at most two chunks a
    /// lane (1 KiB: q8 with K = 1024) take it at any size, since the large shape would leave
    /// half its loads idle: Qwen3-0.6B's q8 lm_head (155 MB) there gave 1470 against 1440 tok/s.
    pub const SMALL: MatvecConfig = MatvecConfig {
        chunks_in_flight: 2,
        min_blocks: 3,
        blocks_per_sm: 3,
    };
    pub const SMALL_BYTES: u64 = 8 << 20;

    /// The module's defines for this shape.
    pub fn defines(&self) -> Vec<(&'static str, String)> {
        vec![
            ("MV_U", self.chunks_in_flight.to_string()),
            ("MV_MINB", self.min_blocks.to_string()),
        ]
    }
}

/// The loaded matvecs, one function per codec (indexed by `DevCodec as usize`).
pub struct MatvecKernels {
    pub mv: [Func; 5],
    /// How `mv` was built and is launched.
    pub config: MatvecConfig,
    /// The matvecs built for small weights ([`MatvecConfig::SMALL`]), used up to
    /// `small_bytes` of weights a launch.
    pub small: Option<[Func; 5]>,
    /// [`MatvecConfig::SMALL_BYTES`].
    pub small_bytes: u64,
}

impl MatvecKernels {
    /// The functions of `mv` (built with [`MatvecConfig::DEFAULT`]) and `small` (built with
    /// [`MatvecConfig::SMALL`]), allowed `max_block_smem` bytes of shared memory: the prologues
    /// keep x (f32 for float codecs) there.
    pub fn new(mv: &Module, small: Option<&Module>, max_block_smem: usize) -> DResult<Self> {
        let funcs = |m: &Module| -> DResult<[Func; 5]> {
            Ok([
                m.func("mv_q8")?,
                m.func("mv_q4")?,
                m.func("mv_bf16")?,
                m.func("mv_f16")?,
                m.func("mv_f32")?,
            ])
        };
        let mvf = funcs(mv)?;
        let mv_small = small.map(funcs).transpose()?;
        for f in mvf.iter().chain(mv_small.iter().flatten()) {
            // The opt-in limit covers static + dynamic shared memory.
            f.allow_smem(max_block_smem.saturating_sub(f.static_smem()))?;
        }
        Ok(MatvecKernels {
            mv: mvf,
            config: MatvecConfig::DEFAULT,
            small: mv_small,
            small_bytes: MatvecConfig::SMALL_BYTES,
        })
    }
}

/// Matvec epilogues (`mode` in matvec.cu).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MvMode {
    /// y = W·x (+ bias)
    Store = 0,
    /// y += W·x (+ bias): the residual add.
    Accumulate = 1,
    /// y = silu(W₀·x) · (W₁·x): segments are (gate, up).
    SwiGlu = 2,
}

/// One weight of a fused matvec, with its optional f32 bias (device pointer or 0).
#[derive(Clone, Copy)]
pub struct MvSeg<'a> {
    pub w: &'a DevWeight,
    pub bias: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct SegC {
    w: u64,
    rs: u64,
    col: u64,
    bias: u64,
    rows: i32,
    row0: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct MvArgsC {
    seg: [SegC; 3],
    nseg: i32,
    k: i32,
    x: u64,
    norm: u64,
    eps: f32,
    _pad: i32,
    y: u64,
    mode: i32,
    jobs: i32,
}

const WARPS: usize = 8;

/// Dynamic shared memory the prologue needs for `k` inputs.
pub fn smem_bytes(codec: DevCodec, k: usize, nq: usize) -> usize {
    match codec {
        DevCodec::Q8 | DevCodec::Q4 => nq * k + nq * (k / 32) * 8,
        _ => 4 * k,
    }
}

/// y = W·x for up to three weights sharing `x[K]` (same codec and K), with an optional fused
/// RMSNorm of x (`norm` = weight pointer, or 0) and the `mode` epilogue, as one launch.
#[allow(clippy::too_many_arguments)]
pub fn launch(
    dev: &Dev,
    mk: &MatvecKernels,
    segs: &[MvSeg],
    x: u64,
    norm: u64,
    eps: f32,
    y: u64,
    mode: MvMode,
    pdl: bool,
) -> DResult<()> {
    assert!(!segs.is_empty() && segs.len() <= 3);
    let codec = segs[0].w.codec;
    let k = segs[0].w.cols;
    debug_assert!(segs.iter().all(|s| s.w.codec == codec && s.w.cols == k));
    let mut a = MvArgsC {
        nseg: segs.len() as i32,
        k: k as i32,
        x,
        norm,
        eps,
        y,
        mode: mode as i32,
        ..Default::default()
    };
    let mut row0 = 0;
    for (i, s) in segs.iter().enumerate() {
        a.seg[i] = SegC {
            w: s.w.w(),
            rs: s.w.rs(),
            col: s.w.colp(),
            bias: s.bias,
            rows: s.w.rows as i32,
            row0,
        };
        row0 += s.w.rows as i32;
    }
    // Row pairs (or gate/up rows in SwiGLU mode).
    let jobs = match mode {
        MvMode::SwiGlu => segs[0].w.rows,
        _ => (row0 as usize).div_ceil(2),
    };
    a.jobs = jobs as i32;
    let nq = if codec == DevCodec::Q8 && segs.iter().any(|s| s.w.col.is_some()) {
        segs.len()
    } else {
        1
    };
    // The latency shape (MatvecConfig::SMALL), where it was built, for small weights and for
    // rows its chunks in flight cover whole (the large shape would leave half its loads idle).
    let weight_bytes: u64 = segs.iter().map(|s| s.w.bytes()).sum();
    let row_bytes = segs[0].w.main.len() / segs[0].w.rows.max(1);
    let whole_rows = row_bytes <= 512 * MatvecConfig::SMALL.chunks_in_flight;
    let (funcs, config) = match &mk.small {
        Some(f) if weight_bytes <= mk.small_bytes || whole_rows => (f, MatvecConfig::SMALL),
        _ => (&mk.mv, mk.config),
    };
    // `blocks_per_sm` resident blocks per SM at most; as many rounds of jobs as that takes, and
    // then as few blocks as give every warp the same number of rounds (no half-empty last
    // round).
    let max_blocks = config.blocks_per_sm * dev.sm_count as usize;
    let rounds = jobs.div_ceil(WARPS * max_blocks).max(1);
    let blocks = jobs.div_ceil(WARPS * rounds).max(1);
    // SAFETY: MvArgsC is repr(C) plain data mirroring `struct MvArgs` in matvec.cu.
    let args = unsafe {
        std::slice::from_raw_parts(
            &a as *const MvArgsC as *const u8,
            std::mem::size_of::<MvArgsC>(),
        )
    };
    dev.launch_ex(
        &funcs[codec as usize],
        (blocks as u32, 1, 1),
        ((WARPS * 32) as u32, 1, 1),
        smem_bytes(codec, k, nq) as u32,
        &[Arg::Bytes(args.to_vec())],
        pdl,
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn args_layout_matches_the_kernel() {
        // struct MvArgs in matvec.cu: 3 × 40-byte Seg, two ints, two pointers, float (+pad),
        // pointer, two ints.
        assert_eq!(std::mem::size_of::<super::SegC>(), 40);
        assert_eq!(std::mem::size_of::<super::MvArgsC>(), 168);
        assert_eq!(std::mem::offset_of!(super::MvArgsC, x), 128);
        assert_eq!(std::mem::offset_of!(super::MvArgsC, y), 152);
    }
}
