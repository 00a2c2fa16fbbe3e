//! Kernel sources (one op family per `.cu` file, each opening with its design note), their
//! compilation into modules, and typed handles to the functions.
//!
//! `matvec.cu` and `sample.cu` are the same for every model and compiled once per backend;
//! `rowops.cu`, `attention.cu` and `attention_decode.cu` are compiled per model geometry (head
//! dim, GQA group, KV precision are compile-time constants there) and cached on disk like the
//! others. A loader compiles its modules in parallel ([`compile_parallel`]); a first run on a
//! machine waits for the slowest module, not for their sum.

use super::device::{Arg, Ctx, DResult, Dev, DevError};
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
    include_str!("kernels/attention.cu")
);
/// The decode attention: a module of its own so that it compiles beside the prefill one.
pub const ATTENTION_DECODE: &str = concat!(
    include_str!("kernels/kv.cuh"),
    include_str!("kernels/rope.cuh"),
    include_str!("kernels/attention_decode.cu")
);
/// Hopper-only (sm_90a): the DiT's attention on warpgroup MMA.
pub const ATTENTION_WG: &str = concat!(
    include_str!("kernels/e4m3.cuh"),
    include_str!("kernels/qknorm.cuh"),
    include_str!("kernels/attention_frag.cuh"),
    include_str!("kernels/attention_wg.cu"),
    include_str!("kernels/attention_ws8.cu")
);
pub const SAMPLE: &str = include_str!("kernels/sample.cu");
/// The DiT's row kernels (with the e4m3 encoder: some write FP8 GEMM inputs).
pub const DIT: &str = concat!(
    include_str!("kernels/e4m3.cuh"),
    include_str!("kernels/qknorm.cuh"),
    include_str!("kernels/dit.cu")
);
pub const VAE: &str = include_str!("kernels/vae.cu");
/// e4m3 quantisation for the FP8 GEMMs (sm_89+).
pub const FP8: &str = concat!(
    include_str!("kernels/e4m3.cuh"),
    include_str!("kernels/fp8.cu")
);
/// s8 row quantisation and s32 → bf16 scaling for the DiT's int8 GEMMs (e4m3.cuh holds the s8
/// row encoding beside the e4m3 one).
pub const INT8: &str = concat!(
    include_str!("kernels/e4m3.cuh"),
    include_str!("kernels/int8.cu")
);

/// A module's source by its name (the names `Job`s and `Module::load` use).
pub fn source_of(name: &str) -> Option<&'static str> {
    Some(match name {
        "matvec" => MATVEC,
        "rowops" => ROWOPS,
        "attention" => ATTENTION,
        "attention_decode" => ATTENTION_DECODE,
        "attention_wg" => ATTENTION_WG,
        "sample" => SAMPLE,
        "dit" => DIT,
        "vae" => VAE,
        "fp8" => FP8,
        "int8" => INT8,
        _ => return None,
    })
}

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
    // `defs` and one more define.
    let plus = |mut defs: Vec<(&'static str, String)>, name: &'static str| {
        defs.push((name, "1".to_string()));
        defs
    };
    vec![
        ("matvec", MATVEC, MatvecConfig::DEFAULT.defines()),
        ("matvec", MATVEC, MatvecConfig::SMALL.defines()),
        ("sample", SAMPLE, vec![]),
        ("rowops", ROWOPS, model(128, 4, false)),
        ("rowops", ROWOPS, model(64, 2, true)),
        ("attention", ATTENTION, model(128, 4, false)),
        ("attention_decode", ATTENTION_DECODE, model(128, 4, false)),
        (
            "attention_decode",
            ATTENTION_DECODE,
            plus(model(128, 2, false), "DEC_EARLY_WAIT"),
        ),
        ("attention", ATTENTION, model(128, 2, true)),
        ("attention_decode", ATTENTION_DECODE, model(128, 2, true)),
        ("attention", ATTENTION, model(64, 1, false)),
        ("attention_decode", ATTENTION_DECODE, model(64, 1, false)),
        ("attention", ATTENTION, model(256, 8, false)),
        ("attention_decode", ATTENTION_DECODE, model(256, 8, false)),
        ("attention", ATTENTION, model(16, 2, true)),
        ("attention_decode", ATTENTION_DECODE, model(16, 2, true)),
        ("attention", ATTENTION, model(16, 2, false)),
        ("attention_decode", ATTENTION_DECODE, model(16, 2, false)),
        ("rowops", ROWOPS, model(16, 2, true)),
        ("dit", DIT, model(128, 1, false)),
        ("dit", DIT, model(32, 1, false)),
        ("dit", DIT, plus(model(128, 1, false), "X_BF16")),
        (
            "dit",
            DIT,
            plus(plus(model(128, 1, false), "X_BF16"), "ROW8_S8"),
        ),
        (
            "attention",
            ATTENTION,
            plus(model(32, 1, false), "DIT_FULL"),
        ),
        (
            "attention",
            ATTENTION,
            plus(model(128, 1, false), "DIT_FULL"),
        ),
        ("rowops", ROWOPS, vec![]),
        ("vae", VAE, vec![]),
        ("fp8", FP8, vec![]),
        ("int8", INT8, vec![]),
    ]
}

