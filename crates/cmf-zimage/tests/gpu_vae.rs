//! The device VAE decoder (`cmf_gpu::cuda::vae::CudaVae`) against the CPU decoder
//! (`VaeDecoder::decode`). Needs a CUDA device; without one every test prints `SKIPPED: …`
//! (or fails with `CMF_REQUIRE_GPU=1`).
//!
//! Tolerance: the device runs bf16 GEMM operands (every conv input and weight, attention
//! Q/K/V/P) with f32 accumulation; the CPU runs f32 (float weights) or int8 activations (q8
//! weights). Errors are measured relative to the reference image's RMS:
//! - against the CPU on the same weights widened to f32 (the device's own rounding only):
//!   RMS ≤ 1e-2, max ≤ 6e-2;
//! - against the CPU on the stored codecs (what the pipeline pairs): RMS ≤ 2e-2, max ≤ 1e-1
//!   (the CPU's q8 products quantise activations to int8 per 32-block as well).
//!
//! `CMF_VAE_BENCH=1` adds a timing run of the full FLUX geometry (random bf16 weights) at 512²
//! and 1024² output.

mod common;

use cmf_format::Dtype;
use cmf_gpu::cuda::vae::{CudaVae, VaeOptions};
use cmf_gpu::cuda::CudaBackend;
use cmf_gpu::llm::synth::{random_matrix, Rng};
use cmf_kernels::reference::decode_row;
use cmf_kernels::Weight;
use cmf_zimage::tensors::{Loader, MemTensors, TensorSource};
use cmf_zimage::vae::{to_rgb8, Tensor3, VaeConfig, VaeDecoder};
use half::bf16;
use std::time::Instant;

fn backend() -> Option<CudaBackend> {
    common::gpu_skip::device_or_skip(CudaBackend::open(0))
}

/// Codec choice per weight matrix.
#[derive(Clone, Copy, PartialEq)]
enum Codecs {
    /// Cycles q8_2f, bf16, f32, f16 (q8 only where the columns are whole 32-blocks).
    Mixed,
    Bf16,
}

/// Random VAE tensors under `vae.decoder.*`, and (optionally) the same weights widened to f32.
struct Gen {
    stored: MemTensors,
    wide: Option<MemTensors>,
    rng: Rng,
    codecs: Codecs,
    n: u64,
}

impl Gen {
    fn new(codecs: Codecs, keep_wide: bool, seed: u64) -> Gen {
        Gen {
            stored: MemTensors::new("random vae"),
            wide: keep_wide.then(|| MemTensors::new("random vae (f32)")),
            rng: Rng::new(seed),
            codecs,
            n: 0,
        }
    }

    fn matrix(&mut self, name: &str, shape: Vec<usize>) {
        let (rows, cols) = (shape[0], shape[1..].iter().product::<usize>());
        let dtype = match self.codecs {
            Codecs::Bf16 => Dtype::Bf16,
            Codecs::Mixed => match self.n % 4 {
                0 if cols % 32 == 0 => Dtype::Q8_2f,
                0 | 2 => Dtype::F32,
                1 => Dtype::Bf16,
                _ => Dtype::F16,
            },
        };
        self.n += 1;
        let std = 1.0 / (cols as f32).sqrt();
        let bytes = random_matrix(dtype, rows, cols, std, 1000 + self.n);
        let full = format!("vae.decoder.{name}.weight");
        if let Some(wide) = &mut self.wide {
            let w = Weight {
                dtype,
                rows,
                cols,
                data: &bytes,
            };
            let mut v = vec![0f32; rows * cols];
            for (r, row) in v.chunks_exact_mut(cols).enumerate() {
                decode_row(&w, r, row);
            }
            wide.insert_f32(full.clone(), shape.clone(), &v);
        }
        self.stored.insert(full, dtype, shape, bytes);
    }

    fn vector(&mut self, name: &str, n: usize, center: f32, spread: f32) {
        let v: Vec<f32> = (0..n)
            .map(|_| center + spread * self.rng.uniform())
            .collect();
        let full = format!("vae.decoder.{name}");
        if let Some(wide) = &mut self.wide {
            wide.insert_f32(full.clone(), vec![n], &v);
        }
        self.stored.insert_f32(full, vec![n], &v);
    }

