//! cmf-gpu-bench: decode and prefill throughput of the CUDA backend on a random-weight model of
//! real geometry, generated in memory (the codec payloads `cmf synth` would write).
//!
//! usage: cmf-gpu-bench --preset qwen3-0.6b|qwen3-8b --quant q8|q8_2f|bf16|q4
//!                      [--decode-ctx 128,4096] [--prefill 512,4096] [--tokens 128] [--layers N]
//!                      [--hbm-tbps 4.3] [--peak-tflops 790] [--profile]
//! Prints one markdown table row per run, with the floors it is measured against:
//! decode `weight bytes per token / HBM`, prefill TFLOP/s against the bf16 tensor-core peak.

use cmf_format::Dtype;
use cmf_gpu::cuda::llm::weight_bytes_resident;
use cmf_gpu::cuda::CudaBackend;
use cmf_gpu::facade::{Backend, LlmDevice, Placement};
use cmf_gpu::llm::synth::{qwen3_0_6b, qwen3_8b, Rng, SynthModel, SynthOptions};
use cmf_gpu::llm::{DecodeOutput, LlmOptions, Logits, Sampler};
use std::time::Instant;

struct Args {
    preset: String,
    quant: String,
    decode_ctx: Vec<usize>,
    prefill: Vec<usize>,
    tokens: usize,
    layers: Option<usize>,
    hbm: f64,
    peak: f64,
    profile: bool,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        preset: "qwen3-0.6b".into(),
        quant: "q8".into(),
        decode_ctx: vec![128, 4096],
        prefill: vec![512, 4096],
        tokens: 128,
        layers: None,
        hbm: 4.3,
        peak: 790.0,
        profile: false,
    };
    let list = |s: &str| -> Result<Vec<usize>, String> {
        s.split(',')
            .filter(|p| !p.is_empty())
            .map(|p| p.trim().parse().map_err(|_| format!("bad number `{p}`")))
            .collect()
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--preset" => a.preset = val()?,
            "--quant" => a.quant = val()?,
            "--decode-ctx" => a.decode_ctx = list(&val()?)?,
            "--prefill" => a.prefill = list(&val()?)?,
            "--tokens" => a.tokens = val()?.parse().map_err(|_| "bad --tokens")?,
            "--layers" => a.layers = Some(val()?.parse().map_err(|_| "bad --layers")?),
            "--hbm-tbps" => a.hbm = val()?.parse().map_err(|_| "bad --hbm-tbps")?,
            "--peak-tflops" => a.peak = val()?.parse().map_err(|_| "bad --peak-tflops")?,
            "--profile" => a.profile = true,
            "-h" | "--help" => {
                return Err("see the header of crates/cmf-gpu/src/bin/cmf-gpu-bench.rs".into())
            }
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(a)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("cmf-gpu-bench: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(&args) {
        eprintln!("cmf-gpu-bench: {e}");
        std::process::exit(1);
    }
}

