//! `cmf bench FILE -p 512 -n 128`: prompt-processing and generation speed with llama-bench's
//! contract (see `cmf_llm::bench`), printed as llama-bench's markdown table or as JSON;
//! `--parallel 1,4,8` prints llama-batched-bench's table instead (`cmf_llm::batch::bench`).

use std::path::PathBuf;

use anyhow::Context;
use cmf_format::CmfModel;
use cmf_llm::batch::bench::{self as batch_bench, BatchedBenchConfig};
use cmf_llm::bench::{self, BenchConfig};
use cmf_llm::Model;
use serde_json::json;

use super::llm_opts::EngineOpts;
use crate::exit::UsageError;

/// Measure prompt processing (ppN) and generation (tgN) speed.
#[derive(clap::Args)]
pub struct Args {
    /// A .cmf LLM file (or any shard of a set).
    file: PathBuf,
    /// Prompt tokens of the pp test (0 skips it).
    #[arg(short = 'p', long = "n-prompt", default_value_t = 512)]
    n_prompt: usize,
    /// Generated tokens of the tg test (0 skips it).
    #[arg(short = 'n', long = "n-gen", default_value_t = 128)]
    n_gen: usize,
    /// Repetitions of each test (mean ± standard deviation are reported).
    #[arg(short = 'r', long = "repetitions", default_value_t = 5)]
    reps: usize,
    /// Parallel sequence counts, e.g. 1,4,8: llama-batched-bench's table (PP / TG / total
    /// tok/s per count) on the batched CPU engine instead of the pp/tg tests.
    #[arg(long = "parallel", value_name = "LIST", value_delimiter = ',')]
    parallel: Vec<usize>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    engine: EngineOpts,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if args.reps == 0 {
        return Err(UsageError("-r/--repetitions must be at least 1".into()).into());
    }
    if args.n_prompt == 0 && args.n_gen == 0 {
        return Err(UsageError("nothing to run: -p and -n are both 0".into()).into());
    }
    if args.parallel.contains(&0) {
        return Err(UsageError("--parallel: counts must be at least 1".into()).into());
    }
    if !args.parallel.is_empty() && args.n_prompt == 0 {
        return Err(UsageError("--parallel needs a prompt: -p at least 1".into()).into());
    }
    let kv_dtype = args.engine.apply()?;
    let file = CmfModel::open(&args.file)?;
    let model = Model::load(&file).with_context(|| args.file.display().to_string())?;
    if !args.parallel.is_empty() {
        return run_batched(&args, &model, kv_dtype);
    }
    let limit = args.n_prompt.max(args.n_gen);
    if limit > model.config.max_position_embeddings {
        return Err(UsageError(format!(
            "{limit} tokens exceed the model's maximum positions {}",
            model.config.max_position_embeddings
        ))
        .into());
    }
    let cfg = BenchConfig {
        prompt_tokens: args.n_prompt,
        gen_tokens: args.n_gen,
        repetitions: args.reps,
        kv_dtype,
    };
    let mut gpu = args.engine.gpu_model(&model, limit)?;
    cmf_llm::profile::reset();
    let results = bench::run_on(&model, gpu.as_mut(), &cfg, &mut |test, rep| {
        eprint!("\r{test}: {rep}/{}   ", args.reps)
    })?;
    eprint!("\r{:30}\r", "");