    fn conv(&mut self, name: &str, cin: usize, cout: usize, k: usize) {
        self.matrix(name, vec![cout, cin, k, k]);
        self.vector(&format!("{name}.bias"), cout, 0.0, 0.1);
    }

    fn linear(&mut self, name: &str, c: usize) {
        self.matrix(name, vec![c, c]);
        self.vector(&format!("{name}.bias"), c, 0.0, 0.1);
    }

    fn norm(&mut self, name: &str, c: usize) {
        self.vector(&format!("{name}.weight"), c, 1.0, 0.2);
        self.vector(&format!("{name}.bias"), c, 0.0, 0.2);
    }

    fn resnet(&mut self, p: &str, cin: usize, cout: usize) {
        self.norm(&format!("{p}.norm1"), cin);
        self.conv(&format!("{p}.conv1"), cin, cout, 3);
        self.norm(&format!("{p}.norm2"), cout);
        self.conv(&format!("{p}.conv2"), cout, cout, 3);
        if cin != cout {
            self.conv(&format!("{p}.conv_shortcut"), cin, cout, 1);
        }
    }

    /// Every tensor `VaeDecoder::load` reads for `cfg`.
    fn decoder(&mut self, cfg: &VaeConfig) {
        let top = *cfg.block_out_channels.last().unwrap();
        self.conv("conv_in", cfg.latent_channels, top, 3);
        self.resnet("mid_block.resnets.0", top, top);
        self.resnet("mid_block.resnets.1", top, top);
        if cfg.mid_block_add_attention {
            let p = "mid_block.attentions.0";
            self.norm(&format!("{p}.group_norm"), top);
            for l in ["to_q", "to_k", "to_v", "to_out.0"] {
                self.linear(&format!("{p}.{l}"), top);
            }
        }
        let rev: Vec<usize> = cfg.block_out_channels.iter().rev().copied().collect();
        let mut prev = top;
        for (i, &out) in rev.iter().enumerate() {
            for j in 0..cfg.layers_per_block + 1 {
                let cin = if j == 0 { prev } else { out };
                self.resnet(&format!("up_blocks.{i}.resnets.{j}"), cin, out);
            }
            if i + 1 < rev.len() {
                self.conv(&format!("up_blocks.{i}.upsamplers.0.conv"), out, out, 3);
            }
            prev = out;
        }
        let c0 = cfg.block_out_channels[0];
        self.norm("conv_norm_out", c0);
        self.conv("conv_out", c0, cfg.out_channels, 3);
    }
}

fn config(blocks: &[usize], layers: usize, groups: usize) -> VaeConfig {
    let v = serde_json::json!({
        "latent_channels": 16,
        "out_channels": 3,
        "block_out_channels": blocks,
        "layers_per_block": layers,
        "norm_num_groups": groups,
        "mid_block_add_attention": true,
    });
    VaeConfig::from_json(&v, "test").unwrap()
}

/// (RMS of the difference, max |difference|), both relative to the reference's RMS.
fn errors(got: &[f32], want: &[f32]) -> (f32, f32) {
    assert_eq!(got.len(), want.len());
    let n = want.len() as f64;
    let rms = (want.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / n).sqrt();
    let d2 = got
        .iter()
        .zip(want)
        .map(|(a, b)| ((*a - *b) as f64).powi(2))
        .sum::<f64>();
    let dmax = got
        .iter()
        .zip(want)
        .fold(0f64, |m, (a, b)| m.max((*a - *b).abs() as f64));
    (((d2 / n).sqrt() / rms) as f32, (dmax / rms) as f32)
}

fn device_decode(vae: &mut CudaVae, z: &[f32], h: usize, w: usize) -> Vec<f32> {
    let s = vae.geometry().scale_factor();
    let mut out = vec![0f32; vae.geometry().out_channels * h * s * w * s];
    vae.decode(z, h, w, &mut out)
        .unwrap_or_else(|r| panic!("device decode: {r}"));
    assert!(out.iter().all(|v| v.is_finite()));
    out
}

