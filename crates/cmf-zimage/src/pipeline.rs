//! The whole text-to-image run over one pack (`ZImagePipeline.__call__`, diffusers 0.42.1):
//! prompt(s) → text encoder → caption conditioning → `steps` Euler steps of the DiT (with CFG when
//! guidance > 0) → VAE decode → RGB. Stages run one after the other and each releases its weights'
//! pages before the next starts, so the resident set holds one model part at a time.
//!
//! CFG (`guidance > 0`, as diffusers decides): the positive and negative items go through the DiT
//! as one batch of two (one pass over the weights), and `pred = pos + g·(pos − neg)`, optionally
//! renormalised (`cfg_normalization`) and switched off late in the schedule (`cfg_truncation`).

use crate::denoiser::Denoiser;
use crate::noise;
use crate::scheduler::Schedule;
use crate::tensors::{Loader, TensorSource};
use crate::text_encoder::{parse_tokenizer, PromptTokens, TextEncoder};
use crate::transformer::{patchify, unpatchify, DitConfig, ZImageDit};
use crate::vae::{checked_rgb8, Tensor3, VaeConfig, VaeDecoder};
use crate::ZimageError;
use cmf_format::CmfModel;
use cmf_gpu::dit::DitPrecision;
use cmf_gpu::{Gpu, GpuDit, GpuVae};
use cmf_llm::gpu::GpuEncoder;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// `header.arch.arch_name` of a Z-Image pack.
pub const ARCH_NAME: &str = "z_image";
/// The JSON blobs every pack carries.
const BLOBS: [&str; 4] = [
    "dit.config_json",
    "te.config_json",
    "vae.config_json",
    "zimage.config_json",
];

/// The per-model defaults stored in `zimage.config_json`; a missing key takes the Turbo value.
#[derive(Clone, Debug, PartialEq)]
pub struct Recipe {
    pub variant: String,
    pub steps: usize,
    pub guidance: f32,
    pub shift: f32,
    pub height: usize,
    pub width: usize,
    pub cfg_normalization: f32,
    pub cfg_truncation: f32,
    pub negative_prompt: String,
    pub max_sequence_length: usize,
}

impl Default for Recipe {
    fn default() -> Self {
        Recipe {
            variant: "turbo".into(),
            steps: 8,
            guidance: 0.0,
            shift: 3.0,
            height: 1024,
            width: 1024,
            cfg_normalization: 0.0,
            cfg_truncation: 1.0,
            negative_prompt: String::new(),
            max_sequence_length: 512,
        }
    }
}

impl Recipe {
    pub fn from_json(v: &serde_json::Value) -> Recipe {
        let d = Recipe::default();
        let f = |k: &str, dv: f32| v[k].as_f64().map(|x| x as f32).unwrap_or(dv);
        let u = |k: &str, dv: usize| v[k].as_u64().map(|x| x as usize).unwrap_or(dv);
        Recipe {
            variant: v["variant"].as_str().unwrap_or(&d.variant).to_string(),
            steps: u("steps", d.steps),
            guidance: f("guidance", d.guidance),
            shift: f("shift", d.shift),
            height: u("height", d.height),
            width: u("width", d.width),
            // diffusers accepts a bool here (True = 1.0)
            cfg_normalization: match &v["cfg_normalization"] {
                serde_json::Value::Bool(b) => *b as u8 as f32,
                x => x.as_f64().map(|x| x as f32).unwrap_or(d.cfg_normalization),
            },
            cfg_truncation: f("cfg_truncation", d.cfg_truncation),
            negative_prompt: v["negative_prompt"].as_str().unwrap_or("").to_string(),
            max_sequence_length: u("max_sequence_length", d.max_sequence_length),
        }
    }
}

/// An opened Z-Image pack.
pub struct ZimagePack {
    pub model: CmfModel,
    pub recipe: Recipe,
    /// Parsed once per pack (repeated runs reuse it).
    tokenizer: std::sync::OnceLock<std::sync::Arc<tokenizers::Tokenizer>>,
}

