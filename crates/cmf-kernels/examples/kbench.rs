//! Kernel microbenchmarks.
//!
//! cargo run --release -p cmf-kernels --example kbench -- [mem|matvec|matmul|attn|actq|conv|all] [--threads N]
//!     [--isa portable|avx2|avx512] [--codecs q8_row,q4_tiled,...] [--n 512] [--secs 1.0]
//!
//! - mem: read bandwidth of a 512 MiB buffer (the ceiling for decode), 1 and N threads.
//! - matvec: GB/s of weight bytes streamed, per codec, on Qwen3-0.6B and SmolLM2-135M shapes. Each
//!   shape is replicated until the copies exceed 4× the L3 cache and the copies are used in turn, so
//!   the weights come from DRAM as they do in a real decode step (`--hot`: one copy, to measure
//!   the kernels' own speed on cache-resident weights).
//! - matmul: GFLOP/s (2·n·rows·cols per call) at n = 512.
//! - actq: error of per-32-block vs per-row int8 input quantization.
//! - conv: the VAE decoder's 3×3 convs, GFLOP/s of the tap and im2col schedules.
//! - attn: decode attention per layer at ctx 512/4096 per KV element type; joint attention GFLOP/s.
//!
//! Times are the best of repeated runs (the machine is shared; the best run is the least disturbed).

use std::time::Instant;

use cmf_format::Dtype;
use cmf_kernels::{matmul_with, matvec_with, set_num_threads, Isa, Weight};

struct Args {
    what: String,
    threads: Vec<usize>,
    isa: Isa,
    codecs: Vec<Dtype>,
    n: usize,
    secs: f64,
    hot: bool,
}

fn parse() -> Args {
    let mut a = Args {
        what: "all".into(),
        threads: vec![1, 2],
        isa: cmf_kernels::cpu::active(),
        codecs: vec![
            Dtype::F32,
            Dtype::F16,
            Dtype::Bf16,
            Dtype::Q8Row,
            Dtype::Q8_2f,
            Dtype::Q4Block,
            Dtype::Q4Tiled,
            Dtype::Q4Tp,
        ],
        n: 512,
        secs: 1.0,
        hot: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(s) = it.next() {
        let mut val = || it.next().unwrap_or_else(|| panic!("{s} needs a value"));
        match s.as_str() {
            "--threads" => {
                a.threads = val()
                    .split(',')
                    .map(|t| t.parse().expect("--threads"))
                    .collect()
            }
            "--isa" => a.isa = Isa::from_name(&val()).expect("--isa portable|avx2|avx512"),
            "--codecs" => {
                a.codecs = val()
                    .split(',')
                    .map(|c| Dtype::from_name(c).expect("codec name"))
                    .collect()
            }
            "--n" => a.n = val().parse().expect("--n"),
            "--secs" => a.secs = val().parse().expect("--secs"),
            "--hot" => a.hot = true,
            w if !w.starts_with('-') => a.what = w.to_string(),
            other => panic!("unknown flag {other}"),
        }
    }
    assert!(a.isa.supported(), "{} is not supported by this CPU", a.isa);
    a
}

/// CPU time consumed by all threads of this process, in seconds.
fn cpu_secs() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: plain syscall writing into a local.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Runs `f` repeatedly for about `secs` and returns the best single-run wall time in seconds.
/// With `CMF_KBENCH_CPU=1` it returns the best run's CPU time divided by the thread count instead:
/// on a loaded machine (time-sliced cores) that is the time the work itself took.
fn best_time(secs: f64, mut f: impl FnMut()) -> f64 {
    let by_cpu = std::env::var("CMF_KBENCH_CPU").is_ok_and(|v| v == "1");
    let threads = cmf_kernels::num_threads() as f64;
    f();
    // Batch short calls so one measurement lasts ≥ 20 ms (CPU-time counters tick coarsely).
    let t = Instant::now();
    let mut reps = 0usize;
    while t.elapsed().as_secs_f64() < 0.02 {
        f();
        reps += 1;
    }
    let start = Instant::now();
    let mut best = f64::INFINITY;
    let mut runs = 0;
    while runs < 3 || (start.elapsed().as_secs_f64() < secs && runs < 100_000) {
        let (t, c) = (Instant::now(), cpu_secs());
        for _ in 0..reps {
            f();
        }
        let took = if by_cpu {
            (cpu_secs() - c) / threads
        } else {
            t.elapsed().as_secs_f64()
        };
        best = best.min(took / reps as f64);
        runs += 1;
    }
    best
}

fn mem(args: &Args) {
    let bytes = 512usize << 20;
    let buf: Vec<u64> = (0..bytes / 8).map(|i| i as u64).collect();
    println!("## memory read bandwidth (512 MiB buffer, sum of u64)");
    for &t in &args.threads {
        let chunk = buf.len() / t;
        let secs = best_time(args.secs.max(2.0), || {
            let total: u64 = std::thread::scope(|s| {
                let hs: Vec<_> = buf
                    .chunks(chunk)
                    .map(|c| s.spawn(move || c.iter().fold(0u64, |a, &v| a.wrapping_add(v))))
                    .collect();
                hs.into_iter()
                    .map(|h| h.join().unwrap())
                    .fold(0, u64::wrapping_add)
            });
            std::hint::black_box(total);
        });
        println!("threads {t}: {:.1} GB/s", bytes as f64 / secs / 1e9);
    }
    // The access pattern of the matvec benchmark: 3 MiB matrices used in turn.
    let copies: Vec<Vec<u64>> = (0..43)
        .map(|c| (0..(3usize << 20) / 8).map(|i| (i + c) as u64).collect())
        .collect();
    let secs = best_time(args.secs.max(2.0), || {
        let total = copies
            .iter()
            .fold(0u64, |a, c| c.iter().fold(a, |b, &v| b.wrapping_add(v)));
        std::hint::black_box(total);
    });
    println!(
        "1 thread, 43 × 3 MiB buffers in turn: {:.1} GB/s",
        (43usize * (3 << 20)) as f64 / secs / 1e9
    );
}

fn random_payload(dtype: Dtype, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let len = dtype
        .expected_nbytes(&[rows as u64, cols as u64])
        .expect("shape") as usize;
    let mut s = seed;
    let mut out: Vec<u8> = (0..len)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 56) as u8
        })
        .collect();
    // Keep float codecs finite: overwrite with small values.
    match dtype {
        Dtype::F32 => out
            .chunks_exact_mut(4)
            .enumerate()
            .for_each(|(i, c)| c.copy_from_slice(&(((i % 13) as f32 - 6.0) * 0.01).to_le_bytes())),
        Dtype::F16 | Dtype::Bf16 => out.chunks_exact_mut(2).for_each(|c| c[1] &= 0x3c),
        _ => {}
    }
    // Scales are f16 bytes mixed into the stream; random bits may be NaN/inf, which is harmless
    // for timing (no data-dependent branches in the kernels).
    out
}

