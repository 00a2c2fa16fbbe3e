//! The DiT on the device (cmf-gpu's CUDA backend, through the facade) against the CPU path
//! (and the whole pipeline: text encoder, DiT and VAE on the device),
//! which the other tests tie to diffusers. Needs a CUDA GPU: without one each test prints
//! `SKIPPED: …` and passes (CI has none), or fails with `CMF_REQUIRE_GPU=1`.
//!
//! Tolerances: the device multiplies bf16 operands (8-bit mantissa, f32 accumulation) and runs
//! attention on f16 operands, where the CPU runs f32 throughout; one step's output is held to
//! 2e-2 of its scale (bf16 rounding of each GEMM input is ~4e-3 relative, accumulated over a few
//! dozen chained projections). Whole images: within 2/255 on at least 99 % of the values.

mod common;

use cmf_convert::zimage::Codec;
use cmf_format::Dtype;
use cmf_gpu::dit::{DitPrecision, Fp8Attention};
use cmf_gpu::{Gpu, GpuDit, GpuMode};
use cmf_zimage::denoiser::Denoiser;
use cmf_zimage::pipeline::{generate, generate_with, Plan, Request, Resident, ZimagePack};
use cmf_zimage::tensors::{Loader, MemTensors, TensorSource};
use cmf_zimage::transformer::{DitConfig, DitItem, ZImageDit};
use common::*;

const STEP_TOL: f32 = 2e-2;

/// The tests of this file run on parallel threads of one process and take the device one at a
/// time: each holds this lock throughout, so no test's models and timings share the card with
/// another's.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// The device model of `dit` at `precision`, its attention in FP8 where `attn` says, loaded as
/// the denoiser's resident model (None: the device refused it).
fn load_device_dit(
    gpu: &Gpu,
    dit: &ZImageDit,
    precision: DitPrecision,
    attn: Fp8Attention,
) -> Option<GpuDit> {
    let mut model = dit.device_model(precision);
    model.fp8_attention = attn;
    gpu.load_dit(&model).ok()
}

fn device() -> Option<Gpu> {
    gpu_skip::device_or_skip(Gpu::open(GpuMode::Cuda))
}

/// A deterministic stream of values in [-1, 1).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 23) as f32) - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next() * scale).collect()
    }
}

/// The fixture transformer, its matrices re-encoded in `codec` (None: f32 as stored).
fn fixture_dit(codec: Option<Dtype>) -> (MemTensors, DitConfig) {
    let mut f32s = MemTensors::new("fixtures/zimage/tiny/transformer");
    load_component("transformer", "dit.", &mut f32s);
    let cfg = DitConfig::from_json(&config("transformer", "config.json"), "fixture").unwrap();
    (requantize(&f32s, codec), cfg)
}

/// Copies `src`, re-encoding every 2-D `.weight` whose columns are a multiple of 32.
fn requantize(src: &MemTensors, codec: Option<Dtype>) -> MemTensors {
    let mut out = MemTensors::new(src.origin.clone());
    for name in src.names() {
        let t = src.tensor(name).unwrap();
        let shape = t.shape.to_vec();
        match codec {
            Some(dt) if name.ends_with(".weight") && shape.len() == 2 && shape[1] % 32 == 0 => {
                let v: Vec<f32> = t
                    .data
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                let bytes = cmf_format::codec::encode(dt, &shape, &v).unwrap();
                out.insert(name, dt, shape, bytes);
            }
            _ => out.insert(name, t.dtype, shape, t.data.to_vec()),
        }
    }
    out
}

