//! cmf-gemm-tune: how far is cuBLAS's first pick from the fastest algorithm it offers, on the
//! Z-Image DiT's GEMM shapes? Times cuBLAS's `cublasGemmEx` (what the bf16 DiT runs) and every
//! cuBLASLt heuristic candidate (bf16, and e4m3 with per-row scales and fast accumulation), and
//! prints each candidate's configuration and time, then a per-step estimate.
//!
//! usage: cmf-gemm-tune [--tokens 4128,4096] [--reps 10] [--all]
//! Shapes per token count m: q|k|v (n 11520, k 3840), O (3840, 3840), w1|w3 (20480, 3840),
//! w2 (3840, 10240). Random bf16 inputs ~U(-1, 1). `--all` prints every candidate, else the
//! first, the fastest and cuBLAS's.

use cmf_gpu::cuda::dit::TURBO_BLOCK_GEMMS;
use cmf_gpu::cuda::runtime::blas::Blas;
use cmf_gpu::cuda::runtime::device::{bytes_of, Timer};
use cmf_gpu::cuda::runtime::fp8::Fp8Gemm;
use cmf_gpu::cuda::runtime::lt::{LtCall, LtIn, LtOut};
use cmf_gpu::cuda::CudaBackend;
use cmf_gpu::llm::synth::Rng;
use half::bf16;

fn main() {
    let mut tokens = vec![4128usize, 4096];
    let mut reps = 10usize;
    let mut all = false;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--tokens" => {
                let val = it.next().unwrap_or_default();
                tokens = val.split(',').filter_map(|t| t.parse().ok()).collect()
            }
            "--reps" => reps = it.next().and_then(|v| v.parse().ok()).unwrap_or(10).max(3),
            "--all" => all = true,
            other => {
                eprintln!("cmf-gemm-tune: unknown flag {other}");
                std::process::exit(2);
            }
        }
    }
    if let Err(e) = run(&tokens, reps, all) {
        eprintln!("cmf-gemm-tune: {e}");
        std::process::exit(1);
    }
}

fn random_bf16(rng: &mut Rng, n: usize) -> Vec<u16> {
    (0..n)
        .map(|_| bf16::from_f32(rng.uniform()).to_bits())
        .collect()
}

fn run(tokens: &[usize], reps: usize, all: bool) -> Result<(), String> {
    let backend = CudaBackend::open(0)?;
    let dev = backend.device();
    let err = |e: cmf_gpu::cuda::runtime::device::DevError| e.0;
    let blas = Blas::new(dev).map_err(err)?;
    let fp8 = Fp8Gemm::new(dev).map_err(err)?;
    let lt = fp8.lt();
    let timer = Timer::new().map_err(err)?;
    println!("device {}", dev.name);
    let mut rng = Rng::new(5);
    // Per token count: (cuBLAS, Lt first, Lt best) bf16 and (first, best) fp8, summed over shapes.
    let mut sums = Vec::new();
    for &m in tokens {
        let mut sum = [0f32; 5];
        for &(name, n, k) in &TURBO_BLOCK_GEMMS {
            let dx = dev
                .upload_new(bytes_of(&random_bf16(&mut rng, m * k)))
                .map_err(err)?;
            let dw = dev
                .upload_new(bytes_of(&random_bf16(&mut rng, n * k)))
                .map_err(err)?;
            let qx = dev.alloc(m * k).map_err(err)?;
            let sx = dev.alloc(m * 4).map_err(err)?;
            let qw = dev.alloc(n * k).map_err(err)?;
            let sw = dev.alloc(n * 4).map_err(err)?;
            let out = dev.alloc(m * n * 2).map_err(err)?;
            fp8.quantize(dw.ptr(), n, k, k, qw.ptr(), sw.ptr())
                .map_err(err)?;
            fp8.quantize(dx.ptr(), m, k, k, qx.ptr(), sx.ptr())
                .map_err(err)?;
            let t_blas = timer
                .median_ms(dev, reps, || {
                    blas.gemm_bf16_out(dw.ptr(), dx.ptr(), out.ptr(), n, m, k, n)
                })
                .map_err(err)?;
            let tf = |ms: f32| 2.0 * (m * n * k) as f64 / (ms as f64 * 1e-3) / 1e12;
            println!(
                "\n## m {m} {name} (n {n}, k {k}): cublasGemmEx bf16 {t_blas:.3} ms ({:.0} TFLOP/s)",
                tf(t_blas)
            );
            sum[0] += t_blas;
            let arms = [
                ("bf16", LtIn::Bf16, dw.ptr(), dx.ptr()),
                (
                    "e4m3 fast",
                    LtIn::E4m3 {
                        ws: sw.ptr(),
                        xs: sx.ptr(),
                        fast: true,
                    },
                    qw.ptr(),
                    qx.ptr(),
                ),
            ];
            for (a, (label, input, w, x)) in arms.into_iter().enumerate() {
                let call = LtCall {
                    w,
                    x,
                    input,
                    out: LtOut::Bf16(out.ptr()),
                    nmk: (n, m, k),
                    ldc: n,
                };
                let times = lt.tune(&call, reps).map_err(err)?;
                let first = times.first().and_then(|t| t.1).unwrap_or(f32::NAN);
                let best = times
                    .iter()
                    .enumerate()
                    .filter_map(|(i, t)| t.1.map(|ms| (i, ms)))
                    .min_by(|x, y| x.1.total_cmp(&y.1));
                let (bi, bms) = best.unwrap_or((0, f32::NAN));
                println!(
                    "{label}: {} candidates; first {first:.3} ms ({:.0} TFLOP/s), fastest #{bi} {bms:.3} ms ({:.0} TFLOP/s) {}",
                    times.len(),
                    tf(first),
                    tf(bms),
                    times.get(bi).map(|t| t.0.as_str()).unwrap_or("")
                );
                if all {
                    for (i, (desc, ms)) in times.iter().enumerate() {
                        match ms {
                            Some(ms) => println!("  #{i:2} {ms:.3} ms  {desc}"),
                            None => println!("  #{i:2} refused  {desc}"),
                        }
                    }
                }
                sum[1 + 2 * a] += first;
                sum[2 + 2 * a] += bms;
            }
        }
        sums.push((m, sum));
    }
    println!("\n## one layer's four GEMMs (ms): m | cublasGemmEx | Lt bf16 first | Lt bf16 fastest | Lt e4m3 first | Lt e4m3 fastest");
    for (m, s) in sums {
        println!(
            "{m} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3}",
            s[0], s[1], s[2], s[3], s[4]
        );
    }
    Ok(())
}