const SHAPES: [(&str, usize, usize); 5] = [
    ("qwen3-0.6b q/o·mlp-down 1024×3072", 1024, 3072),
    ("qwen3-0.6b mlp-up 3072×1024", 3072, 1024),
    ("qwen3-0.6b lm-head 151936×1024", 151936, 1024),
    ("smollm2-135m mlp-up 1536×576", 1536, 576),
    ("smollm2-135m lm-head 49152×576", 49152, 576),
];

fn matvec(args: &Args) {
    let l3 = 32usize << 20;
    let from = if args.hot {
        "one copy (cache-hot when it fits)"
    } else {
        "weights from DRAM (copies > 4×L3)"
    };
    println!("## matvec (isa {}): GB/s of weight bytes, {from}", args.isa);
    for &(name, rows, cols) in &SHAPES {
        for &dtype in &args.codecs {
            let Some(len) = dtype.expected_nbytes(&[rows as u64, cols as u64]) else {
                continue;
            };
            let len = len as usize;
            let copies = if args.hot {
                1
            } else {
                (4 * l3).div_ceil(len).max(1)
            };
            let datas: Vec<Vec<u8>> = (0..copies)
                .map(|i| random_payload(dtype, rows, cols, i as u64))
                .collect();
            let ws: Vec<Weight> = datas
                .iter()
                .map(|d| Weight::new(dtype, rows, cols, d).unwrap())
                .collect();
            let x: Vec<f32> = (0..cols)
                .map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.1)
                .collect();
            let mut y = vec![0f32; rows];
            let mut line = format!("{name:36} {:9}", dtype.name());
            for &t in &args.threads {
                set_num_threads(t);
                let mut k = 0;
                // Time all copies once per run so every run streams from DRAM.
                let secs = best_time(args.secs, || {
                    for w in &ws {
                        matvec_with(args.isa, w, &x, &mut y);
                    }
                    k += 1;
                }) / copies as f64;
                line += &format!(
                    "  {t}T {:6.1} GB/s {:8.1} µs",
                    len as f64 / secs / 1e9,
                    secs * 1e6
                );
            }
            println!("{line}");
        }
    }
}