#[test]
fn device_decoder_matches_cpu_on_random_weights() {
    let Some(be) = backend() else { return };
    // 3 up blocks (two upsamplers, a 64 → 32 shortcut), 8 groups of 4 and 8 channels, a
    // non-square latent.
    let cfg = config(&[32, 64, 64], 1, 8);
    let mut g = Gen::new(Codecs::Mixed, true, 7);
    g.decoder(&cfg);
    let (h, w) = (5, 7);
    let mut rng = Rng::new(99);
    let z = rng.vec(16 * h * w, 1.5);
    let stored = VaeDecoder::load(&Loader::new(&g.stored, "vae."), cfg.clone()).unwrap();
    let wide_src = g.wide.as_ref().unwrap();
    let wide = VaeDecoder::load(&Loader::new(wide_src, "vae."), cfg.clone()).unwrap();
    let cpu_stored = stored.decode(&z, h, w).data;
    let cpu_wide = wide.decode(&z, h, w).data;
    let model = stored.gpu_model();
    let codecs: Vec<String> = model
        .weights()
        .iter()
        .map(|(_, c)| c.weight.dtype.to_string())
        .collect();
    eprintln!("weight codecs: {codecs:?}");
    // im2col convs with the default tiling (one tile per conv), then with a tiny scratch (many
    // im2col tiles, several attention query tiles), then cuDNN's convs where libcudnn loads (the
    // decoder falls back to im2col where it does not; the log line says which ran).
    let cases = [
        (VaeOptions::default().scratch_bytes, false),
        (4096, false),
        (VaeOptions::default().scratch_bytes, true),
    ];
    for (scratch, cudnn) in cases {
        let opts = VaeOptions {
            scratch_bytes: scratch,
            cudnn,
        };
        let mut vae = CudaVae::load_with(be.device(), &model, opts).unwrap();
        let got = device_decode(&mut vae, &z, h, w);
        let convs = if vae.uses_cudnn() { "cuDNN" } else { "im2col" };
        let (rms_w, max_w) = errors(&got, &cpu_wide);
        let (rms_s, max_s) = errors(&got, &cpu_stored);
        let (rms_c, max_c) = errors(&cpu_stored, &cpu_wide);
        eprintln!(
            "{convs} convs, scratch {scratch} B: device vs CPU(f32 weights) rms {rms_w:.2e} max {max_w:.2e}; \
             device vs CPU(stored codecs) rms {rms_s:.2e} max {max_s:.2e}; \
             CPU stored vs f32 rms {rms_c:.2e} max {max_c:.2e}"
        );
        assert!(rms_w <= 1e-2 && max_w <= 6e-2, "device vs CPU f32 weights");
        assert!(
            rms_s <= 2e-2 && max_s <= 1e-1,
            "device vs CPU stored codecs"
        );
        // A second decode on the same workspace gives the same image.
        assert_eq!(device_decode(&mut vae, &z, h, w), got);
    }
}

/// The fixture's matrices rounded to bf16 (vectors kept f32): the CPU decoder on these shows
/// how far bf16 weights alone move this network's output.
fn bf16_weights(src: &MemTensors) -> MemTensors {
    let mut b = MemTensors::new("fixture, bf16 weights");
    for name in src.names() {
        let t = src.tensor(name).unwrap();
        let v: Vec<f32> = t
            .data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        if t.shape.len() >= 2 {
            let bytes = v
                .iter()
                .flat_map(|x| bf16::from_f32(*x).to_le_bytes())
                .collect();
            b.insert(name, Dtype::Bf16, t.shape.to_vec(), bytes);
        } else {
            b.insert_f32(name, t.shape.to_vec(), &v);
        }
    }
    b
}