/// A random DiT with the real head dim (128), so the HD = 128 kernels are exercised.
fn random_dit_hd128() -> (MemTensors, DitConfig) {
    let (d, heads, f, cf, a, p) = (256usize, 2usize, 512usize, 64usize, 256usize, 64usize);
    let cfg_json = serde_json::json!({
        "dim": d, "n_heads": heads, "n_kv_heads": heads, "n_layers": 2, "n_refiner_layers": 1,
        "cap_feat_dim": cf, "axes_dims": [32, 48, 48], "axes_lens": [1024, 512, 512],
        "in_channels": 16, "norm_eps": 1e-5, "rope_theta": 256.0, "t_scale": 1000.0,
    });
    let cfg = DitConfig::from_json(&cfg_json, "random").unwrap();
    let mut m = MemTensors::new("random-hd128");
    let mut rng = Rng(99);
    let mat =
        |m: &mut MemTensors, rng: &mut Rng, name: &str, rows: usize, cols: usize, bias: bool| {
            let s = 1.0 / (cols as f32).sqrt();
            m.insert_f32(
                format!("dit.{name}.weight"),
                vec![rows, cols],
                &rng.vec(rows * cols, s * 1.7),
            );
            if bias {
                m.insert_f32(format!("dit.{name}.bias"), vec![rows], &rng.vec(rows, 0.1));
            }
        };
    let norm = |m: &mut MemTensors, rng: &mut Rng, name: &str, n: usize| {
        let v: Vec<f32> = rng.vec(n, 0.2).iter().map(|x| 1.0 + x).collect();
        m.insert_f32(format!("dit.{name}"), vec![n], &v);
    };
    mat(&mut m, &mut rng, "all_x_embedder.2-1", d, p, true);
    m.insert_f32("dit.x_pad_token", vec![1, d], &rng.vec(d, 0.5));
    norm(&mut m, &mut rng, "cap_embedder.0.weight", cf);
    mat(&mut m, &mut rng, "cap_embedder.1", d, cf, true);
    m.insert_f32("dit.cap_pad_token", vec![1, d], &rng.vec(d, 0.5));
    mat(&mut m, &mut rng, "t_embedder.mlp.0", 1024, 256, true);
    mat(&mut m, &mut rng, "t_embedder.mlp.2", a, 1024, true);
    for (part, modulated) in [
        ("noise_refiner.0", true),
        ("context_refiner.0", false),
        ("layers.0", true),
        ("layers.1", true),
    ] {
        for n in [
            "attention.to_q",
            "attention.to_k",
            "attention.to_v",
            "attention.to_out.0",
        ] {
            mat(&mut m, &mut rng, &format!("{part}.{n}"), d, d, false);
        }
        mat(
            &mut m,
            &mut rng,
            &format!("{part}.feed_forward.w1"),
            f,
            d,
            false,
        );
        mat(
            &mut m,
            &mut rng,
            &format!("{part}.feed_forward.w3"),
            f,
            d,
            false,
        );
        mat(
            &mut m,
            &mut rng,
            &format!("{part}.feed_forward.w2"),
            d,
            f,
            false,
        );
        for n in ["attention.norm_q.weight", "attention.norm_k.weight"] {
            norm(&mut m, &mut rng, &format!("{part}.{n}"), d / heads);
        }
        for n in [
            "attention_norm1.weight",
            "attention_norm2.weight",
            "ffn_norm1.weight",
            "ffn_norm2.weight",
        ] {
            norm(&mut m, &mut rng, &format!("{part}.{n}"), d);
        }
        if modulated {
            let name = format!("dit.{part}.adaLN_modulation.0");
            m.insert_f32(
                format!("{name}.weight"),
                vec![4 * d, a],
                &rng.vec(4 * d * a, 0.05),
            );
            m.insert_f32(format!("{name}.bias"), vec![4 * d], &rng.vec(4 * d, 0.2));
        }
    }
    let name = "dit.all_final_layer.2-1.adaLN_modulation.1";
    m.insert_f32(format!("{name}.weight"), vec![d, a], &rng.vec(d * a, 0.05));
    m.insert_f32(format!("{name}.bias"), vec![d], &rng.vec(d, 0.2));
    mat(&mut m, &mut rng, "all_final_layer.2-1.linear", p, d, true);
    (m, cfg)
}