/// Sources built only for Hopper's arch-specific target (`sm_90a`: wgmma), same shape as
/// [`all_sources`]. attention_wg is built with the K/V tile size the engine runs ([`WS_KEYS`]).
pub fn hopper_sources() -> SourceSet {
    let wg = |keys: usize| {
        (
            "attention_wg",
            ATTENTION_WG,
            vec![
                ("HD", "128".to_string()),
                ("GQA", "1".to_string()),
                ("KV_F32", "0".to_string()),
                ("WS_KEYS", keys.to_string()),
            ],
        )
    };
    vec![wg(WS_KEYS)]
}

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

/// The source NVRTC sees: the common helpers, then the op family.
/// Launches one of the row quantisers (fp8.cu's `quant_rows_e4m3`, int8.cu's `quant_rows_s8`:
/// one signature, one 256-thread block a row): `rows` bf16 rows of `cols` values with row stride
/// `ld` at `x` become 8-bit rows at `q` and one f32 scale a row at `scale`. The callers check
/// the shapes their codec needs first.
pub fn launch_quant_rows(
    dev: &Dev,
    f: &Func,
    x: u64,
    (rows, cols, ld): (usize, usize, usize),
    q: u64,
    scale: u64,
) -> DResult<()> {
    dev.launch(
        f,
        (rows as u32, 1, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(x),
            Arg::I32(cols as i32),
            Arg::U64(ld as u64),
            Arg::Ptr(q),
            Arg::Ptr(scale),
        ],
    )
}

pub fn full_source(src: &str) -> String {
    format!("{COMMON}\n{src}")
}