fn matmul(args: &Args) {
    let n = args.n;
    println!(
        "## matmul (isa {}), n = {n}: GFLOP/s (2·n·rows·cols per call)",
        args.isa
    );
    for &(name, rows, cols) in SHAPES.iter().filter(|s| !s.0.contains("lm-head")) {
        for &dtype in &args.codecs {
            let Some(_) = dtype.expected_nbytes(&[rows as u64, cols as u64]) else {
                continue;
            };
            let data = random_payload(dtype, rows, cols, 7);
            let w = Weight::new(dtype, rows, cols, &data).unwrap();
            let x: Vec<f32> = (0..n * cols)
                .map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.1)
                .collect();
            let mut y = vec![0f32; n * rows];
            let mut line = format!("{name:36} {:9}", dtype.name());
            for &t in &args.threads {
                set_num_threads(t);
                let secs = best_time(args.secs, || matmul_with(args.isa, &w, &x, n, &mut y));
                line += &format!(
                    "  {t}T {:7.1} GFLOP/s",
                    2.0 * (n * rows * cols) as f64 / secs / 1e9
                );
            }
            println!("{line}");
        }
    }
}

fn attn(args: &Args) {
    use cmf_kernels::attention::attention_with;
    use cmf_kernels::{AttnParams, KvCache, KvDtype};
    println!(
        "## decode attention (isa {}), Qwen3-0.6B layer: 16 heads, 8 kv heads, head_dim 128",
        args.isa
    );
    let (heads, kvh, hd) = (16usize, 8usize, 128usize);
    let ctxs: Vec<usize> = std::env::var("CMF_KBENCH_CTX")
        .map(|v| v.split(',').map(|c| c.parse().expect("ctx")).collect())
        .unwrap_or(vec![512, 4096]);
    for &ctx in &ctxs {
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Bf16] {
            // Enough layers' caches to exceed the L3 cache, used in turn (as a real decode step does).
            let bytes = 2 * ctx * kvh * hd * dtype.bytes();
            let layers = if args.hot {
                1
            } else {
                (4 * (32usize << 20)).div_ceil(bytes).clamp(1, 28)
            };
            let kv_row: Vec<f32> = (0..ctx * kvh * hd)
                .map(|i| ((i % 13) as f32 - 6.0) * 0.05)
                .collect();
            let caches: Vec<KvCache> = (0..layers)
                .map(|_| {
                    let mut c = KvCache::new(dtype, ctx, kvh, hd);
                    c.write(0, &kv_row, &kv_row);
                    c
                })
                .collect();
            let q: Vec<f32> = (0..heads * hd)
                .map(|i| ((i % 5) as f32 - 2.0) * 0.1)
                .collect();
            let mut out = vec![0f32; heads * hd];
            let p = AttnParams {
                n_heads: heads,
                n_kv_heads: kvh,
                head_dim: hd,
                scale: 0.088,
                causal: true,
                q_pos0: ctx - 1,
                window: None,
            };
            let mut line = format!("ctx {ctx:5} kv {:5}", dtype.name());
            for &t in &args.threads {
                set_num_threads(t);
                let secs = best_time(args.secs, || {
                    for c in &caches {
                        attention_with(args.isa, &q, c.view(ctx), &p, None, &mut out);
                    }
                }) / layers as f64;
                line += &format!(
                    "  {t}T {:7.1} µs/layer {:6.1} GB/s",
                    secs * 1e6,
                    bytes as f64 / secs / 1e9
                );
            }
            println!("{line}");
        }
    }
    println!(
        "## joint attention (isa {}), Z-Image: 30 heads, head_dim 128, non-causal, f32",
        args.isa
    );
    let joint: Vec<usize> = std::env::var("CMF_KBENCH_JOINT")
        .map(|v| {
            v.split(',')
                .filter(|c| !c.is_empty())
                .map(|c| c.parse().expect("tokens"))
                .collect()
        })
        .unwrap_or(vec![1024, 4096]);
    for &n in &joint {
        let (heads, hd) = (30usize, 128usize);
        let x: Vec<f32> = (0..n * heads * hd)
            .map(|i| ((i % 11) as f32 - 5.0) * 0.05)
            .collect();
        let mut out = vec![0f32; x.len()];
        let p = AttnParams {
            n_heads: heads,
            n_kv_heads: heads,
            head_dim: hd,
            scale: 0.088,
            causal: false,
            q_pos0: 0,
            window: None,
        };
        let mut line = format!("tokens {n:5}");
        for &t in &args.threads {
            set_num_threads(t);
            let secs = best_time(if n > 2048 { 0.0 } else { args.secs }, || {
                attention_with(
                    args.isa,
                    &x,
                    cmf_kernels::Kv::f32(&x, &x, n),
                    &p,
                    None,
                    &mut out,
                )
            });
            line += &format!(
                "  {t}T {:8.1} ms {:6.1} GFLOP/s",
                secs * 1e3,
                4.0 * (n * n * hd * heads) as f64 / secs / 1e9
            );
        }
        println!("{line}");
    }
}

