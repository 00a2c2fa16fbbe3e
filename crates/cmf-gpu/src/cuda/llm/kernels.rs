//! The LLM's kernel modules: the decode attention and the sampler (`kernels/` here), beside the
//! runtime's matvec, row kernels and prefill attention, compiled for one model's geometry or
//! once per backend.

use crate::cuda::runtime::device::{DResult, Dev, DevError};
use crate::cuda::runtime::kernels::{fa2_smem, Func, Job, Module, ATTENTION, ROWOPS};
use crate::cuda::runtime::matvec::{MatvecConfig, MatvecKernels, MATVEC};
use cudarc::driver::sys;

/// The decode attention: a module of its own so that it compiles beside the prefill one.
pub const ATTENTION_DECODE: &str = concat!(
    include_str!("../runtime/kernels/kv.cuh"),
    include_str!("../runtime/kernels/rope.cuh"),
    include_str!("kernels/attention_decode.cu")
);
/// The batched step's kernels over the KV block pool (per-row RoPE and pool write, paged
/// attention, last-row gather, per-row arg-max); loaded with the pool.
pub const ATTENTION_PAGED: &str = concat!(
    include_str!("../runtime/kernels/kv.cuh"),
    include_str!("../runtime/kernels/rope.cuh"),
    include_str!("../runtime/kernels/rope_rows.cuh"),
    include_str!("kernels/attention_paged.cu")
);
/// The batched step's q8_row GEMMs: int8 tensor cores over input rows quantised in blocks of 32,
/// and bf16 tensor cores over bf16 rows with the weights widened in registers (W8A16).
pub const GEMM_Q8: &str = include_str!("kernels/gemm_q8.cu");
/// The sampler (penalties, candidates, the draw): the same for every model.
pub const SAMPLE: &str = include_str!("kernels/sample.cu");

/// The kernels every loaded LLM shares (matvec and sampling), built once per backend.
pub struct CommonKernels {
    pub matvec: MatvecKernels,
    pub topk_partial: Func,
    pub sample_final: Func,
    pub penalize: Func,
    /// A host-computed token mask applied to the logits (`apply_token_mask`).
    pub token_mask: Func,
    /// The vocabulary passes of sampled specs without top-k (sample.cu).
    pub sample_max: Func,
    pub sample_weights: Func,
    pub sample_radix: Func,
    pub sample_kept: Func,
    pub sample_draw: Func,
    /// The same over the rows of a batched step, each with its own sampler (`*_rows`).
    pub rows: RowSampleKernels,
    /// Most shared memory (static + dynamic) a block may opt into on this device
    /// (`MAX_SHARED_MEMORY_PER_BLOCK_OPTIN`: 227 KiB on Hopper; 48 KiB if the query fails).
    pub max_block_smem: usize,
    _mods: Vec<Module>,
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
        let mut mods = Module::load_all(dev, &Self::jobs(dev))?.into_iter();
        let (mv, sample) = (mods.next().expect("jobs"), mods.next().expect("jobs"));
        let small = mods.next();
        // Matvec prologues keep x (f32 for float codecs) in shared memory: allow what the
        // device offers (227 KiB on Hopper).
        let max_block_smem = dev
            .ctx
            .attribute(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )
            .unwrap_or(48 * 1024) as usize;
        let matvec = MatvecKernels::new(&mv, small.as_ref(), max_block_smem)?;
        let topk_partial = sample.func("topk_partial")?;
        let sample_final = sample.func("sample_final")?;
        let penalize = sample.func("penalize")?;
        let token_mask = sample.func("apply_token_mask")?;
        let sample_max = sample.func("sample_max")?;
        let sample_weights = sample.func("sample_weights")?;
        let sample_radix = sample.func("sample_radix")?;
        let sample_kept = sample.func("sample_kept")?;
        let sample_draw = sample.func("sample_draw")?;
        let rows = RowSampleKernels {
            penalize: sample.func("penalize_rows")?,
            topk_partial: sample.func("topk_partial_rows")?,
            sample_final: sample.func("sample_final_rows")?,
            sample_max: sample.func("sample_max_rows")?,
            sample_weights: sample.func("sample_weights_rows")?,
            sample_radix: sample.func("sample_radix_rows")?,
            sample_kept: sample.func("sample_kept_rows")?,
            sample_draw: sample.func("sample_draw_rows")?,
        };
        let mut mods = vec![mv, sample];
        mods.extend(small);
        Ok(CommonKernels {
            matvec,
            topk_partial,
            sample_final,
            penalize,
            token_mask,
            sample_max,
            sample_weights,
            sample_radix,
            sample_kept,
            sample_draw,
            rows,
            max_block_smem,
            _mods: mods,
        })
    }
}

/// sample.cu's batched-row kernels (`cuda/llm/batched/sample.rs` launches them).
pub struct RowSampleKernels {
    pub penalize: Func,
    pub topk_partial: Func,
    pub sample_final: Func,
    pub sample_max: Func,
    pub sample_weights: Func,
    pub sample_radix: Func,
    pub sample_kept: Func,
    pub sample_draw: Func,
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

/// The batched step's kernels (attention_paged.cu) for one model's geometry.
pub struct PagedKernels {
    pub rope_rows_paged: Func,
    pub attn_paged: Func,
    pub attn_paged_split: Func,
    pub attn_paged_combine: Func,
    pub gather_rows: Func,
    pub argmax_rows: Func,
    _module: Module,
}

impl PagedKernels {
    pub fn load(dev: &Dev, head_dim: usize, group: usize, kv_f32: bool) -> DResult<PagedKernels> {
        let defs = vec![
            ("HD", head_dim.to_string()),
            ("GQA", group.to_string()),
            ("KV_F32", (kv_f32 as u8).to_string()),
        ];
        let m = Module::load_job(
            dev,
            &Job::new("attention_paged", ATTENTION_PAGED, &defs, &dev.arch()),
        )?;
        Ok(PagedKernels {
            rope_rows_paged: m.func("rope_rows_paged")?,
            attn_paged: m.func("attn_paged")?,
            attn_paged_split: m.func("attn_paged_split")?,
            attn_paged_combine: m.func("attn_paged_combine")?,
            gather_rows: m.func("gather_rows")?,
            argmax_rows: m.func("argmax_rows")?,
            _module: m,
        })
    }
}

/// The batched step's q8_row GEMMs (gemm_q8.cu): the same for every model.
pub struct Q8GemmKernels {
    pub quant_blocks_s8: Func,
    /// 16 weight rows a block, each chunk split over 4 warps.
    pub gemm: Func,
    /// bf16 inputs, s8 weights widened in registers, K split over blocks.
    pub gemm_w8: Func,
    pub gemm_w8_reduce: Func,
    _module: Module,
}

impl Q8GemmKernels {
    pub fn load(dev: &Dev) -> DResult<Q8GemmKernels> {
        let m = Module::load_job(dev, &Job::new("gemm_q8", GEMM_Q8, &[], &dev.arch()))?;
        Ok(Q8GemmKernels {
            quant_blocks_s8: m.func("quant_blocks_s8")?,
            gemm: m.func("gemm_q8_narrow")?,
            gemm_w8: m.func("gemm_w8_bf16")?,
            gemm_w8_reduce: m.func("gemm_w8_reduce")?,
            _module: m,
        })
    }
}
