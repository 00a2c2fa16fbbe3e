//! `cmf imagine FILE --prompt …`: text-to-image with a Z-Image pack. Every unset option takes the
//! recipe stored in the file (`zimage.config_json`: Turbo = 1024², 8 steps, guidance 0).

use std::path::PathBuf;
use std::time::Instant;

use cmf_gpu::dit::DitPrecision;
use cmf_zimage::pipeline::{generate_with, write_png, Event, Plan, Request, Resident, ZimagePack};
use cmf_zimage::ZimageError;
use indicatif::{ProgressBar, ProgressStyle};

use crate::exit::UsageError;

/// Generate an image from a prompt with a Z-Image / Z-Image-Turbo pack.
#[derive(clap::Args)]
pub struct Args {
    /// A Z-Image .cmf (from `cmf convert --zimage` or `cortiq imagine-pack`).
    file: PathBuf,
    /// What to draw.
    #[arg(long)]
    prompt: String,
    /// What to steer away from (used only when guidance > 0; default from the file, usually "").
    #[arg(long)]
    negative_prompt: Option<String>,
    /// Image width in pixels, a multiple of 16 (default from the file).
    #[arg(long)]
    width: Option<usize>,
    /// Image height in pixels, a multiple of 16 (default from the file).
    #[arg(long)]
    height: Option<usize>,
    /// Denoising steps = DiT forwards per image (default from the file: Turbo 8).
    #[arg(long)]
    steps: Option<usize>,
    /// Classifier-free guidance scale; 0 turns CFG off, > 0 runs pos + g·(pos − neg)
    /// (default from the file: Turbo 0).
    #[arg(long, visible_alias = "cfg")]
    guidance: Option<f32>,
    /// Seed of the initial noise (SplitMix64 + Box–Muller, the reference CLI's generator).
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Initial latents [16, H/8, W/8] instead of seeded noise: .npy (f32), .safetensors (tensor
    /// `latents`) or raw little-endian f32.
    #[arg(long, value_name = "FILE")]
    latents: Option<PathBuf>,
    /// Worker threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Output PNG.
    #[arg(long, short, default_value = "out.png")]
    output: PathBuf,
    /// Generate the image N times in this process, the device models staying resident: the
    /// first run is cold (uploads), the rest warm; prints both (benchmarking).
    #[arg(long, default_value_t = 1, value_name = "N")]
    repeat: usize,
    /// What the device DiT's block GEMMs run in: bf16, fp8 (e4m3 with per-row scales, FP8
    /// tensor cores), fp8-fast (the same with fast accumulation), int8 (s8 with per-row scales,
    /// int8 tensor cores, exact s32 sums). A device without them runs bf16.
    #[arg(long, value_name = "P", default_value = "bf16")]
    dit_precision: String,
    /// GPU backend: auto (CUDA when a device answers, else the CPU), off, cuda (required).
    /// Default: $CMF_GPU (0, 1, cuda), else auto.
    #[arg(long = "gpu", value_name = "MODE")]
    gpu: Option<String>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let t_all = Instant::now();
    crate::malloc_policy::keep_transient_buffers();
    if let Some(n) = args.threads {
        let n = super::llm_opts::thread_count(n)?;
        cmf_kernels::set_num_threads(n);
        // Our row ops run on rayon's global pool; size it the same.
        let _ = rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global();
    }
    let mode = super::llm_opts::resolve_gpu_mode(args.gpu.as_deref())?;
    let gpu = cmf_gpu::Gpu::open(mode)?;
    let dit_precision = DitPrecision::parse(&args.dit_precision).ok_or_else(|| {
        UsageError(format!(
            "--dit-precision {}: expected one of {}",
            args.dit_precision,
            DitPrecision::NAMES
        ))
    })?;
    let pack = ZimagePack::open(&args.file).map_err(classify)?;
    let req = Request {
        dit_precision,
        prompt: args.prompt,
        negative_prompt: args.negative_prompt,
        width: args.width,
        height: args.height,
        steps: args.steps,
        guidance: args.guidance,
        seed: args.seed,
        latents: args.latents,
    };
    let plan = Plan::new(&req, &pack.recipe).map_err(classify)?;
    if plan.guidance == 0.0 && req.negative_prompt.is_some() {
        eprintln!("note: --negative-prompt has no effect at guidance 0");
    }
    eprintln!(
        "z-image ({}): {}x{}, {} steps, guidance {}, shift {}, {}",
        pack.recipe.variant,
        plan.width,
        plan.height,
        plan.steps,
        plan.guidance,
        plan.shift,
        match &plan.latents {
            Some(p) => format!("latents {}", p.display()),
            None => format!("seed {}", plan.seed),
        }
    );
    let bar = ProgressBar::hidden();
    let mut on_event = |ev: Event| match ev {
        Event::Tokenized {
            positive,
            negative,
            max_tokens,
        } => {
            for (what, t) in [
                ("prompt", Some(&positive)),
                ("negative prompt", negative.as_ref()),
            ] {
                if let Some(t) = t.filter(|t| t.truncated()) {
                    eprintln!(
                        "warning: the {what} is {} tokens after the chat template; only the first {max_tokens} are used (as diffusers truncates)",
                        t.full_len
                    );
                }
            }
        }
        Event::TextEncoded { secs } => {
            eprintln!("text encoder: {secs:.2} s");
            bar.set_length(plan.steps as u64);
            bar.set_style(
                ProgressStyle::with_template("denoising {bar:30} {pos}/{len} steps  {msg}")
                    .expect("template")
                    .progress_chars("=> "),
            );
            bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
        }
        Event::Step { i, secs, cfg, .. } => {
            bar.set_position(i as u64);
            bar.set_message(format!(
                "{secs:.2} s/step{}",
                if cfg { " (cfg, 2 items)" } else { "" }
            ));
        }
        Event::Decoded { .. } => {}
    };
    if args.repeat == 0 {
        return Err(UsageError("--repeat: must be at least 1".into()).into());
    }
    let mut resident = Resident::default();
    let mut runs = Vec::with_capacity(args.repeat);
    let mut out = None;
    for _ in 0..args.repeat {
        let t = Instant::now();
        out = Some(
            generate_with(&pack, &plan, &gpu, &mut resident, &mut on_event).map_err(classify)?,
        );
        runs.push(t.elapsed().as_secs_f64());
    }
    let cold = t_all.elapsed().as_secs_f64() - runs[1..].iter().sum::<f64>();
    let out = out.expect("at least one run");
    bar.finish();
    if mode == cmf_gpu::GpuMode::Cuda {
        let t = &out.timings;
        let on_cpu: Vec<&str> = [
            ("the text encoder", t.te_on_device),
            ("the DiT", t.dit_on_device),
            ("the VAE", t.vae_on_device),
        ]
        .iter()
        .filter(|(_, on)| !on)
        .map(|(n, _)| *n)
        .collect();
        if !on_cpu.is_empty() {
            eprintln!(
                "warning: --gpu cuda: {} ran on the CPU (CMF_LOG=debug says why)",
                on_cpu.join(", ")
            );
        }
    }
    write_png(&args.output, &out.rgb, out.width, out.height)?;
    let tm = &out.timings;
    let steps_total: f64 = tm.steps.iter().sum();
    let mut sorted = tm.steps.clone();
    sorted.sort_by(f64::total_cmp);
    let median = sorted.get(sorted.len() / 2).copied().unwrap_or(0.0);
    println!("{}: {}x{}", args.output.display(), out.width, out.height);
    let steps_cpu: f64 = tm.steps_cpu.iter().sum();
    let device = gpu.info().map(|i| i.name).unwrap_or_else(|| "cpu".into());
    let on = |b: bool| if b { device.as_str() } else { "cpu" };
    // The DiT's precision where 8-bit planes ran (a device without FP8 or int8 tensor cores
    // runs bf16 when asked).
    let dit_fp8 = if tm.dit_on_device && tm.dit_gemm8_planes > 0 {
        format!(
            " ({}: {} block GEMM planes in {})",
            plan.dit_precision.name(),
            tm.dit_gemm8_planes,
            plan.dit_precision.operand()
        )
    } else {
        String::new()
    };
    println!(
        "devices: text encoder {}, DiT {}{dit_fp8}, VAE {}",
        on(tm.te_on_device),
        on(tm.dit_on_device),
        on(tm.vae_on_device)
    );
    println!(
        "timing{}: text encoder {:.2} s, conditioning {:.2} s, {} steps {:.2} s (median {:.3} s/step), VAE {:.3} s, run {:.3} s, process {:.2} s{}",
        if runs.len() > 1 { " (last run)" } else { "" },
        tm.text_encoder,
        tm.dit_load,
        tm.steps.len(),
        steps_total,
        median,
        tm.vae,
        tm.total,
        t_all.elapsed().as_secs_f64(),
        peak_rss().map(|kb| format!(", peak RSS {:.2} GiB", kb as f64 / (1 << 20) as f64)).unwrap_or_default()
    );
    if runs.len() > 1 {
        let mut warm = runs[1..].to_vec();
        warm.sort_by(f64::total_cmp);
        println!(
            "runs: cold {cold:.2} s (process start to the first image, uploads included), warm {:.3} s median of {} (min {:.3} s)",
            warm[warm.len() / 2],
            warm.len(),
            warm[0]
        );
    }
    println!(
        "cpu time: text encoder {:.2} s, steps {:.2} s ({:.2} s/step), VAE {:.2} s, total {:.2} s",
        tm.text_encoder_cpu,
        steps_cpu,
        steps_cpu / tm.steps_cpu.len().max(1) as f64,
        tm.vae_cpu,
        cmf_zimage::pipeline::cpu_seconds()
    );
    Ok(())
}

/// Bad requests and wrong files are usage errors (exit 2); the rest are runtime errors (exit 1).
fn classify(e: ZimageError) -> anyhow::Error {
    match e {
        ZimageError::Request { .. }
        | ZimageError::NotZimage { .. }
        | ZimageError::Latents { .. } => UsageError(e.to_string()).into(),
        other => anyhow::Error::new(other),
    }
}

/// Peak resident set size of this process in KiB (Linux `VmHWM`).
fn peak_rss() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}