/// One module to compile: a source with its defines, for an NVRTC target.
#[derive(Clone, Debug)]
pub struct Job {
    pub name: &'static str,
    pub src: &'static str,
    pub defines: Vec<(&'static str, String)>,
    pub arch: String,
}

impl Job {
    pub fn new(
        name: &'static str,
        src: &'static str,
        defines: &[(&'static str, String)],
        arch: &str,
    ) -> Job {
        Job {
            name,
            src,
            defines: defines.to_vec(),
            arch: arch.to_string(),
        }
    }
}

/// Compiles every job not yet in the disk cache, one thread each, and returns when all are
/// done. Errors are left for [`Module::load_job`] to report (it finds the same failure).
/// Why: a first run on a machine compiles ~10 modules of 0.1–4 s each; in parallel the wait
/// is the longest one instead of their sum.
pub fn compile_parallel(jobs: &[Job]) {
    if jobs.len() < 2 {
        return;
    }
    std::thread::scope(|s| {
        for j in jobs {
            s.spawn(move || {
                let _ = nvrtc::compile(j.name, &full_source(j.src), &j.arch, &j.defines);
            });
        }
    });
}

/// Starts compiling `jobs` in the background (to the disk cache and the process's shared
/// results), so that the loaders that need them later find them done or in progress.
pub fn prefetch(jobs: Vec<Job>) {
    if jobs.is_empty() {
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("cmf-nvrtc-prefetch".into())
        .spawn(move || compile_parallel(&jobs));
    if let Err(e) = spawned {
        crate::facade::log::debug(&format!("kernel prefetch not started: {e}"));
    }
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

    /// Loads one job's module.
    pub fn load_job(dev: &Dev, j: &Job) -> DResult<Module> {
        Self::load_for(dev, j.name, j.src, &j.defines, &j.arch)
    }

    /// Compiles `jobs` in parallel, then loads them in order.
    pub fn load_all(dev: &Dev, jobs: &[Job]) -> DResult<Vec<Module>> {
        compile_parallel(jobs);
        jobs.iter().map(|j| Self::load_job(dev, j)).collect()
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
    /// How the matvecs were built and are launched.
    pub mv_config: MatvecConfig,
    /// The matvecs built for small weights ([`MatvecConfig::SMALL`]), used up to
    /// `mv_small_bytes` of weights a launch.
    pub mv_small: Option<[Func; 5]>,
    /// [`MatvecConfig::SMALL_BYTES`].
    pub mv_small_bytes: u64,
    pub topk_partial: Func,
    pub sample_final: Func,
    pub penalize: Func,
    /// Most shared memory (static + dynamic) a block may opt into on this device
    /// (`MAX_SHARED_MEMORY_PER_BLOCK_OPTIN`: 227 KiB on Hopper; 48 KiB if the query fails).
    pub max_block_smem: usize,
    _mods: Vec<Module>,
}

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

    fn defines(&self) -> Vec<(&'static str, String)> {
        vec![
            ("MV_U", self.chunks_in_flight.to_string()),
            ("MV_MINB", self.min_blocks.to_string()),
        ]
    }
}

impl CommonKernels {
    /// The modules: matvec in the default shape, sample, and the small-matrix matvec.
    pub fn jobs(dev: &Dev) -> Vec<Job> {
        let arch = dev.arch();
        vec![
            Job::new("matvec", MATVEC, &MatvecConfig::DEFAULT.defines(), &arch),
            Job::new("sample", SAMPLE, &[], &arch),
            Job::new("matvec", MATVEC, &MatvecConfig::SMALL.defines(), &arch),
        ]
    }

    pub fn load(dev: &Dev) -> DResult<CommonKernels> {
        let mv_config = MatvecConfig::DEFAULT;
        let mut mods = Module::load_all(dev, &Self::jobs(dev))?.into_iter();
        let (mv, sample) = (mods.next().expect("jobs"), mods.next().expect("jobs"));
        let small = mods.next();
        let funcs = |m: &Module| -> DResult<[Func; 5]> {
            Ok([
                m.func("mv_q8")?,
                m.func("mv_q4")?,
                m.func("mv_bf16")?,
                m.func("mv_f16")?,
                m.func("mv_f32")?,
            ])
        };
        let mvf = funcs(&mv)?;
        let mv_small = small.as_ref().map(funcs).transpose()?;
        // Matvec prologues keep x (f32 for float codecs) in shared memory: allow what the
        // device offers (227 KiB on Hopper).
        let max_block_smem = dev
            .ctx
            .attribute(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )
            .unwrap_or(48 * 1024) as usize;
        for f in mvf.iter().chain(mv_small.iter().flatten()) {
            // The opt-in limit covers static + dynamic shared memory.
            f.allow_smem(max_block_smem.saturating_sub(f.static_smem()))?;
        }
        let topk_partial = sample.func("topk_partial")?;
        let sample_final = sample.func("sample_final")?;
        let penalize = sample.func("penalize")?;
        let mut mods = vec![mv, sample];
        mods.extend(small);
        Ok(CommonKernels {
            mv: mvf,
            mv_config,
            mv_small,
            mv_small_bytes: MatvecConfig::SMALL_BYTES,
            topk_partial,
            sample_final,
            penalize,
            max_block_smem,
            _mods: mods,
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
    /// The same for contexts of at most `one_block` keys, K/V staged in shared memory.
    pub attn_decode_short: Func,
    pub attn_prefill_simple: Func,
    /// Tensor-core prefill attention (f16 cache, head_dim ≤ 128; cp.async double buffering,
    /// ldmatrix.trans for V).
    pub attn_prefill_fa2: Option<Func>,
    _mods: Vec<Module>,
}

impl ModelKernels {
    /// The modules for one geometry: rowops, the prefill attention and the decode attention.
    pub fn jobs(
        dev: &Dev,
        head_dim: usize,
        group: usize,
        kv_f32: bool,
        dec: DecodeAttnConfig,
    ) -> Vec<Job> {
        let defs = vec![
            ("DEC_MIN_CHUNK", dec.min_chunk.to_string()),
            ("DEC_ONE_BLOCK", dec.one_block.to_string()),
            ("DEC_EARLY_WAIT", (dec.early_wait as u8).to_string()),
            ("HD", head_dim.to_string()),
            ("GQA", group.to_string()),
            ("KV_F32", (kv_f32 as u8).to_string()),
        ];
        let arch = dev.arch();
        vec![
            Job::new("rowops", ROWOPS, &defs, &arch),
            Job::new("attention", ATTENTION, &defs, &arch),
            Job::new("attention_decode", ATTENTION_DECODE, &defs, &arch),
        ]
    }

    pub fn load(
        dev: &Dev,
        head_dim: usize,
        group: usize,
        kv_f32: bool,
        dec: DecodeAttnConfig,
    ) -> DResult<ModelKernels> {
        let [rows, attn, dec_attn]: [Module; 3] =
            Module::load_all(dev, &Self::jobs(dev, head_dim, group, kv_f32, dec))?
                .try_into()
                .map_err(|_| DevError("model kernels: three modules expected".into()))?;
        let tc = !kv_f32 && head_dim <= 128 && head_dim % 16 == 0;
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
            attn_decode: dec_attn.func("attn_decode")?,
            attn_decode_short: dec_attn.func("attn_decode_short")?,
            attn_prefill_simple: attn.func("attn_prefill_simple")?,
            attn_prefill_fa2: fa2,
            _mods: vec![rows, attn, dec_attn],
        };
        Ok(k)
    }
}
