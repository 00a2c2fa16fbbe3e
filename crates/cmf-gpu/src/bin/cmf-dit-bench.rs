//! cmf-dit-bench: DiT step time of the CUDA backend at the real Z-Image geometry (dim 3840,
//! 30 heads, FFN 10240, 2 + 2 refiner blocks, 30 layers), random weights made in memory.
//!
//! usage: cmf-dit-bench [--res 512,1024] [--cap 30] [--steps 8] [--layers 30] [--batch 1]
//!                      [--peak-tflops 790] [--precision bf16|fp8|fp8-fast|int8]
//! One random block's bf16 bytes back every layer's upload (each layer is its own device plane,
//! so memory traffic is real; the values do not matter for timing). Prints per resolution: cold
//! load + first step, warm ms per step (median), the FLOPs of a step and the achieved TFLOP/s.
//! `CMF_DIT_PROFILE=1` adds the device ms per category (GEMM, attention, row kernels; each
//! region synchronised, so the step itself is slower then).

use cmf_format::Dtype;
use cmf_gpu::cuda::dit::{CudaDit, PROFILE_CATEGORIES};
use cmf_gpu::cuda::CudaBackend;
use cmf_gpu::dit::{
    pad_rows, DitBlockWeights, DitGeometry, DitItemSetup, DitLinear, DitModel, DitPrecision,
    DitStepItem, Fp8Attention, RopeRows,
};
use cmf_gpu::facade::DitDevice;
use cmf_gpu::llm::synth::Rng;
use cmf_kernels::Weight;
use half::bf16;
use std::time::Instant;

struct Args {
    res: Vec<usize>,
    cap: usize,
    steps: usize,
    layers: usize,
    batch: usize,
    peak: f64,
    precision: DitPrecision,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        res: vec![512, 1024],
        cap: 30,
        steps: 8,
        layers: 30,
        batch: 1,
        peak: 790.0,
        precision: DitPrecision::Bf16,
    };
    let num = |s: String| s.parse::<usize>().map_err(|_| format!("bad number `{s}`"));
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--res" => {
                a.res = val()?
                    .split(',')
                    .map(|p| num(p.to_string()))
                    .collect::<Result<_, _>>()?
            }
            "--cap" => a.cap = num(val()?)?,
            "--steps" => a.steps = num(val()?)?.max(2),
            "--layers" => a.layers = num(val()?)?,
            "--batch" => a.batch = num(val()?)?.max(1),
            "--peak-tflops" => a.peak = val()?.parse().map_err(|_| "bad --peak-tflops")?,
            "--precision" => {
                let v = val()?;
                a.precision = DitPrecision::parse(&v).ok_or_else(|| {
                    format!("--precision {v}: not one of bf16, fp8, fp8-fast, int8")
                })?
            }
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(a)
}

/// Random bf16 matrix bytes, values ~ N(0, scale²)-ish.
fn random_bf16(rng: &mut Rng, n: usize, scale: f32) -> Vec<u8> {
    (0..n)
        .flat_map(|_| bf16::from_f32(rng.uniform() * scale).to_le_bytes())
        .collect()
}