/// Random caption features for `caps` (lengths) and an `h × w` latent of 16 channels.
fn random_inputs(
    cfg: &DitConfig,
    caps: &[usize],
    h: usize,
    w: usize,
    seed: u64,
) -> (Vec<(Vec<f32>, usize)>, Vec<f32>) {
    let mut rng = Rng(seed);
    let cf = cfg.cap_feat_dim;
    let cap_feats = caps.iter().map(|&l| (rng.vec(l * cf, 2.0), l)).collect();
    (cap_feats, rng.vec(16 * h * w, 1.5))
}

/// Device vs CPU velocity for `caps` (lengths) and an `h × w` latent; both the whole batch and
/// (when two items) the second item alone (the CFG-truncation subset).
fn compare(src: &MemTensors, cfg: &DitConfig, caps: &[usize], h: usize, w: usize, seed: u64) {
    compare_within(src, cfg, caps, (h, w), seed, DitPrecision::Bf16, STEP_TOL);
}

/// [`compare_attn`] with the attention `cmf imagine` runs.
fn compare_within(
    src: &MemTensors,
    cfg: &DitConfig,
    caps: &[usize],
    hw: (usize, usize),
    seed: u64,
    precision: DitPrecision,
    tol: f32,
) -> usize {
    compare_attn(src, cfg, caps, hw, seed, precision, Fp8Attention::Auto, tol)
}

/// [`compare`] with the device DiT at `precision`, its attention in FP8 where `attn` says, and
/// bound `tol` on each item's relative error. Returns the block GEMM planes the device ran in 8
/// bits (0 without a device).
#[allow(clippy::too_many_arguments)]
fn compare_attn(
    src: &MemTensors,
    cfg: &DitConfig,
    caps: &[usize],
    (h, w): (usize, usize),
    seed: u64,
    precision: DitPrecision,
    attn: Fp8Attention,
    tol: f32,
) -> usize {
    let Some(gpu) = device() else { return 0 };
    let dit = ZImageDit::load(&Loader::new(src, "dit."), cfg.clone()).unwrap();
    let (cap_feats, lat) = random_inputs(cfg, caps, h, w, seed);
    let t = 0.37;
    let resident = load_device_dit(&gpu, &dit, precision, attn);
    let mut den = Denoiser::with_resident(&dit, &gpu, resident, precision, cap_feats.clone(), h, w);
    assert!(
        den.on_device(),
        "the device refused the DiT (CMF_LOG=debug says why)"
    );
    let conds: Vec<_> = cap_feats
        .iter()
        .map(|(c, l)| dit.condition(c, *l))
        .collect();
    let mut subsets: Vec<Vec<usize>> = vec![(0..caps.len()).collect()];
    if caps.len() > 1 {
        subsets.push(vec![caps.len() - 1]);
    }
    for items in subsets {
        let got = den.velocity(&lat, t, &items);
        assert!(den.on_device(), "a step fell back to the CPU");
        let batch: Vec<DitItem> = items
            .iter()
            .map(|&i| DitItem {
                latents: &lat,
                cond: &conds[i],
                t,
            })
            .collect();
        let want = dit.velocity(&batch, h, w);
        for (k, (g, wv)) in got.iter().zip(&want).enumerate() {
            let err = rel_err(g, wv);
            eprintln!("caps {caps:?} latent {h}x{w} items {items:?} [{k}]: rel err {err:.2e}");
            assert!(err < tol, "item {k}: rel err {err} ≥ {tol}");
        }
    }
    den.gemm8_planes()
}

#[test]
fn fixture_step_matches_cpu_f32_weights() {
    let _env = serial();
    let (src, cfg) = fixture_dit(None);
    compare(&src, &cfg, &[7], 4, 4, 1);
    compare(&src, &cfg, &[40], 16, 12, 2);
}

