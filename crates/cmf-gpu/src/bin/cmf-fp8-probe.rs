//! cmf-fp8-probe: is an FP8 DiT worth building? Times the Z-Image DiT's GEMM shapes in bf16
//! (cuBLAS, what the DiT runs now) and in FP8 e4m3 (cuBLASLt, per-row scales on both operands,
//! with and without fast accumulation, the activation quantisation timed separately), and
//! reports the FP8 output's relative L2 error against the bf16 one. Beside them, the file's
//! int8 codec as cuBLASLt runs it: s8 × s8 → exact s32 sums (one f32 scale per row of each
//! operand, quantised on the host here, applied on the host to the downloaded sums), timed
//! and checked the same way; the s32 output is twice the bf16 bytes, so a model path would
//! also pay a pass (or a consumer) that scales it to bf16.
//!
//! usage: cmf-fp8-probe [--tokens 4128,1056] [--reps 20]
//! Shapes per token count m: q|k|v (n 11520, k 3840), O (3840, 3840), w1|w3 (20480, 3840),
//! w2 (3840, 10240); random weights and activations (values ~U(-1, 1) with row magnitudes
//! spread over 1/8 .. 8, so the per-row scales matter).

use cmf_gpu::cuda::dit::TURBO_BLOCK_GEMMS;
use cmf_gpu::cuda::runtime::blas::Blas;
use cmf_gpu::cuda::runtime::device::{bytes_of, DResult, Timer};
use cmf_gpu::cuda::runtime::fp8::{Fp8Gemm, Fp8Out};
use cmf_gpu::cuda::runtime::lt::{LtCall, LtIn, LtOut};
use cmf_gpu::cuda::CudaBackend;
use cmf_gpu::llm::synth::Rng;
use half::bf16;

fn main() {
    let mut tokens = vec![4128usize, 1056];
    let mut reps = 20usize;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let val = it.next().unwrap_or_default();
        match flag.as_str() {
            "--tokens" => tokens = val.split(',').filter_map(|t| t.parse().ok()).collect(),
            "--reps" => reps = val.parse().unwrap_or(20).max(3),
            other => {
                eprintln!("cmf-fp8-probe: unknown flag {other}");
                std::process::exit(2);
            }
        }
    }
    if let Err(e) = run(&tokens, reps) {
        eprintln!("cmf-fp8-probe: {e}");
        std::process::exit(1);
    }
}

/// Random bf16 rows whose magnitudes differ by up to 64× between rows.
fn rows_bf16(rng: &mut Rng, rows: usize, cols: usize) -> Vec<u16> {
    let mut v = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        let mag = 2f32.powi((r % 7) as i32 - 3);
        v.extend((0..cols).map(|_| bf16::from_f32(rng.uniform() * mag).to_bits()));
    }
    v
}

/// Rows of bf16 bits as s8 with one f32 scale per row (amax / 127, round to nearest).
fn rows_s8(v: &[u16], cols: usize) -> (Vec<i8>, Vec<f32>) {
    let mut q = Vec::with_capacity(v.len());
    let mut scales = Vec::with_capacity(v.len() / cols);
    for row in v.chunks(cols) {
        let f: Vec<f32> = row.iter().map(|&b| bf16::from_bits(b).to_f32()).collect();
        let amax = f.iter().fold(0f32, |a, x| a.max(x.abs()));
        let s = if amax > 0.0 { amax / 127.0 } else { 1.0 };
        q.extend(f.iter().map(|x| (x / s).round().clamp(-127.0, 127.0) as i8));
        scales.push(s);
    }
    (q, scales)
}

fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        num += ((g - w) as f64).powi(2);
        den += (*w as f64).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