fn main() {
    let a = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("cmf-dit-bench: {e}");
            std::process::exit(2);
        }
    };
    let backend = match CudaBackend::open(0) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("cmf-dit-bench: no CUDA device: {e}");
            std::process::exit(1);
        }
    };
    let (d, heads, f, pd, cf, ad) = (3840usize, 30usize, 10240usize, 64usize, 2560usize, 256usize);
    let geo = DitGeometry {
        dim: d,
        n_heads: heads,
        ffn: f,
        norm_eps: 1e-5,
        qk_eps: 1e-5,
        final_eps: 1e-6,
        patch_dim: pd,
        cap_feat_dim: cf,
        adaln_dim: ad,
    };
    let t0 = Instant::now();
    let mut rng = Rng::new(7);
    let sq = |n: usize| 1.0 / (n as f32).sqrt();
    let dd = random_bf16(&mut rng, d * d, sq(d));
    let fd = random_bf16(&mut rng, f * d, sq(d));
    let df = random_bf16(&mut rng, d * f, sq(f));
    let ada = random_bf16(&mut rng, 4 * d * ad, 0.02);
    let x_emb = random_bf16(&mut rng, d * pd, sq(pd));
    let cap_emb = random_bf16(&mut rng, d * cf, sq(cf));
    let fin_ada = random_bf16(&mut rng, d * ad, 0.02);
    let fin_lin = random_bf16(&mut rng, pd * d, sq(d));
    let ones = vec![1f32; d.max(cf)];
    let zeros = vec![0f32; 4 * d];
    fn w(data: &[u8], rows: usize, cols: usize) -> Weight<'_> {
        Weight {
            dtype: Dtype::Bf16,
            rows,
            cols,
            data,
        }
    }
    let hd = d / heads;
    let block = |modulated: bool| DitBlockWeights {
        to_q: w(&dd, d, d),
        to_k: w(&dd, d, d),
        to_v: w(&dd, d, d),
        to_out: w(&dd, d, d),
        w1: w(&fd, f, d),
        w3: w(&fd, f, d),
        w2: w(&df, d, f),
        norm_q: &ones[..hd],
        norm_k: &ones[..hd],
        attention_norm1: &ones[..d],
        attention_norm2: &ones[..d],
        ffn_norm1: &ones[..d],
        ffn_norm2: &ones[..d],
        ada: modulated.then(|| DitLinear {
            w: w(&ada, 4 * d, ad),
            b: Some(&zeros[..4 * d]),
        }),
    };
    let model = DitModel {
        precision: a.precision,
        fp8_attention: Fp8Attention::Auto,
        geo: geo.clone(),
        x_embedder: DitLinear {
            w: w(&x_emb, d, pd),
            b: Some(&zeros[..d]),
        },
        x_pad_token: &zeros[..d],
        cap_norm: &ones[..cf],
        cap_embedder: DitLinear {
            w: w(&cap_emb, d, cf),
            b: Some(&zeros[..d]),
        },
        cap_pad_token: &zeros[..d],
        noise_refiner: (0..2).map(|_| block(true)).collect(),
        context_refiner: (0..2).map(|_| block(false)).collect(),
        layers: (0..a.layers).map(|_| block(true)).collect(),
        final_ada: DitLinear {
            w: w(&fin_ada, d, ad),
            b: Some(&zeros[..d]),
        },
        final_linear: DitLinear {
            w: w(&fin_lin, pd, d),
            b: Some(&zeros[..pd]),
        },
    };
    let gen_s = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    let mut dit = match CudaDit::load(backend.device(), &model) {
        Ok(x) => x,
        Err(r) => {
            eprintln!("cmf-dit-bench: load refused: {r}");
            std::process::exit(1);
        }
    };
    let load_s = t0.elapsed().as_secs_f64();
    println!(
        "device {}; random weights made in {gen_s:.1} s, uploaded ({} block GEMM planes 8-bit, the rest bf16; weights {:.2} GB, {:.2} GB resident) in {load_s:.2} s; {} layers, caption {} tokens, batch {}",
        backend.device().name,
        dit.gemm8_planes(),
        dit.weight_bytes() as f64 / 1e9,
        backend.device().stats.resident() as f64 / 1e9,
        a.layers,
        a.cap,
        a.batch
    );
    println!("| res | tokens | cold first step ms | warm ms/step (median) | TFLOP/step | TFLOP/s | % of {:.0} |", a.peak);
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for &res in &a.res {
        let (h, wl) = (res / 8, res / 8);
        let ni = (h / 2) * (wl / 2);
        let lp = pad_rows(a.cap);
        let cap: Vec<f32> = (0..a.cap * cf).map(|_| rng.uniform()).collect();
        let half = hd / 2;
        let rope = |rows: usize| -> (Vec<f32>, Vec<f32>) {
            let ang: Vec<f32> = (0..rows * half).map(|i| (i % 97) as f32 * 0.01).collect();
            (
                ang.iter().map(|x| x.cos()).collect(),
                ang.iter().map(|x| x.sin()).collect(),
            )
        };
        let (cc, cs) = rope(lp);
        let t_cold = Instant::now();
        dit.release();
        let conds: Vec<_> = (0..a.batch)
            .map(|_| {
                dit.condition(&cap, a.cap, RopeRows { cos: &cc, sin: &cs })
                    .expect("condition")
            })
            .collect();
        let np = pad_rows(ni);
        let (jc, js) = rope(np + lp);
        let setups: Vec<DitItemSetup> = conds
            .iter()
            .map(|&cond| DitItemSetup {
                cond,
                rope: RopeRows { cos: &jc, sin: &js },
            })
            .collect();
        dit.prepare(&setups, ni).expect("prepare");
        let patches: Vec<f32> = (0..ni * pd).map(|_| rng.uniform()).collect();
        let temb: Vec<f32> = (0..ad).map(|_| rng.uniform()).collect();
        let items: Vec<DitStepItem> = (0..a.batch)
            .map(|slot| DitStepItem {
                slot,
                patches: &patches,
                t_emb: &temb,
            })
            .collect();
        let mut out = vec![0f32; a.batch * ni * pd];
        dit.step(&items, &mut out).expect("step");
        let cold_ms = t_cold.elapsed().as_secs_f64() * 1e3;
        let _ = dit.take_profile();
        let mut ms = Vec::new();
        for _ in 0..a.steps {
            let t = Instant::now();
            dit.step(&items, &mut out).expect("step");
            ms.push(t.elapsed().as_secs_f64() * 1e3);
        }
        ms.sort_by(f64::total_cmp);
        let med = ms[ms.len() / 2];
        // FLOPs: 2·rows·params of every GEMM + 4·L²·D per attention (QKᵀ and PV), per item.
        let blk = (4 * d * d + 3 * d * f) as f64;
        let rows_main = (np + lp) as f64;
        let per_item = 2.0 * (np as f64 * blk * 2.0 + rows_main * blk * a.layers as f64)
            + 4.0 * d as f64 * (2.0 * (np * np) as f64 + a.layers as f64 * rows_main * rows_main)
            + 2.0 * ni as f64 * (d * pd * 2) as f64;
        let tflop = per_item * a.batch as f64 / 1e12;
        let tflops = tflop / (med / 1e3);
        println!(
            "| {res}² | {ni} + {lp} | {cold_ms:.1} | {med:.2} | {tflop:.2} | {tflops:.0} | {:.0} % |",
            100.0 * tflops / a.peak
        );
        if let Some(p) = dit.take_profile() {
            let per: Vec<String> = PROFILE_CATEGORIES
                .iter()
                .zip(p)
                .map(|(n, v)| format!("{n} {:.2} ms", v / a.steps as f64))
                .collect();
            println!(
                "  profile per step (synchronised regions): {}",
                per.join(", ")
            );
        }
        assert!(out.iter().all(|v| v.is_finite()), "non-finite output");
    }
}