    let (bytes, params) = file.tensors().fold((0u64, 0u64), |(b, p), t| {
        (b + t.data.len() as u64, p + t.numel() as u64)
    });
    let arch = &file.header().arch;
    let quant = format!("{:?}", file.header().quant_type).to_lowercase();
    let threads = cmf_kernels::num_threads();
    let isa = cmf_kernels::cpu::active().name();
    let backend = if gpu.is_some() {
        "CUDA".to_string()
    } else {
        format!("CPU ({isa}, kv {})", kv_dtype.name())
    };
    if args.json {
        let rows: Vec<_> = results
            .iter()
            .map(|r| {
                json!({
                    "model_filename": args.file.display().to_string(),
                    "model_type": format!("{} {}", arch.arch_name, quant),
                    "model_size": bytes,
                    "model_n_params": params,
                    "n_threads": threads,
                    "cpu_isa": isa,
                    "backend": backend,
                    "kv_type": kv_dtype.name(),
                    "test": r.test,
                    "n_prompt": r.n_prompt,
                    "n_gen": r.n_gen,
                    "avg_ts": r.mean(),
                    "stddev_ts": r.stddev(),
                    "samples_ts": r.samples,
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        println!("| model | size | params | backend | threads | test | t/s |");
        println!("| --- | ---: | ---: | --- | ---: | ---: | ---: |");
        for r in &results {
            println!(
                "| {} {} | {:.2} MiB | {:.2} M | {backend} | {threads} | {} | {:.2} ± {:.2} |",
                arch.arch_name,
                quant,
                bytes as f64 / (1024.0 * 1024.0),
                params as f64 / 1e6,
                r.test,
                r.mean(),
                r.stddev()
            );
        }
    }
    if let (false, Some(b)) = (args.json, cmf_llm::gpu::weight_bytes_per_token(&model)) {
        eprintln!(
            "weights read per decoded token: {:.2} MiB{}",
            b as f64 / (1024.0 * 1024.0),
            match &model.config.moe {
                Some(m) => format!(" ({} of {} experts a layer)", m.top_k, m.num_experts),
                None => String::new(),
            }
        );
    }
    if let Some(table) = cmf_llm::profile::report() {
        eprintln!("{table}");
    }
    Ok(())
}

/// `--parallel`: llama-batched-bench's table on the batched engine, on the device when `--gpu`
/// opens one (the whole model and its KV pool there), else the CPU.
fn run_batched(args: &Args, model: &Model, kv_dtype: cmf_kernels::KvDtype) -> anyhow::Result<()> {
    use cmf_gpu::facade::{Gpu, GpuMode};
    let (mode, layers) = args.engine.gpu_settings()?;
    if layers.is_some() {
        return Err(UsageError(
            "--parallel: the batched engine places the whole model (--gpu-layers is not taken)"
                .into(),
        )
        .into());
    }
    // As `EngineOpts::batch_device`: the note only where a device would have been used.
    let cpu_only = cmf_llm::gpu::cpu_only(model);
    let gpu = match (mode, cpu_only) {
        (GpuMode::Off, _) => None,
        (GpuMode::Cuda, Some(why)) => {
            eprintln!("note: {why}: the batched engine runs on the CPU");
            None
        }
        _ => Some(Gpu::open(mode)?).filter(|g| g.is_active()),
    };
    let gpu = match (gpu, cpu_only) {
        (Some(_), Some(why)) => {
            eprintln!("note: {why}: the batched engine runs on the CPU");
            None
        }
        (g, _) => g,
    };
    let len = args.n_prompt + args.n_gen;
    if len > model.config.max_position_embeddings {
        return Err(UsageError(format!(
            "-p + -n = {len} tokens exceed the model's maximum positions {}",
            model.config.max_position_embeddings
        ))
        .into());
    }
    let cfg = BatchedBenchConfig {
        prompt_tokens: args.n_prompt,
        gen_tokens: args.n_gen,
        parallel: args.parallel.clone(),
        kv_dtype,
    };
    cmf_llm::profile::reset();
    let rows = batch_bench::run(model, &cfg, gpu.as_ref(), &mut |b| {
        eprint!("\rB = {b} done   ")
    })?;
    let backend = if gpu.is_some() { "cuda" } else { "cpu" };
    // The device's batched kernel set (LlmOptions::batch_kernels), named beside its numbers.
    let kernels = match cmf_gpu::llm::BatchKernels::from_env() {
        cmf_gpu::llm::BatchKernels::Verified => "verified",
        cmf_gpu::llm::BatchKernels::Next => "next",
    };
    eprint!("\r{:30}\r", "");
    let threads = cmf_kernels::num_threads();
    if args.json {
        let out: Vec<_> = rows
            .iter()
            .map(|r| {
                json!({
                    "backend": backend,
                    "batch_kernels": gpu.is_some().then_some(kernels),
                    "n_threads": threads,
                    "kv_type": kv_dtype.name(),
                    "pp": r.pp, "tg": r.tg, "pl": r.b, "n_kv": r.n_kv,
                    "t_pp": r.t_pp, "speed_pp": r.s_pp(),
                    "t_tg": r.t_tg, "speed_tg": r.s_tg(),
                    "t": r.t(), "speed": r.s(),
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        match gpu {
            Some(_) => println!("batched engine on the {backend} ({kernels} batch kernels)"),
            None => println!("batched engine on the {backend}"),
        }
        println!("|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |");
        println!("|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|");
        for r in &rows {
            println!(
                "| {:5} | {:6} | {:4} | {:6} | {:8.3} | {:8.2} | {:8.3} | {:8.2} | {:8.3} | {:8.2} |",
                r.pp, r.tg, r.b, r.n_kv, r.t_pp, r.s_pp(), r.t_tg, r.s_tg(), r.t(), r.s()
            );
        }
    }
    if let Some(table) = cmf_llm::profile::report() {
        eprintln!("{table}");
    }
    Ok(())
}