fn run(a: &Args) -> Result<(), String> {
    let (mut spec, tied) = match a.preset.as_str() {
        "qwen3-0.6b" => (qwen3_0_6b(), true),
        "qwen3-8b" => (qwen3_8b(), false),
        p => return Err(format!("--preset {p}: expected qwen3-0.6b or qwen3-8b")),
    };
    let dtype = match a.quant.as_str() {
        "q8" => Dtype::Q8Row,
        "q8_2f" => Dtype::Q8_2f,
        "bf16" => Dtype::Bf16,
        "q4" => Dtype::Q4Block,
        q => return Err(format!("--quant {q}: expected q8, q8_2f, bf16 or q4")),
    };
    if let Some(l) = a.layers {
        spec.num_layers = l;
        spec.sliding_window.truncate(l);
    }
    let backend = CudaBackend::open(0)?;
    let info = backend.info();
    let t0 = Instant::now();
    let m = SynthModel::new(
        spec.clone(),
        dtype,
        SynthOptions {
            tied,
            ..SynthOptions::QWEN3
        },
        2026,
    );
    let synth_s = t0.elapsed().as_secs_f64();
    let model = m.model();
    let max_ctx = a
        .decode_ctx
        .iter()
        .chain(&a.prefill)
        .max()
        .copied()
        .unwrap_or(512)
        + a.tokens
        + 16;
    let chunk = a
        .prefill
        .iter()
        .chain(&a.decode_ctx)
        .max()
        .copied()
        .unwrap_or(512)
        .max(1);
    let opts = LlmOptions {
        max_context: max_ctx,
        prefill_chunk: chunk,
        ..Default::default()
    };
    let t0 = Instant::now();
    let mut dev = backend
        .load_cuda_llm(&model, &opts, &Placement::all(spec.num_layers))
        .map_err(|r| r.to_string())?;
    let load_s = t0.elapsed().as_secs_f64();
    let bpt = m.bytes_per_token() as f64;
    eprintln!(
        "{} | {} {} ({} layers) | weights {:.2} GB resident {:.2} GB | synth {synth_s:.1} s, upload {load_s:.1} s | kv f32: {} | attention splits {}, short contexts {:?}",
        info.name,
        a.preset,
        a.quant,
        spec.num_layers,
        m.weight_bytes() as f64 / 1e9,
        weight_bytes_resident(&dev) as f64 / 1e9,
        dev.kv_is_f32(),
        dev.attention_splits(),
        dev.short_decode()
    );
    let mut rng = Rng::new(7);
    let mut prompt = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| (rng.next_u64() % spec.vocab as u64) as u32)
            .collect()
    };
    let mut logits = vec![0f32; spec.vocab];

    // Prefill: warm once, median of 3.
    let layer_params: f64 = model
        .layers
        .iter()
        .map(|l| {
            l.matrices()
                .iter()
                .map(|w| (w.rows * w.cols) as f64)
                .sum::<f64>()
        })
        .sum();
    let mut rows = Vec::new();
    for &p in &a.prefill {
        let toks = prompt(p);
        dev.prefill(&toks, 0, Logits::Last, &mut logits)
            .map_err(|r| r.to_string())?;
        let times: Vec<f64> = (0..3)
            .map(|_| {
                let t0 = Instant::now();
                dev.prefill(&toks, 0, Logits::Last, &mut logits)
                    .map(|_| t0.elapsed().as_secs_f64())
            })
            .collect::<Result<_, _>>()
            .map_err(|r| r.to_string())?;
        let t = median(times);
        let attn = 4.0
            * (spec.num_heads * spec.head_dim) as f64
            * (p * (p + 1) / 2) as f64
            * spec.num_layers as f64;
        let flops = 2.0 * layer_params * p as f64 + attn + 2.0 * (spec.vocab * spec.hidden) as f64;
        let tflops = flops / t / 1e12;
        rows.push(format!(
            "prefill {p:>5}: {:>9.0} tok/s  {:>6.1} ms  {:>6.1} TFLOP/s ({:.0} % of {:.0})",
            p as f64 / t,
            t * 1e3,
            tflops,
            100.0 * tflops / a.peak,
            a.peak
        ));
    }
    // Decode at each context: prefill to the context, then time `tokens` greedy steps.
    for &c in &a.decode_ctx {
        let toks = prompt(c);
        dev.prefill(&toks, 0, Logits::Last, &mut logits)
            .map_err(|r| r.to_string())?;
        let mut out = DecodeOutput::default();
        let mut tok = toks[c - 1];
        // The first step captures the graph; warm a few.
        for i in 0..4 {
            dev.decode(tok, c + i, &Sampler::Greedy, false, &mut out)
                .map_err(|r| r.to_string())?;
            tok = out.token;
        }
        let up0 = backend.stats().uploaded();
        let t0 = Instant::now();
        for i in 0..a.tokens {
            dev.decode(tok, c + 4 + i, &Sampler::Greedy, false, &mut out)
                .map_err(|r| r.to_string())?;
            tok = out.token;
        }
        let t = t0.elapsed().as_secs_f64() / a.tokens as f64;
        let uploaded = backend.stats().uploaded() - up0;
        let floor = bpt / (a.hbm * 1e12);
        rows.push(format!(
            "decode ctx {c:>5}: {:>7.1} tok/s  {:>6.3} ms/token  {:>5.2} TB/s  {:>3.0} % of the {:.1} TB/s floor ({:.3} ms)  uploads in window: {uploaded} B",
            1.0 / t,
            t * 1e3,
            bpt / t / 1e12,
            100.0 * floor / t,
            a.hbm,
            floor * 1e3
        ));
    }
    if a.profile {
        // Per-stage device times: decode at the last context (device state as left above),
        // then prefill at the largest size (re-run so the workspace holds its activations).
        let mut prof = dev.profile_decode(50).map_err(|e| e.0)?;
        if let Some(&p) = a.prefill.iter().max() {
            let toks = prompt(p);
            dev.prefill(&toks, 0, Logits::Last, &mut logits)
                .map_err(|r| r.to_string())?;
            prof.extend(dev.profile_prefill(p, 3).map_err(|e| e.0)?);
        }
        for (name, us) in prof {
            rows.push(format!("profile {name:<48} {us:>10.1} µs"));
        }
    }
    for r in &rows {
        println!("{} {} | {r}", a.preset, a.quant);
    }
    Ok(())
}
