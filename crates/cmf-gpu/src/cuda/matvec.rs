//! Host side of `kernels/matvec.cu`: packs the segment table and picks the grid.

use super::device::{Arg, DResult, Dev};
use super::kernels::{CommonKernels, MatvecConfig};
use super::weights::{DevCodec, DevWeight};

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
    ck: &CommonKernels,
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
    let (funcs, config) = match &ck.mv_small {
        Some(f) if weight_bytes <= ck.mv_small_bytes || whole_rows => (f, MatvecConfig::SMALL),
        _ => (&ck.mv, ck.mv_config),
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