#[test]
fn fixture_step_matches_cpu_q8_2f_and_bf16_weights() {
    let _env = serial();
    for codec in [Dtype::Q8_2f, Dtype::Bf16, Dtype::Q4Block] {
        eprintln!("codec {codec}");
        let (src, cfg) = fixture_dit(Some(codec));
        compare(&src, &cfg, &[19], 8, 8, 3);
    }
}

/// Head dim 128 takes the device's default attention kernel (attn_full_ws on Hopper; each
/// kernel is held to an f64 reference on its own in cmf-gpu's tests/cuda.rs).
#[test]
fn head_dim_128_batch_of_two_matches_cpu() {
    let _env = serial();
    let (src, cfg) = random_dit_hd128();
    // 256 image tokens (Np 256) + captions of 77 and 5 tokens (Lp 96 and 32).
    compare(&src, &cfg, &[77, 5], 32, 32, 4);
    compare(&src, &cfg, &[33], 20, 28, 5);
}

/// The FP8 attention at every length (`Fp8Attention::Always`). With bf16 GEMMs: a step of the random head-dim-128
/// DiT, batch of two (per-item V scales) and one, against the CPU within 4e-2 (measured on the
/// H200: 1.3–1.9e-2, bf16 attention 0.5e-2): Q, K, V and the probabilities in e4m3 (3 mantissa
/// bits, ~2.5 % RMS each) in every block's attention, chained through 4 blocks. With FP8 GEMMs
/// (`--dit-precision fp8`), where the attention writes the O projection's e4m3 input itself: within
/// the FP8 path's 1.5e-1 (see `fp8_path_stays_close_to_bf16`). Sanity bounds; the quality
/// criterion is the image PSNR of the FP8 path.
#[test]
fn fp8_attention_step_stays_close_to_cpu() {
    let _env = serial();
    if device().is_none() {
        return;
    }
    let (src, cfg) = random_dit_hd128();
    let (bf16, always) = (DitPrecision::Bf16, Fp8Attention::Always);
    compare_attn(&src, &cfg, &[77, 5], (32, 32), 4, bf16, always, 4e-2);
    compare_attn(&src, &cfg, &[33], (20, 28), 5, bf16, always, 4e-2);
    let fp8 = DitPrecision::Fp8;
    let planes = compare_attn(&src, &cfg, &[77, 5], (32, 32), 4, fp8, always, 1.5e-1);
    assert_eq!(planes, 4 * 4, "FP8 planes of the random DiT");
}

/// The device's velocities for `caps` (lengths), every item in one batch, as `compare` sets
/// them up, the attention in FP8 where `attn` says (None without a device).
fn device_velocity(
    src: &MemTensors,
    cfg: &DitConfig,
    caps: &[usize],
    (h, w): (usize, usize),
    attn: Fp8Attention,
    seed: u64,
) -> Option<Vec<Vec<f32>>> {
    let gpu = device()?;
    let dit = ZImageDit::load(&Loader::new(src, "dit."), cfg.clone()).unwrap();
    let (cap_feats, lat) = random_inputs(cfg, caps, h, w, seed);
    let bf16 = DitPrecision::Bf16;
    let resident = load_device_dit(&gpu, &dit, bf16, attn);
    let mut den = Denoiser::with_resident(&dit, &gpu, resident, bf16, cap_feats, h, w);
    let items: Vec<usize> = (0..caps.len()).collect();
    let v = den.velocity(&lat, 0.37, &items);
    assert!(den.on_device(), "the step fell back to the CPU");
    Some(v)
}