/// Error of int8 input quantization, per 32-block (the kernels' scheme) vs one scale per row, on
/// a 1024×3072 matrix of Gaussian-like weights: relative RMS error of y against f64.
fn actq(_args: &Args) {
    let (rows, cols) = (1024usize, 3072usize);
    let mut seed = 1u64;
    let mut uni = move || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((seed >> 40) as f64 / (1u64 << 24) as f64) - 0.5
    };
    let w: Vec<f64> = (0..rows * cols)
        .map(|_| (0..4).map(|_| uni()).sum::<f64>())
        .collect();
    let quant = |x: &[f64], block: usize| -> Vec<f64> {
        x.chunks(block)
            .flat_map(|b| {
                let d = b.iter().fold(0f64, |m, v| m.max(v.abs())) / 127.0;
                b.iter()
                    .map(move |v| if d > 0.0 { (v / d).round() * d } else { 0.0 })
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    println!("## input quantization error (relative RMS of y = W·x, 1024×3072, f64 reference)");
    for (name, outlier) in [
        ("gaussian-like x", 1.0f64),
        ("x with 1% outlier channels ×20", 20.0),
        ("x with 1% outlier channels ×100", 100.0),
    ] {
        let x: Vec<f64> = (0..cols)
            .map(|i| (0..4).map(|_| uni()).sum::<f64>() * if i % 97 == 5 { outlier } else { 1.0 })
            .collect();
        let err = |xq: &[f64]| {
            let (mut num, mut den) = (0f64, 0f64);
            for r in 0..rows {
                let row = &w[r * cols..(r + 1) * cols];
                let y: f64 = row.iter().zip(&x).map(|(a, b)| a * b).sum();
                let yq: f64 = row.iter().zip(xq).map(|(a, b)| a * b).sum();
                num += (y - yq).powi(2);
                den += y * y;
            }
            (num / den).sqrt()
        };
        println!(
            "{name:34} per-32 blocks {:.2e}   per-row {:.2e}",
            err(&quant(&x, 32)),
            err(&quant(&x, cols))
        );
    }
}

/// The Flux VAE decoder's 3×3 convs (channels in → out at h × w), as a 512² image has them, and
/// a 1024² image's largest: GFLOP/s of each schedule (2·c_out·c_in·9·h·w per call).
fn conv(args: &Args) {
    use cmf_kernels::conv::{conv2d_schedule_with, Conv2d, Schedule};
    const SHAPES: [(usize, usize, usize); 5] = [
        (512, 512, 64),
        (512, 512, 128),
        (512, 256, 256),
        (256, 256, 256),
        (128, 128, 512),
    ];
    println!("## conv 3×3 (isa {}), f32 weights: GFLOP/s", args.isa);
    for (c_in, c_out, hw) in SHAPES {
        let bytes = random_payload(Dtype::F32, c_out, c_in * 9, 7);
        let w = Weight::new(Dtype::F32, c_out, c_in * 9, &bytes).unwrap();
        let x: Vec<f32> = (0..c_in * hw * hw)
            .map(|i| ((i % 17) as f32 - 8.0) * 0.1)
            .collect();
        let bias = vec![0.5f32; c_out];
        let mut y = vec![0f32; c_out * hw * hw];
        let flop = 2.0 * (c_out * c_in * 9 * hw * hw) as f64;
        for &t in &args.threads {
            set_num_threads(t);
            let mut line = format!("{c_in:>3}→{c_out:<3} at {hw}² threads {t}:");
            for (name, sch) in [("taps", Schedule::TAPS), ("im2col", Schedule::Im2col)] {
                let layer = Conv2d {
                    weight: &w,
                    k: 3,
                    bias: Some(&bias),
                };
                let secs = best_time(args.secs, || {
                    conv2d_schedule_with(args.isa, sch, layer, &x, hw, hw, &mut y)
                });
                line += &format!("  {name} {:.1}", flop / secs / 1e9);
            }
            println!("{line}");
        }
    }
}

fn main() {
    let args = parse();
    println!(
        "cmf-kernels kbench: best supported ISA {}, running {}",
        cmf_kernels::cpu::best_supported(),
        args.isa
    );
    match args.what.as_str() {
        "mem" => mem(&args),
        "matvec" => matvec(&args),
        "matmul" => matmul(&args),
        "attn" => attn(&args),
        "actq" => actq(&args),
        "conv" => conv(&args),
        "all" => {
            mem(&args);
            matvec(&args);
            matmul(&args);
            attn(&args);
        }
        other => panic!("unknown benchmark {other}: mem|matvec|matmul|attn|actq|conv|all"),
    }
}
