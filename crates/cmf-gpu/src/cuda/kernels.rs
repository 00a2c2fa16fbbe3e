//! Kernel sources (one op family per `.cu` file, each opening with its design note), their
//! compilation into modules, and typed handles to the functions.
//!
//! `matvec.cu` and `sample.cu` are the same for every model and compiled once per backend;
//! `rowops.cu` and `attention.cu` are compiled per model geometry (head dim, GQA group, KV
//! precision are compile-time constants there) and cached on disk like the others.

use super::device::{Ctx, DResult, Dev, DevError};
use super::nvrtc;
use cudarc::driver::{sys, CudaFunction, CudaModule};
use cudarc::nvrtc::Ptx;
use std::sync::Arc;

pub const COMMON: &str = include_str!("kernels/common.cuh");
pub const MATVEC: &str = include_str!("kernels/matvec.cu");
pub const ROWOPS: &str = concat!(
    include_str!("kernels/kv.cuh"),
    include_str!("kernels/rope.cuh"),
    include_str!("kernels/rowops.cu")
);
pub const ATTENTION: &str = concat!(
    include_str!("kernels/kv.cuh"),
    include_str!("kernels/rope.cuh"),
    include_str!("kernels/attention_frag.cuh"),
    include_str!("kernels/attention.cu"),
    include_str!("kernels/attention_decode.cu")
);
/// Hopper-only (sm_90a): the DiT's attention on warpgroup MMA.
pub const ATTENTION_WG: &str = concat!(
    include_str!("kernels/attention_frag.cuh"),
    include_str!("kernels/attention_wg.cu")
);
pub const SAMPLE: &str = include_str!("kernels/sample.cu");
/// The DiT's row kernels (with the e4m3 encoder: some write FP8 GEMM inputs).
pub const DIT: &str = concat!(
    include_str!("kernels/e4m3.cuh"),
    include_str!("kernels/dit.cu")
);
pub const VAE: &str = include_str!("kernels/vae.cu");
/// e4m3 quantisation for the FP8 GEMMs (sm_89+).
pub const FP8: &str = concat!(
    include_str!("kernels/e4m3.cuh"),
    include_str!("kernels/fp8.cu")
);