/// A step of attn_full_ws (and attn_full_ws8, the FP8 attention: `Fp8Attention::Always`) repeats bit
/// for bit: the tail split's halves (every tile is split at this size) fold in a fixed order
/// whichever finishes first.
#[test]
fn steps_repeat_bitwise() {
    let _env = serial();
    let (src, cfg) = random_dit_hd128();
    let cases = [(&[77usize, 5][..], 32, 32), (&[33][..], 20, 28)];
    for attn8 in [false, true] {
        let attn = if attn8 {
            Fp8Attention::Always
        } else {
            Fp8Attention::Never
        };
        for &(caps, h, w) in &cases {
            let Some(a) = device_velocity(&src, &cfg, caps, (h, w), attn, 4) else {
                return;
            };
            let again = device_velocity(&src, &cfg, caps, (h, w), attn, 4).unwrap();
            let bits =
                |v: &[Vec<f32>]| -> Vec<u32> { v.iter().flatten().map(|x| x.to_bits()).collect() };
            let what = format!("FP8 attention {attn8}, caps {caps:?}");
            assert!(
                bits(&a) == bits(&again),
                "{what}: two runs of one step differ"
            );
            eprintln!("{what}: {} values, bit-identical", bits(&a).len());
        }
    }
}

/// A refusal after the first device step: that step's output buffer is untouched, the CPU
/// computes it (bit-identical to the CPU path) and the rest of the run stays on the CPU.
#[test]
fn forced_refusal_mid_run_continues_on_cpu_with_cpu_results() {
    let _env = serial();
    let Some(gpu) = device() else { return };
    let (src, cfg) = fixture_dit(Some(Dtype::Q8_2f));
    let dit = ZImageDit::load(&Loader::new(&src, "dit."), cfg.clone()).unwrap();
    let mut rng = Rng(11);
    let caps = vec![(rng.vec(9 * cfg.cap_feat_dim, 2.0), 9)];
    let lat = rng.vec(16 * 8 * 8, 1.0);
    let mut den = Denoiser::new(&dit, &gpu, caps.clone(), 8, 8);
    assert!(den.on_device());
    den.velocity(&lat, 0.2, &[0]);
    gpu.inject_refusal_after(0);
    let got = den.velocity(&lat, 0.6, &[0]);
    assert!(!den.on_device(), "the refusal did not switch to the CPU");
    let cond = dit.condition(&caps[0].0, 9);
    let want = dit.velocity(
        &[DitItem {
            latents: &lat,
            cond: &cond,
            t: 0.6,
        }],
        8,
        8,
    );
    assert_eq!(got, want, "the fallback step differs from the CPU path");
}

/// A refusal at load: the whole image is the CPU's, bit for bit.
#[test]
fn refusal_at_load_gives_the_cpu_image() {
    let _env = serial();
    let Some(gpu) = device() else { return };
    let pack = ZimagePack::open(q8_pack()).unwrap();
    let plan = turbo_plan(&pack);
    gpu.inject_refusal_after(0);
    let dev = generate(&pack, &plan, &gpu, &mut |_| {}).unwrap();
    let cpu = generate(&pack, &plan, &Gpu::cpu_only(), &mut |_| {}).unwrap();
    assert!(!dev.timings.dit_on_device && !dev.timings.te_on_device && !dev.timings.vae_on_device);
    assert_eq!(dev.rgb, cpu.rgb);
}

fn q8_pack() -> &'static std::path::PathBuf {
    static PACK: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    PACK.get_or_init(|| {
        let dir = scratch_dir("gpu_dit");
        convert_tiny(&dir, "tiny-q8.cmf", Codec::Quant(Dtype::Q8_2f), Codec::F32)
    })
}

fn turbo_plan(pack: &ZimagePack) -> Plan {
    let req = Request {
        prompt: "a red fox in the snow".into(),
        width: Some(64),
        height: Some(48),
        steps: Some(4),
        seed: 5,
        ..Default::default()
    };
    Plan::new(&req, &pack.recipe).unwrap()
}