impl ZimagePack {
    pub fn open(path: &Path) -> Result<ZimagePack, ZimageError> {
        let model = CmfModel::open(path).map_err(|e| ZimageError::NotZimage {
            origin: path.display().to_string(),
            why: format!("cannot open as CMF: {e}"),
        })?;
        Self::from_model(model)
    }

    pub fn from_model(model: CmfModel) -> Result<ZimagePack, ZimageError> {
        let origin = model.path().display().to_string();
        let arch = &model.header().arch.arch_name;
        if arch != ARCH_NAME {
            return Err(ZimageError::NotZimage {
                origin,
                why: format!("arch_name is `{arch}`, expected `{ARCH_NAME}`"),
            });
        }
        if let Some(missing) = BLOBS.iter().find(|b| model.tensor(b).is_none()) {
            return Err(ZimageError::NotZimage {
                origin,
                why: format!("the `{missing}` blob is missing"),
            });
        }
        if model.vocab().is_none() {
            return Err(ZimageError::NotZimage {
                origin,
                why: "no tokenizer in the vocab section".into(),
            });
        }
        let recipe = Recipe::from_json(&Loader::new(&model, "").json("zimage.config_json")?);
        Ok(ZimagePack {
            model,
            recipe,
            tokenizer: std::sync::OnceLock::new(),
        })
    }

    fn loader<'a>(&'a self, prefix: &'a str) -> Loader<'a> {
        Loader::new(&self.model, prefix)
    }

    pub fn text_encoder(&self) -> Result<TextEncoder<'_>, ZimageError> {
        let cfg = self.loader("").json("te.config_json")?;
        let template = self
            .model
            .header()
            .tokenizer_config
            .as_ref()
            .and_then(|t| t.chat_template.clone());
        TextEncoder::load(
            &self.model,
            &cfg,
            self.model.vocab().unwrap_or_default(),
            template,
            self.tokenizer.get().cloned(),
        )
    }

    pub fn dit(&self) -> Result<ZImageDit<'_>, ZimageError> {
        let cfg = DitConfig::from_json(
            &self.loader("").json("dit.config_json")?,
            &self.model.origin(),
        )?;
        ZImageDit::load(&self.loader("dit."), cfg)
    }

    pub fn vae(&self) -> Result<VaeDecoder<'_>, ZimageError> {
        let cfg = VaeConfig::from_json(
            &self.loader("").json("vae.config_json")?,
            &self.model.origin(),
        )?;
        VaeDecoder::load(&self.loader("vae."), cfg)
    }
}

/// What to generate. `None` fields take the pack's recipe.
#[derive(Clone, Debug, Default)]
pub struct Request {
    pub prompt: String,
    pub negative_prompt: Option<String>,
    pub width: Option<usize>,
    pub height: Option<usize>,
    pub steps: Option<usize>,
    pub guidance: Option<f32>,
    pub seed: u64,
    /// Initial latents file (`.npy`, `.safetensors` or raw f32); replaces the seeded noise.
    pub latents: Option<PathBuf>,
    /// What the device DiT's block GEMMs run in (the CPU path ignores it).
    pub dit_precision: DitPrecision,
}

/// The request with every default resolved and checked.
#[derive(Clone, Debug)]
pub struct Plan {
    pub prompt: String,
    pub negative_prompt: String,
    pub width: usize,
    pub height: usize,
    pub steps: usize,
    pub guidance: f32,
    pub shift: f32,
    pub cfg_normalization: f32,
    pub cfg_truncation: f32,
    pub max_tokens: usize,
    pub seed: u64,
    pub latents: Option<PathBuf>,
    pub dit_precision: DitPrecision,
}