fn run(tokens: &[usize], reps: usize) -> Result<(), String> {
    let backend = CudaBackend::open(0)?;
    let dev = backend.device();
    let err = |e: cmf_gpu::cuda::runtime::device::DevError| e.0;
    let blas = Blas::new(dev).map_err(err)?;
    let fp8 = Fp8Gemm::new(dev).map_err(err)?;
    let timer = Timer::new().map_err(err)?;
    println!("device {}", dev.name);
    println!("| tokens | GEMM (n × k) | bf16 ms | bf16 TFLOP/s | fp8 ms | fp8 TFLOP/s | fp8 fast ms | fp8 fast TFLOP/s | quantise x ms | fp8 rel err | fast rel err | int8 ms | int8 TOP/s | int8 rel err |");
    println!("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    let mut rng = Rng::new(11);
    for &m in tokens {
        for &(name, n, k) in &TURBO_BLOCK_GEMMS {
            let x = rows_bf16(&mut rng, m, k);
            let w = rows_bf16(&mut rng, n, k);
            let dx = dev.upload_new(bytes_of(&x)).map_err(err)?;
            let dw = dev.upload_new(bytes_of(&w)).map_err(err)?;
            let qx = dev.alloc(m * k).map_err(err)?;
            let sx = dev.alloc(m * 4).map_err(err)?;
            let qw = dev.alloc(n * k).map_err(err)?;
            let sw = dev.alloc(n * 4).map_err(err)?;
            let out_b = dev.alloc(m * n * 2).map_err(err)?;
            let out_f = dev.alloc(m * n * 2).map_err(err)?;
            fp8.quantize(dw.ptr(), n, k, k, qw.ptr(), sw.ptr())
                .map_err(err)?;
            let time = |f: &dyn Fn() -> DResult<()>| timer.median_ms(dev, reps, f).map_err(err);
            let t_bf16 = time(&|| blas.gemm_bf16_out(dw.ptr(), dx.ptr(), out_b.ptr(), n, m, k, n))?;
            let t_q = time(&|| fp8.quantize(dx.ptr(), m, k, k, qx.ptr(), sx.ptr()))?;
            let mut t_fp8 = [0f32; 2];
            let mut e_fp8 = [0f64; 2];
            let want = dev.download_bf16(out_b.ptr(), m * n).map_err(err)?;
            for (i, fast) in [false, true].into_iter().enumerate() {
                t_fp8[i] = time(&|| {
                    fp8.gemm(
                        qw.ptr(),
                        sw.ptr(),
                        qx.ptr(),
                        sx.ptr(),
                        Fp8Out::Bf16(out_f.ptr()),
                        (n, m, k),
                        n,
                        fast,
                    )
                })?;
                let got = dev.download_bf16(out_f.ptr(), m * n).map_err(err)?;
                e_fp8[i] = rel_err(&got, &want);
            }
            let (t_i8, e_i8) = match int8_arm(dev, &fp8, &timer, reps, (&w, &x), (n, m, k), &want) {
                Ok(r) => (format!("{:.3}", r.0), r),
                Err(e) => (format!("({e})"), (f32::NAN, f64::NAN)),
            };
            let tf = |ms: f32| 2.0 * (m * n * k) as f64 / (ms as f64 * 1e-3) / 1e12;
            println!(
                "| {m} | {name} ({n} × {k}) | {t_bf16:.3} | {:.0} | {:.3} | {:.0} | {:.3} | {:.0} | {t_q:.3} | {:.2e} | {:.2e} | {t_i8} | {:.0} | {:.2e} |",
                tf(t_bf16),
                t_fp8[0],
                tf(t_fp8[0]),
                t_fp8[1],
                tf(t_fp8[1]),
                e_fp8[0],
                e_fp8[1],
                tf(e_i8.0),
                e_i8.1
            );
        }
    }
    Ok(())
}

/// The int8 arm: `w` and `x` (bf16 bits) as s8 rows with per-row scales, cuBLASLt's s8 GEMM
/// timed, its s32 sums scaled on the host and compared with `want`. Returns (ms, rel err).
fn int8_arm(
    dev: &cmf_gpu::cuda::runtime::device::Dev,
    fp8: &Fp8Gemm,
    timer: &Timer,
    reps: usize,
    (w, x): (&[u16], &[u16]),
    (n, m, k): (usize, usize, usize),
    want: &[f32],
) -> Result<(f32, f64), String> {
    let err = |e: cmf_gpu::cuda::runtime::device::DevError| e.0;
    let (qw, sw) = rows_s8(w, k);
    let (qx, sx) = rows_s8(x, k);
    let dqw = dev.upload_new(bytes_of(&qw)).map_err(err)?;
    let dqx = dev.upload_new(bytes_of(&qx)).map_err(err)?;
    let out = dev.alloc(m * n * 4).map_err(err)?;
    let call = LtCall {
        w: dqw.ptr(),
        x: dqx.ptr(),
        input: LtIn::I8,
        out: LtOut::I32(out.ptr()),
        nmk: (n, m, k),
        ldc: n,
    };
    let ms = timer
        .median_ms(dev, reps, || fp8.lt().gemm(&call))
        .map_err(err)?;
    let mut raw = vec![0u8; m * n * 4];
    dev.download(&mut raw, out.ptr()).map_err(err)?;
    let got: Vec<f32> = raw
        .chunks_exact(4)
        .enumerate()
        .map(|(i, b)| {
            let v = i32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
            v as f32 * sx[i / n] * sw[i % n]
        })
        .collect();
    Ok((ms, rel_err(&got, want)))
}