/// The whole pipeline with the DiT on the device against the CPU pipeline: the image
/// criterion (within 2/255 on ≥ 99 % of the values), Turbo and CFG recipes.
#[test]
fn pipeline_image_matches_cpu() {
    let _env = serial();
    let Some(gpu) = device() else { return };
    let pack = ZimagePack::open(q8_pack()).unwrap();
    for guidance in [0.0, 3.0] {
        let mut plan = turbo_plan(&pack);
        plan.guidance = guidance;
        let dev = generate(&pack, &plan, &gpu, &mut |_| {}).unwrap();
        let cpu = generate(&pack, &plan, &Gpu::cpu_only(), &mut |_| {}).unwrap();
        assert!(
            dev.timings.dit_on_device,
            "guidance {guidance}: the DiT ran on the CPU"
        );
        let off = dev
            .rgb
            .iter()
            .zip(&cpu.rgb)
            .filter(|(a, b)| a.abs_diff(**b) > 2)
            .count();
        let max = dev
            .rgb
            .iter()
            .zip(&cpu.rgb)
            .map(|(a, b)| a.abs_diff(*b))
            .max()
            .unwrap();
        let lat_err = rel_err(&dev.final_latents, &cpu.final_latents);
        eprintln!(
            "guidance {guidance}: {off}/{} values off by > 2/255 (max {max}), final latents rel err {lat_err:.2e}",
            cpu.rgb.len()
        );
        assert!(
            (off as f64) <= 0.01 * cpu.rgb.len() as f64,
            "guidance {guidance}: {off} values off"
        );
    }
}

/// The 8-bit paths (`DitPrecision`: e4m3 GEMMs with per-row scales, with and without fast
/// accumulation, and s8 GEMMs with per-row scales): a step against the CPU within 1.5e-1 for
/// e4m3 (3 mantissa bits: ~2.5 % RMS per quantised operand, through every chained projection; a
/// sanity bound, not the quality criterion) and 5e-2 for s8 (a step of amax/127: ~0.5–1 % RMS per
/// operand), and whole images against the bf16 device path at the quality bar, PSNR ≥ 35
/// dB. A change of precision uploads the DiT again, and each check asserts how many block GEMMs really ran in 8 bits: every plane of the random model
/// (dim 256, FFN 512: 4 blocks × 4), only q|k|v (384 × 128) and O (128 × 128) of the tiny pack,
/// whose FFN of 341 cuBLASLt's 8-bit GEMMs cannot take (w1|w3 682 × 128 and w2 128 × 341 stay
/// bf16).
#[test]
fn gemm8_paths_stay_close_to_bf16() {
    let _env = serial();
    let Some(gpu) = device() else { return };
    let pack = ZimagePack::open(q8_pack()).unwrap();
    let plan = turbo_plan(&pack);
    // One set of resident models through every run: a change of precision must upload the
    // DiT again (the runs below assert the FP8 planes that ran).
    let mut resident = Resident::default();
    let bf16 = generate_with(&pack, &plan, &gpu, &mut resident, &mut |_| {}).unwrap();
    assert!(bf16.timings.dit_on_device, "bf16: the DiT ran on the CPU");
    assert_eq!(bf16.timings.dit_gemm8_planes, 0, "bf16: 8-bit planes");
    // The tiny pack: 1 noise-refiner, 1 context-refiner and 2 main blocks.
    let tiny_8bit_planes = 4 * 2;
    for (precision, tol) in [
        (DitPrecision::Fp8, 1.5e-1),
        (DitPrecision::Fp8Fast, 1.5e-1),
        (DitPrecision::Int8, 5e-2),
    ] {
        {
            let (src, cfg) = random_dit_hd128();
            let planes = compare_within(&src, &cfg, &[77, 5], (32, 32), 4, precision, tol);
            let mode = precision.name();
            assert_eq!(planes, 4 * 4, "{mode}: 8-bit planes of the random DiT");
        }
        let mut p8 = plan.clone();
        p8.dit_precision = precision;
        let fp8 = generate_with(&pack, &p8, &gpu, &mut resident, &mut |_| {}).unwrap();
        let mode = precision.name();
        assert!(fp8.timings.dit_on_device, "{mode}: the DiT ran on the CPU");
        assert_eq!(
            fp8.timings.dit_gemm8_planes, tiny_8bit_planes,
            "{mode}: 8-bit planes of the tiny pack"
        );
        let mse = fp8
            .rgb
            .iter()
            .zip(&bf16.rgb)
            .map(|(a, b)| (*a as f64 - *b as f64).powi(2))
            .sum::<f64>()
            / bf16.rgb.len() as f64;
        let psnr = 10.0 * (255f64 * 255.0 / mse.max(1e-12)).log10();
        eprintln!("{mode}: image PSNR against the bf16 device path {psnr:.1} dB");
        assert!(psnr >= 35.0, "{mode}: PSNR {psnr:.1} dB < 35");
    }
}