impl Plan {
    pub fn new(req: &Request, recipe: &Recipe) -> Result<Plan, ZimageError> {
        let width = req.width.unwrap_or(recipe.width);
        let height = req.height.unwrap_or(recipe.height);
        for (flag, v) in [("--width", width), ("--height", height)] {
            if v == 0 || v % 16 != 0 {
                return Err(ZimageError::request(
                    flag,
                    format!("{v} is not a positive multiple of 16"),
                ));
            }
            if v > 4096 {
                return Err(ZimageError::request(flag, format!("{v} is above 4096")));
            }
        }
        let steps = req.steps.unwrap_or(recipe.steps);
        if steps == 0 || steps > 1000 {
            return Err(ZimageError::request(
                "--steps",
                format!("{steps} is not in 1..=1000"),
            ));
        }
        let guidance = req.guidance.unwrap_or(recipe.guidance);
        if !(guidance.is_finite() && guidance >= 0.0) {
            return Err(ZimageError::request(
                "--guidance",
                format!("{guidance} must be ≥ 0 (0 turns CFG off)"),
            ));
        }
        Ok(Plan {
            prompt: req.prompt.clone(),
            negative_prompt: req
                .negative_prompt
                .clone()
                .unwrap_or_else(|| recipe.negative_prompt.clone()),
            width,
            height,
            steps,
            guidance,
            shift: recipe.shift,
            cfg_normalization: recipe.cfg_normalization,
            cfg_truncation: recipe.cfg_truncation,
            max_tokens: recipe.max_sequence_length.max(1),
            seed: req.seed,
            latents: req.latents.clone(),
            dit_precision: req.dit_precision,
        })
    }

    /// diffusers runs CFG whenever guidance > 0.
    pub fn cfg(&self) -> bool {
        self.guidance > 0.0
    }

    /// Latent grid `[16, H/8, W/8]`.
    pub fn latent_hw(&self) -> (usize, usize) {
        (self.height / 8, self.width / 8)
    }
}

/// Progress reports while generating.
#[derive(Clone, Debug)]
pub enum Event {
    /// The prompt(s) are tokenized; `negative` is set under CFG.
    Tokenized {
        positive: PromptTokens,
        negative: Option<PromptTokens>,
        max_tokens: usize,
    },
    TextEncoded {
        secs: f64,
    },
    /// Step `i` (1-based) of `n` finished in `secs`.
    Step {
        i: usize,
        n: usize,
        secs: f64,
        cfg: bool,
    },
    Decoded {
        secs: f64,
    },
}

/// Seconds per stage: wall clock, and the process's CPU time (user + system, all threads), which
/// on a shared machine says how much work a stage was when the wall clock includes waiting.
#[derive(Clone, Debug, Default)]
pub struct Timings {
    pub text_encoder: f64,
    pub text_encoder_cpu: f64,
    /// Whether the text encoder ran on the device.
    pub te_on_device: bool,
    pub dit_load: f64,
    /// Whether every step ran on the device.
    pub dit_on_device: bool,
    /// Block GEMM planes the device DiT ran on 8-bit operands to the last step
    /// (`Plan::dit_precision`: FP8 or int8; 0: bf16 or the CPU).
    pub dit_gemm8_planes: usize,
    pub steps: Vec<f64>,
    pub steps_cpu: Vec<f64>,
    pub vae: f64,
    pub vae_cpu: f64,
    /// Whether the VAE decoded on the device.
    pub vae_on_device: bool,
    pub total: f64,
}