/// The diffusers fixture (4 up blocks of 32 channels, f32 weights, torch's default init, so a
/// deeper net with a wider dynamic range than the random one above). Measured on the H200:
/// device vs diffusers rms 1.2e-2, max 8.5e-2, where the CPU with bf16-rounded weights (and f32
/// activations) already gives rms 8.7e-3, max 5.7e-2: the device's error is bf16 rounding.
/// Held to rms ≤ 2e-2, max ≤ 1.5e-1.
#[test]
fn device_decoder_matches_diffusers_fixture() {
    let Some(be) = backend() else { return };
    let mut src = MemTensors::new("fixtures/zimage/tiny/vae");
    common::load_component("vae", "vae.", &mut src);
    let cfg = VaeConfig::from_json(&common::config("vae", "config.json"), "fixture").unwrap();
    let vae = VaeDecoder::load(&Loader::new(&src, "vae."), cfg.clone()).unwrap();
    let b16 = bf16_weights(&src);
    let vae_b16 = VaeDecoder::load(&Loader::new(&b16, "vae."), cfg).unwrap();
    let mut dev = CudaVae::load(be.device(), &vae.gpu_model()).unwrap();
    let e = common::Expected::load("vae.safetensors");
    for case in ["square", "wide"] {
        let shape = e.shape(&format!("{case}.z"));
        let (z, want) = (e.f32(&format!("{case}.z")), e.f32(&format!("{case}.image")));
        let got = device_decode(&mut dev, &z, shape[1], shape[2]);
        let (rms, max) = errors(&got, &want);
        let (rms_b, max_b) = errors(&vae_b16.decode(&z, shape[1], shape[2]).data, &want);
        eprintln!(
            "{case}: device vs diffusers rms {rms:.2e} max {max:.2e} \
             (CPU with bf16 weights: rms {rms_b:.2e} max {max_b:.2e})"
        );
        assert!(rms <= 2e-2 && max <= 1.5e-1, "{case}");
    }
}

#[test]
fn device_decoder_refuses_bad_shapes_without_touching_the_output() {
    let Some(be) = backend() else { return };
    let cfg = config(&[32, 64], 1, 8);
    let mut g = Gen::new(Codecs::Bf16, false, 3);
    g.decoder(&cfg);
    let cpu = VaeDecoder::load(&Loader::new(&g.stored, "vae."), cfg).unwrap();
    let mut vae = CudaVae::load(be.device(), &cpu.gpu_model()).unwrap();
    let z = vec![0.5f32; 16 * 4 * 4];
    let mut out = vec![7f32; 3 * 8 * 8];
    assert!(vae.decode(&z[1..], 4, 4, &mut out).is_err());
    assert!(vae.decode(&z, 4, 4, &mut out[1..]).is_err());
    assert!(vae.decode(&z, 0, 4, &mut out).is_err());
    assert!(out.iter().all(|&v| v == 7.0));
    vae.decode(&z, 4, 4, &mut out).unwrap();
    assert!(out.iter().any(|&v| v != 7.0));
}

/// `prepare` (the pipeline's preload: workspace, plans and a warm-up decode of zeros) changes
/// nothing a later decode returns, at the prepared size or another, and refuses a size the
/// decoder cannot plan.
#[test]
fn prepare_leaves_decodes_unchanged() {
    let Some(be) = backend() else { return };
    let cfg = config(&[32, 64], 1, 8);
    let mut g = Gen::new(Codecs::Bf16, false, 11);
    g.decoder(&cfg);
    let cpu = VaeDecoder::load(&Loader::new(&g.stored, "vae."), cfg).unwrap();
    let (h, w) = (6, 5);
    let z = Rng::new(8).vec(16 * h * w, 1.5);
    let mut plain = CudaVae::load(be.device(), &cpu.gpu_model()).unwrap();
    let want = device_decode(&mut plain, &z, h, w);
    let mut prepared = CudaVae::load(be.device(), &cpu.gpu_model()).unwrap();
    assert!(prepared.prepare(0, 5).is_err());
    prepared.prepare(h, w).unwrap();
    assert_eq!(device_decode(&mut prepared, &z, h, w), want);
    // Prepared for a larger size, decoding a smaller one.
    prepared.prepare(2 * h, 2 * w).unwrap();
    assert_eq!(device_decode(&mut prepared, &z, h, w), want);
}