/// Each weight resident once: on an 8-bit path a block plane that runs in 8 bits is held as its
/// 8-bit rows and row scales only, the bf16 plane it was made from freed at load. The DiT's own
/// count of the buffers it holds, and the device's count of live allocations across the load,
/// both drop by what the bf16 planes took less what the 8-bit ones take.
#[test]
fn eight_bit_planes_replace_the_bf16_ones() {
    let _env = serial();
    let Some(gpu) = device() else { return };
    let (src, cfg) = random_dit_hd128();
    let dit = ZImageDit::load(&Loader::new(&src, "dit."), cfg).unwrap();
    // random_dit_hd128: D = 256, F = 512; 1 noise-refiner, 1 context-refiner and 2 main blocks.
    let (d, f, blocks) = (256usize, 512usize, 4usize);
    let shapes = [(3 * d, d), (d, d), (2 * f, d), (d, f)];
    let bf16_planes: usize = shapes.iter().map(|(n, k)| 2 * n * k).sum();
    let q8_planes: usize = shapes.iter().map(|(n, k)| n * k + 4 * n).sum();
    let saved = (blocks * (bf16_planes - q8_planes)) as i64;
    // (weight bytes the DiT counts, live device bytes the load added, 8-bit planes)
    let load = |precision: DitPrecision| {
        let mode = precision.name();
        let before = gpu.bytes_resident() as i64;
        let dev = gpu
            .load_dit(&dit.device_model(precision))
            .unwrap_or_else(|r| panic!("{mode}: the device refused the DiT: {r}"));
        let added = gpu.bytes_resident() as i64 - before;
        (dev.weight_bytes() as i64, added, dev.gemm8_planes())
    };
    let (w_bf16, added_bf16, planes_bf16) = load(DitPrecision::Bf16);
    assert_eq!(planes_bf16, 0, "bf16: 8-bit planes");
    assert!(w_bf16 > 0, "bf16: the DiT counts no weight bytes");
    for precision in [DitPrecision::Fp8, DitPrecision::Int8] {
        let mode = precision.name();
        let (w8, added8, planes8) = load(precision);
        assert_eq!(planes8, blocks * 4, "{mode}: 8-bit planes");
        assert_eq!(
            w_bf16 - w8,
            saved,
            "{mode}: weight bytes {w8} against {w_bf16} in bf16"
        );
        // The load also allocates the 8-bit GEMM's own state (cuBLASLt's workspace) beside
        // the weights; whatever else it added is the same in both precisions.
        let extra8 = added8 - w8;
        let extra_bf16 = added_bf16 - w_bf16;
        eprintln!(
            "{mode}: weights {w8} B (bf16 {w_bf16} B), the load's other buffers {extra8} B (bf16 {extra_bf16} B)"
        );
        assert!(
            extra8 >= extra_bf16 && extra8 - extra_bf16 <= 64 << 20,
            "{mode}: the load holds {extra8} B beside its weights, {extra_bf16} B in bf16"
        );
    }
}