/// Every source with the defines it is compiled with, for the compile check that needs no GPU.
/// (name, source, defines)
pub type SourceSet = Vec<(&'static str, &'static str, Vec<(&'static str, String)>)>;

pub fn all_sources() -> SourceSet {
    let model = |hd: usize, g: usize, f32kv: bool| {
        vec![
            ("HD", hd.to_string()),
            ("GQA", g.to_string()),
            ("KV_F32", (f32kv as u8).to_string()),
        ]
    };
    vec![
        ("matvec", MATVEC, vec![]),
        ("sample", SAMPLE, vec![]),
        ("rowops", ROWOPS, model(128, 4, false)),
        ("rowops", ROWOPS, model(64, 2, true)),
        ("attention", ATTENTION, model(128, 4, false)),
        ("attention", ATTENTION, {
            let mut d = model(128, 2, false);
            d.push(("DEC_EARLY_WAIT", "1".to_string()));
            d
        }),
        ("attention", ATTENTION, model(128, 2, true)),
        ("attention", ATTENTION, model(64, 1, false)),
        ("attention", ATTENTION, model(256, 8, false)),
        ("attention", ATTENTION, model(16, 2, true)),
        ("attention", ATTENTION, model(16, 2, false)),
        ("rowops", ROWOPS, model(16, 2, true)),
        ("dit", DIT, model(128, 1, false)),
        ("dit", DIT, model(32, 1, false)),
        ("attention", ATTENTION, model(32, 1, false)),
        ("rowops", ROWOPS, vec![]),
        ("vae", VAE, vec![]),
        ("fp8", FP8, vec![]),
    ]
}

/// Sources built only for Hopper's arch-specific target (`sm_90a`: wgmma), same shape as
/// [`all_sources`].
pub fn hopper_sources() -> SourceSet {
    vec![(
        "attention_wg",
        ATTENTION_WG,
        vec![
            ("HD", "128".to_string()),
            ("GQA", "1".to_string()),
            ("KV_F32", "0".to_string()),
        ],
    )]
}

/// Dynamic shared memory of attn_full_wg: 2 slots × (K + V) × 128 keys × 128 dims, f16, then
/// per warpgroup (2) a P block of 64 rows × 128 keys, f16, plus 1 KiB to align the swizzle atoms.
pub const WG_SMEM: usize = 2 * 2 * 128 * 128 * 2 + 2 * 64 * 128 * 2 + 1024;

/// Dynamic shared memory of attn_full_ws: 1 KiB to align the swizzle atoms, Q (128 rows × 128
/// dims, f16), 3 slots × (K + V) × 128 keys × 128 dims, f16, then 6 mbarriers.
pub const WS_SMEM: usize = 1024 + 128 * 128 * 2 + 3 * 2 * 128 * 128 * 2 + 64;

/// The source NVRTC sees: the common helpers, then the op family.
pub fn full_source(src: &str) -> String {
    format!("{COMMON}\n{src}")
}

/// A loaded module (kept alive by its functions).
pub struct Module {
    module: Arc<CudaModule>,
    pub name: &'static str,
}

impl Module {
    /// Compiles (or takes from the disk cache) and loads one source.
    pub fn load(
        dev: &Dev,
        name: &'static str,
        src: &str,
        defines: &[(&str, String)],
    ) -> DResult<Module> {
        Self::load_for(dev, name, src, defines, &dev.arch())
    }

    /// [`Module::load`] for an explicit NVRTC target (`sm_90a` for the wgmma kernels).
    pub fn load_for(
        dev: &Dev,
        name: &'static str,
        src: &str,
        defines: &[(&str, String)],
        arch: &str,
    ) -> DResult<Module> {
        let full = full_source(src);
        let arch = arch.to_string();
        let c = nvrtc::compile(name, &full, &arch, defines).map_err(DevError)?;
        if !c.log.is_empty() {
            crate::facade::log::debug(&format!("nvrtc {name}: {}", c.log));
        }
        let module = match dev.ctx.load_module(Ptx::from_binary(c.cubin)) {
            Ok(m) => m,
            Err(e) if c.from_cache => {
                // A cached image the driver rejects (another driver, a truncated file):
                // recompile once.
                crate::facade::log::debug(&format!("cached {name} rejected ({e:?}); recompiling"));
                nvrtc::forget(name, &full, &arch, defines);
                let c = nvrtc::compile(name, &full, &arch, defines).map_err(DevError)?;
                dev.ctx
                    .load_module(Ptx::from_binary(c.cubin))
                    .ctx(|| format!("loading module {name}"))?
            }
            Err(e) => return Err(DevError(format!("loading module {name}: {e:?}"))),
        };
        Ok(Module { module, name })
    }

    pub fn func(&self, fname: &str) -> DResult<Func> {
        let f = self
            .module
            .load_function(fname)
            .ctx(|| format!("{}: function {fname}", self.name))?;
        Ok(Func {
            raw: f.cu_function(),
            _keep: f,
        })
    }
}

/// A kernel entry point.
#[derive(Clone)]
pub struct Func {
    pub raw: sys::CUfunction,
    _keep: CudaFunction,
}

// SAFETY: a CUfunction is a handle valid in its context from any thread; the module it belongs
// to is kept alive by `_keep`.
unsafe impl Send for Func {}
unsafe impl Sync for Func {}

impl Func {
    /// Allows `bytes` of dynamic shared memory per block (beyond the 48 KiB default).
    pub fn allow_smem(&self, bytes: usize) -> DResult<()> {
        self._keep
            .set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
            .ctx(|| format!("allowing {bytes} B of shared memory"))
    }

    /// Statically declared shared memory of the kernel.
    pub fn static_smem(&self) -> usize {
        self._keep.shared_size_bytes().unwrap_or(0).max(0) as usize
    }

    pub fn regs(&self) -> i32 {
        self._keep.num_regs().unwrap_or(-1)
    }

    pub fn local_bytes(&self) -> i32 {
        self._keep.local_size_bytes().unwrap_or(-1)
    }
}

/// Kernels shared by every model.
pub struct CommonKernels {
    /// Indexed by `DevCodec as usize`.
    pub mv: [Func; 5],
    pub topk_partial: Func,
    pub topk_final: Func,
    _mods: Vec<Module>,
}

impl CommonKernels {
    pub fn load(dev: &Dev) -> DResult<CommonKernels> {
        let mv = Module::load(dev, "matvec", MATVEC, &[])?;
        let sample = Module::load(dev, "sample", SAMPLE, &[])?;
        let mvf = [
            mv.func("mv_q8")?,
            mv.func("mv_q4")?,
            mv.func("mv_bf16")?,
            mv.func("mv_f16")?,
            mv.func("mv_f32")?,
        ];
        // Matvec prologues keep x (f32 for float codecs) in shared memory: allow what the
        // device offers (227 KiB on Hopper).
        let max_smem = dev
            .ctx
            .attribute(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )
            .unwrap_or(48 * 1024) as usize;
        for f in &mvf {
            // The opt-in limit covers static + dynamic shared memory.
            f.allow_smem(max_smem.saturating_sub(f.static_smem()))?;
        }
        Ok(CommonKernels {
            mv: mvf,
            topk_partial: sample.func("topk_partial")?,
            topk_final: sample.func("topk_final")?,
            _mods: vec![mv, sample],
        })
    }
}

/// Dynamic shared memory of attn_prefill_fa2: 2 stages × (K + V) × 64 keys × (HD + 8) halves.
pub fn fa2_smem(head_dim: usize) -> usize {
    2 * 2 * 64 * (head_dim + 8) * 2
}

/// Compile-time choices of the decode attention (attention_decode.cu).
#[derive(Debug, Clone, Copy)]
pub struct DecodeAttnConfig {
    /// Fewest keys per split past the one-block length.
    pub min_chunk: usize,
    /// Up to this many visible keys, one block per kv head.
    pub one_block: usize,
    /// Wait for the predecessor first thing (else after prefetching K/V into L2).
    pub early_wait: bool,
}

/// Kernels compiled for one model's geometry.
pub struct ModelKernels {
    pub embed_rows: Func,
    pub rmsnorm_rows: Func,
    pub to_bf16: Func,
    pub swiglu_rows: Func,
    pub dequant_rows: Func,
    pub rope_qk_kv: Func,
    /// Decode attention with the q/k norm, RoPE and KV write fused in (attention_decode.cu).
    pub attn_decode: Func,
    pub attn_prefill_simple: Func,
    /// Tensor-core prefill attention (f16 cache, head_dim ≤ 128): version 1 (synchronous
    /// tile loads) and version 2 (cp.async double buffering, ldmatrix.trans for V).
    pub attn_prefill_mma: Option<Func>,
    pub attn_prefill_fa2: Option<Func>,
    _mods: Vec<Module>,
}

impl ModelKernels {
    pub fn load(
        dev: &Dev,
        head_dim: usize,
        group: usize,
        kv_f32: bool,
        dec: DecodeAttnConfig,
    ) -> DResult<ModelKernels> {
        let defs = vec![
            ("DEC_MIN_CHUNK", dec.min_chunk.to_string()),
            ("DEC_ONE_BLOCK", dec.one_block.to_string()),
            ("DEC_EARLY_WAIT", (dec.early_wait as u8).to_string()),
            ("HD", head_dim.to_string()),
            ("GQA", group.to_string()),
            ("KV_F32", (kv_f32 as u8).to_string()),
        ];
        let rows = Module::load(dev, "rowops", ROWOPS, &defs)?;
        let attn = Module::load(dev, "attention", ATTENTION, &defs)?;
        let tc = !kv_f32 && head_dim <= 128 && head_dim % 16 == 0;
        let mma = if tc {
            Some(attn.func("attn_prefill_mma")?)
        } else {
            None
        };
        let fa2 = if tc {
            let f = attn.func("attn_prefill_fa2")?;
            f.allow_smem(fa2_smem(head_dim))?;
            Some(f)
        } else {
            None
        };
        let k = ModelKernels {
            embed_rows: rows.func("embed_rows")?,
            rmsnorm_rows: rows.func("rmsnorm_rows")?,
            to_bf16: rows.func("to_bf16")?,
            swiglu_rows: rows.func("swiglu_rows")?,
            dequant_rows: rows.func("dequant_rows")?,
            rope_qk_kv: rows.func("rope_qk_kv")?,
            attn_decode: attn.func("attn_decode")?,
            attn_prefill_simple: attn.func("attn_prefill_simple")?,
            attn_prefill_mma: mma,
            attn_prefill_fa2: fa2,
            _mods: vec![rows, attn],
        };
        Ok(k)
    }
}