/// The device's 8-bit output (what the pipeline reads back) is exactly the host conversion
/// (`to_rgb8`) of the device's f32 image: both come from the same conv_out sums. A NaN in the
/// latent is reported as not finite.
#[test]
fn device_rgb8_is_the_host_conversion_of_the_f32_image() {
    let Some(be) = backend() else { return };
    let cfg = config(&[32, 64], 1, 8);
    let mut g = Gen::new(Codecs::Bf16, false, 5);
    g.decoder(&cfg);
    let cpu = VaeDecoder::load(&Loader::new(&g.stored, "vae."), cfg).unwrap();
    let mut vae = CudaVae::load(be.device(), &cpu.gpu_model()).unwrap();
    let (h, w) = (6, 9);
    let mut z = Rng::new(3).vec(16 * h * w, 2.0);
    let s = vae.geometry().scale_factor();
    let img = Tensor3 {
        c: 3,
        h: h * s,
        w: w * s,
        data: device_decode(&mut vae, &z, h, w),
    };
    let want = to_rgb8(&img);
    // The random weights spread the image over and beyond [-1, 1]: both clamps and the middle.
    assert!(want.contains(&0) && want.contains(&255) && want.iter().any(|&v| v > 0 && v < 255));
    let mut got = vec![7u8; want.len()];
    assert!(vae.decode_rgb8(&z, h, w, &mut got).unwrap());
    assert_eq!(got, want);
    z[17] = f32::NAN;
    assert!(!vae.decode_rgb8(&z, h, w, &mut got).unwrap());
    assert!(vae.decode_rgb8(&z, h, w, &mut got[1..]).is_err());
}

/// `CMF_VAE_BENCH=1`: the full FLUX decoder geometry, random bf16 weights; cold (first decode:
/// workspace allocation included) and warm wall time per decode, host clock after the readback,
/// with the 3×3 convs through cuDNN (where libcudnn loads) and through im2col + cuBLAS.
/// `CMF_VAE_BENCH_LATENTS=128` (latent sides, default `64,128`) and `CMF_VAE_BENCH_RUNS=1` (warm
/// runs, default 5) narrow it, e.g. to profile one 1024² decode under ncu.
#[test]
fn bench_flux_geometry() {
    if std::env::var("CMF_VAE_BENCH").as_deref() != Ok("1") {
        eprintln!("SKIPPED: set CMF_VAE_BENCH=1 to time the full FLUX decoder");
        return;
    }
    let Some(be) = backend() else { return };
    let cfg = config(&[128, 256, 512, 512], 2, 32);
    let mut g = Gen::new(Codecs::Bf16, false, 11);
    g.decoder(&cfg);
    let cpu = VaeDecoder::load(&Loader::new(&g.stored, "vae."), cfg).unwrap();
    let env_list = |name: &str, default: &str| -> Vec<usize> {
        std::env::var(name)
            .unwrap_or_else(|_| default.into())
            .split(',')
            .filter_map(|v| v.trim().parse().ok())
            .collect()
    };
    let sides = env_list("CMF_VAE_BENCH_LATENTS", "64,128");
    let runs = env_list("CMF_VAE_BENCH_RUNS", "5")
        .first()
        .copied()
        .unwrap_or(5)
        .max(1);
    for cudnn in [true, false] {
        let opts = VaeOptions {
            cudnn,
            ..VaeOptions::default()
        };
        let t = Instant::now();
        let mut vae = CudaVae::load_with(be.device(), &cpu.gpu_model(), opts).unwrap();
        eprintln!(
            "convs {}: load {:.1} ms, {:.1} MB resident weights",
            if cudnn { "cuDNN" } else { "im2col" },
            t.elapsed().as_secs_f64() * 1e3,
            vae.weight_bytes() as f64 / 1e6
        );
        time_decodes(&mut vae, &sides, runs);
    }
}

/// Cold and warm decodes of random latents of each side in `sides` (see `bench_flux_geometry`).
fn time_decodes(vae: &mut CudaVae, sides: &[usize], runs: usize) {
    let mut rng = Rng::new(5);
    for (h, w) in sides.iter().map(|&s| (s, s)) {
        vae.release_workspace();
        let z = rng.vec(16 * h * w, 1.0);
        let t = Instant::now();
        let first = device_decode(vae, &z, h, w);
        let cold = t.elapsed().as_secs_f64() * 1e3;
        let mut warm = Vec::new();
        for _ in 0..runs {
            let t = Instant::now();
            let again = device_decode(vae, &z, h, w);
            warm.push(t.elapsed().as_secs_f64() * 1e3);
            assert_eq!(again, first);
        }
        warm.sort_by(|a, b| a.partial_cmp(b).unwrap());
        eprintln!(
            "{}×{} image: cold {cold:.1} ms, warm min {:.1} / median {:.1} ms ({} runs), workspace {:.2} GB",
            8 * h,
            8 * w,
            warm[0],
            warm[warm.len() / 2],
            warm.len(),
            vae.workspace_bytes(h, w).unwrap() as f64 / 1e9
        );
    }
}