/// CPU seconds used by this process so far (user + system, every thread).
pub fn cpu_seconds() -> f64 {
    // SAFETY: getrusage only writes the struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return 0.0;
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

pub struct Generated {
    /// Interleaved RGB, `height × width × 3`.
    pub rgb: Vec<u8>,
    pub width: usize,
    pub height: usize,
    /// The latents after the last step, `[16, H/8, W/8]`.
    pub final_latents: Vec<f32>,
    pub timings: Timings,
}

/// Models kept resident on the device between runs over the same pack (`cmf imagine
/// --repeat`): the second image skips every upload.
#[derive(Default)]
pub struct Resident {
    te: Option<GpuEncoder>,
    dit: Option<GpuDit>,
    vae: Option<GpuVae>,
}

/// Runs `plan` on `pack`; stages run on `gpu`'s device where it takes them (else the CPU).
pub fn generate(
    pack: &ZimagePack,
    plan: &Plan,
    gpu: &Gpu,
    events: &mut dyn FnMut(Event),
) -> Result<Generated, ZimageError> {
    generate_with(pack, plan, gpu, &mut Resident::default(), events)
}

/// [`generate`], keeping the device models in `resident` for the next call on the same pack.
pub fn generate_with(
    pack: &ZimagePack,
    plan: &Plan,
    gpu: &Gpu,
    resident: &mut Resident,
    events: &mut dyn FnMut(Event),
) -> Result<Generated, ZimageError> {
    let t_all = Instant::now();
    let mut tm = Timings::default();
    let (lh, lw) = plan.latent_hw();

    // ── initial latents: checked first, a bad file fails before minutes of work ──
    let n_lat = 16 * lh * lw;
    let lat = match &plan.latents {
        Some(p) => noise::read_latents(p, n_lat)?,
        None => noise::gaussian(n_lat, plan.seed),
    };

    // ── text encoder, with the DiT and VAE loading beside it (preload) ──
    // The uploads run on other threads while the encoder runs here; all share the device's
    // stream, so their work interleaves in order. A cpu_scope on this thread means no device.
    let t0 = Instant::now();
    let c0 = cpu_seconds();
    // A DiT resident at another precision is uploaded again.
    if resident
        .dit
        .as_ref()
        .is_some_and(|d| d.precision() != plan.dit_precision)
    {
        resident.dit = None;
    }
    let on_gpu = gpu.is_active() && !cmf_gpu::facade::in_cpu_scope();
    let preload_dit = on_gpu && resident.dit.is_none();
    // The VAE too (its kernels, cuDNN handle, weights and first decode's set-up: ~0.4 s of a
    // first run that would otherwise wait between the last step and the decode).
    let preload_vae = on_gpu && resident.vae.is_none();
    let (cap, ncap, (preloaded_view, preloaded_vae)) =
        std::thread::scope(|s| -> Result<_, ZimageError> {
            // Two loader threads beside the encoder (and, on a first run, the tokenizer's parse
            // below): the DiT's upload is the long one; the VAE's load and first-use set-up
            // (cuDNN plans, a warm-up decode) run beside it. A failure here is not an error: the
            // stage loads (or refuses) again when it runs.
            let dit_thread = preload_dit.then(|| {
                s.spawn(|| {
                    // The model view goes back too: the DiT stage need not build it again.
                    let m = pack.dit().ok()?;
                    let d = gpu
                        .load_dit(&m.device_model(plan.dit_precision))
                        .ok()
                        .map(|mut d| {
                            Denoiser::warm_up(&mut d, &m);
                            d
                        });
                    log_stage("preload: DiT done");
                    Some((m, d))
                })
            });
            let vae_thread = preload_vae.then(|| {
                s.spawn(|| {
                    let mut v = gpu.load_vae(&pack.vae().ok()?.gpu_model()).ok()?;
                    let _ = v.prepare(lh, lw);
                    log_stage("preload: VAE done");
                    Some(v)
                })
            });
            let te = pack.text_encoder()?;
            // A first run's tokenizer parses (~0.5 s) on its own thread while the encoder's
            // layers upload here.
            let parsing = (!te.has_tokenizer()).then(|| {
                let (vocab, origin) = (te.vocab(), pack.model.origin());
                s.spawn(move || parse_tokenizer(vocab, &origin).map(Arc::new))
            });
            let mut dev = match resident.te.take() {
                Some(d) => Some(d),
                None => te.on_device(gpu, plan.max_tokens),
            };
            if let Some(h) = parsing {
                // A panicked parse leaves the tokenizer to parse on first use.
                if let Ok(parsed) = h.join() {
                    let t = parsed?;
                    te.set_tokenizer(t.clone());
                    let _ = pack.tokenizer.set(t);
                }
                log_stage("text encoder: tokenizer parsed");
            }
            let pos = te.tokenize(&plan.prompt, plan.max_tokens)?;
            let neg = if plan.cfg() {
                Some(te.tokenize(&plan.negative_prompt, plan.max_tokens)?)
            } else {
                None
            };
            log_stage("text encoder: tokenized");
            events(Event::Tokenized {
                positive: pos.clone(),
                negative: neg.clone(),
                max_tokens: plan.max_tokens,
            });
            let (feats, on_dev) = te.encode_with(&mut dev, &pos.ids)?;
            tm.te_on_device = on_dev;
            let cap = (feats, pos.ids.len());
            let ncap = match &neg {
                Some(n) => {
                    let (feats, on_dev) = te.encode_with(&mut dev, &n.ids)?;
                    tm.te_on_device &= on_dev;
                    Some((feats, n.ids.len()))
                }
                None => None,
            };
            resident.te = dev;
            log_stage("text encoder: features ready");
            // Its pages go while the preload finishes (the device holds its layers now).
            release(pack, "te.");
            log_stage("text encoder: pages released");
            let dit = dit_thread.and_then(|h| h.join().ok()).flatten();
            let vae = vae_thread.and_then(|h| h.join().ok()).flatten();
            Ok((cap, ncap, (dit, vae)))
        })?;
    let (preloaded_view, preloaded) = match preloaded_view {
        Some((view, dev)) => (Some(view), dev),
        None => (None, None),
    };
    if preloaded.is_some() {
        resident.dit = preloaded;
    }
    if preloaded_vae.is_some() {
        resident.vae = preloaded_vae;
    }
    tm.text_encoder = t0.elapsed().as_secs_f64();
    tm.text_encoder_cpu = cpu_seconds() - c0;
    events(Event::TextEncoded {
        secs: tm.text_encoder,
    });

    // ── DiT ──
    let t0 = Instant::now();
    let dit = match preloaded_view {
        Some(view) => view,
        None => pack.dit()?,
    };
    log_stage("dit: model view ready");
    if cap.0.len() != cap.1 * dit.cfg.cap_feat_dim {
        return Err(ZimageError::Tensor {
            origin: pack.model.origin(),
            name: "dit.cap_embedder.0.weight".into(),
            why: format!(
                "the text encoder's width does not match cap_feat_dim {}",
                dit.cfg.cap_feat_dim
            ),
        });
    }
    for (len, flag) in [
        (Some(cap.1), "--prompt"),
        (ncap.as_ref().map(|c| c.1), "--negative-prompt"),
    ] {
        if let Some(len) = len {
            dit.check_geometry(lh, lw, len)
                .map_err(|why| ZimageError::request(flag, why))?;
        }
    }
    let n_caps = if ncap.is_some() { 2 } else { 1 };
    let mut caps = vec![cap];
    caps.extend(ncap);
    let mut denoiser = Denoiser::with_resident(
        &dit,
        gpu,
        resident.dit.take(),
        plan.dit_precision,
        caps,
        lh,
        lw,
    );
    tm.dit_on_device = denoiser.on_device();
    let sched = Schedule::new(plan.steps, plan.shift);
    denoiser.precompute_t_embeds(&sched.model_t[..plan.steps]);
    tm.dit_load = t0.elapsed().as_secs_f64();
    // The loop keeps the latents in token order (the DiT's): the Euler update and CFG are
    // elementwise, so only the first and last step change layouts.
    let c = dit.cfg.in_channels;
    let mut tok = patchify(&lat, c, lh, lw);
    for i in 0..plan.steps {
        let ts = Instant::now();
        let cs = cpu_seconds();
        let t = sched.model_t[i];
        // diffusers: CFG is off at steps whose t_norm = (1000 − t)/1000 exceeds cfg_truncation.
        let cfg_now = plan.cfg() && !(plan.cfg_truncation <= 1.0 && t > plan.cfg_truncation);
        let items: &[usize] = if cfg_now { &[0, 1] } else { &[0] };
        debug_assert!(items.len() <= n_caps);
        let mut outs = denoiser.velocity_tokens(&tok, t, items);
        tm.dit_on_device &= denoiser.on_device();
        let mut pred = outs.swap_remove(0);
        if cfg_now {
            cfg_combine(&mut pred, &outs[0], plan.guidance, plan.cfg_normalization);
        }
        sched.step(i, &mut tok, &pred);
        let secs = ts.elapsed().as_secs_f64();
        tm.steps.push(secs);
        tm.steps_cpu.push(cpu_seconds() - cs);
        events(Event::Step {
            i: i + 1,
            n: plan.steps,
            secs,
            cfg: cfg_now,
        });
    }
    let lat = unpatchify(&tok, c, lh, lw);
    tm.dit_gemm8_planes = denoiser.gemm8_planes();
    resident.dit = denoiser.into_device();
    drop(dit);
    release(pack, "dit.");
    if let Some(i) = lat.iter().position(|v| !v.is_finite()) {
        return Err(ZimageError::NonFinite {
            stage: "denoising".into(),
            why: format!("latent value {i}"),
        });
    }

    // ── VAE ──
    let t0 = Instant::now();
    let c0 = cpu_seconds();
    let vae = pack.vae()?;
    let t_load = t0.elapsed().as_secs_f64();
    let (rgb, on_device) = decode_image(&vae, gpu, &mut resident.vae, &lat, lh, lw)?;
    let t_decode = t0.elapsed().as_secs_f64() - t_load;
    tm.vae_on_device = on_device;
    drop(vae);
    release(pack, "vae.");
    tm.vae = t0.elapsed().as_secs_f64();
    if cmf_gpu::facade::log::debug_enabled() {
        cmf_gpu::facade::log::debug(&format!(
            "VAE stage: weights view {:.1} ms, decode {:.1} ms (device: {on_device}), release {:.1} ms",
            1e3 * t_load,
            1e3 * t_decode,
            1e3 * (tm.vae - t_load - t_decode)
        ));
    }
    tm.vae_cpu = cpu_seconds() - c0;
    events(Event::Decoded { secs: tm.vae });
    tm.total = t_all.elapsed().as_secs_f64();
    Ok(Generated {
        rgb,
        width: plan.width,
        height: plan.height,
        final_latents: lat,
        timings: tm,
    })
}

/// The VAE decode on the device when it takes the decoder, else (or on any refusal) the CPU.
/// Returns the RGB bytes and whether the device made them.
fn decode_image(
    vae: &VaeDecoder,
    gpu: &Gpu,
    resident: &mut Option<GpuVae>,
    lat: &[f32],
    lh: usize,
    lw: usize,
) -> Result<(Vec<u8>, bool), ZimageError> {
    if gpu.is_active() && resident.is_none() {
        *resident = gpu.load_vae(&vae.gpu_model()).ok();
    }
    if let Some(dev) = resident.as_mut() {
        let c = &vae.cfg;
        let s = c.scale_factor();
        let (h, w) = (lh * s, lw * s);
        let z = vae.decoder_input(lat);
        // The device's own 8-bit conversion first (a quarter of the readback, no host pass);
        // a backend without it decodes to f32 and the host converts.
        let mut rgb = vec![0u8; c.out_channels * h * w];
        match dev.decode_rgb8(&z, lh, lw, &mut rgb) {
            Ok(true) => return Ok((rgb, true)),
            Ok(false) => {
                return Err(ZimageError::NonFinite {
                    stage: "VAE decode (device)".into(),
                    why: "NaN or infinity in the image".into(),
                })
            }
            Err(_) => {}
        }
        let mut img = Tensor3 {
            c: c.out_channels,
            h,
            w,
            data: vec![0f32; c.out_channels * h * w],
        };
        if dev.decode(&z, lh, lw, &mut img.data).is_ok() {
            return Ok((checked_rgb8(&img, "VAE decode (device)")?, true));
        }
        *resident = None;
    }
    Ok((vae.decode_to_rgb(lat, lh, lw)?, false))
}

/// `pred = pos + g·(pos − neg)` in f32 (diffusers' order); with `norm_clip` c > 0 the whole tensor
/// is scaled down so that ‖pred‖ ≤ c·‖pos‖.
pub fn cfg_combine(pos: &mut [f32], neg: &[f32], g: f32, norm_clip: f32) {
    let norm = |v: &[f32]| {
        v.iter()
            .map(|&x| (x as f64) * (x as f64))
            .sum::<f64>()
            .sqrt()
    };
    let pos_norm = if norm_clip > 0.0 { norm(pos) } else { 0.0 };
    for (p, &n) in pos.iter_mut().zip(neg) {
        *p += g * (*p - n);
    }
    if norm_clip > 0.0 {
        let (new, max) = (norm(pos), pos_norm * norm_clip as f64);
        if new > max {
            let f = (max / new) as f32;
            pos.iter_mut().for_each(|p| *p *= f);
        }
    }
}

/// A timeline mark at debug verbosity (the log's clock runs from process start).
fn log_stage(what: &str) {
    cmf_gpu::facade::log::debug(what);
}

/// Drops the resident pages of the tensors under `prefix`: the next stage does not need them.
/// On a thread of its own: after a first run's uploads the DiT's release took 0.1–0.2 s between
/// the last step and the VAE decode (H200).
fn release(pack: &ZimagePack, prefix: &str) {
    pack.model.release_pages_in_background(prefix);
}

/// Writes RGB8 as a PNG: to a temp file beside `path` with a random name created exclusively
/// (two writers to one path never share it; a failed write removes it), then renamed into place.
pub fn write_png(path: &Path, rgb: &[u8], width: usize, height: usize) -> Result<(), ZimageError> {
    let err = |why: String| ZimageError::Output {
        path: path.to_path_buf(),
        why,
    };
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .ok_or_else(|| err("not a file path".into()))?;
    let prefix = format!(".{}.", name.to_string_lossy());
    let mut builder = tempfile::Builder::new();
    builder.prefix(&prefix).suffix(".tmp").rand_bytes(8);
    // The mode `File::create` gives (0666 less the umask), not tempfile's private 0600.
    #[cfg(unix)]
    builder.permissions(std::os::unix::fs::PermissionsExt::from_mode(0o666));
    let tmp = builder.tempfile_in(dir).map_err(|e| err(e.to_string()))?;
    let mut enc = png::Encoder::new(
        std::io::BufWriter::new(tmp.as_file()),
        width as u32,
        height as u32,
    );
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    let mut w = enc.write_header().map_err(|e| err(e.to_string()))?;
    w.write_image_data(rgb).map_err(|e| err(e.to_string()))?;
    w.finish().map_err(|e| err(e.to_string()))?;
    tmp.persist(path).map_err(|e| err(e.error.to_string()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::write_png;

    /// Writers racing to one path each finish with a whole PNG in place and leave no temp file;
    /// a write that cannot finish leaves nothing behind either.
    #[test]
    fn png_writes_are_exclusive_and_atomic() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("img.png");
        let (w, h) = (64, 48);
        std::thread::scope(|s| {
            for shade in 0..4u8 {
                let out = &out;
                s.spawn(move || write_png(out, &vec![shade * 60; w * h * 3], w, h).unwrap());
            }
        });
        let decoder =
            png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&out).unwrap()));
        let mut reader = decoder.read_info().unwrap();
        let mut buf = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut buf).unwrap();
        assert_eq!((info.width, info.height), (w as u32, h as u32));
        let first = buf[0];
        assert!(
            buf[..info.buffer_size()].iter().all(|&b| b == first),
            "pixels of two writers mixed"
        );
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            names,
            vec![std::ffi::OsString::from("img.png")],
            "temp files left: {names:?}"
        );
        // Too few pixels for the size: an error, no output, no temp file.
        let bad = dir.path().join("bad.png");
        assert!(write_png(&bad, &[0; 3], w, h).is_err());
        assert!(!bad.exists());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
