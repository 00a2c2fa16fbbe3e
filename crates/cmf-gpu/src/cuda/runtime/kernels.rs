//! Kernel modules: compiling a source into a module (NVRTC, the disk cache, the embedded
//! images), loading it, and typed handles to its functions; and the kernel sources more than
//! one model compiles (`kernels/`: one op family per `.cu` file, each opening with its design
//! note). A model's own sources live in its folder (`cuda/llm/kernels/`, `cuda/dit/kernels/`,
//! `cuda/vae/kernels/`).
//!
//! `rowops.cu` and `attention.cu` are compiled per model geometry (head dim, GQA group, KV
//! precision are compile-time constants there) and cached on disk like the others. A loader
//! compiles its modules in parallel ([`compile_parallel`]); a first run on a machine waits for
//! the slowest module, not for their sum.

use super::device::{Arg, Ctx, DResult, Dev, DevError};
pub use super::func::Func;
use super::nvrtc;
pub use super::source::full_source;
use cudarc::driver::CudaModule;
use cudarc::nvrtc::Ptx;
use std::sync::Arc;

/// Row kernels of the transformer layers (embedding, RMSNorm, SwiGLU, RoPE, conversions): the
/// LLM, the DiT and the VAE each compile it.
pub const ROWOPS: &str = concat!(
    include_str!("kernels/kv.cuh"),
    include_str!("kernels/rope.cuh"),
    include_str!("kernels/rope_rows.cuh"),
    include_str!("kernels/rowops.cu")
);
/// Prefill attention (the LLM) and full attention (the DiT's `DIT_FULL` variants).
pub const ATTENTION: &str = concat!(
    include_str!("kernels/kv.cuh"),
    include_str!("kernels/rope.cuh"),
    include_str!("kernels/attention_frag.cuh"),
    include_str!("kernels/attention.cu")
);
/// e4m3 quantisation for the FP8 GEMMs (sm_89+).
pub const FP8: &str = concat!(
    include_str!("kernels/e4m3.cuh"),
    include_str!("kernels/fp8.cu")
);
/// s8 row quantisation and s32 → bf16 scaling for the int8 GEMMs (e4m3.cuh holds the s8
/// row encoding beside the e4m3 one).
pub const INT8: &str = concat!(
    include_str!("kernels/e4m3.cuh"),
    include_str!("kernels/int8.cu")
);

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
        Ok(Func::new(f))
    }
}

/// Dynamic shared memory of attn_prefill_fa2: 2 stages × (K + V) × 64 keys × (HD + 8) halves.
pub fn fa2_smem(head_dim: usize) -> usize {
    2 * 2 * 64 * (head_dim + 8) * 2
}
