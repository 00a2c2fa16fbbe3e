//! `cmf convert --zimage DIR`: a diffusers Z-Image tree (`ZImagePipeline`) → one `.cmf`.
//!
//! The layout is the reference project's (`cortiq imagine-pack`, cortiq-cli 0.8.54
//! `src/zimagepack.rs`), so a pack from either tool runs in the other:
//! - `dit.<diffusers name>`: the block projections (`attention.to_{q,k,v,out.0}`,
//!   `feed_forward.w{1,2,3}`) and `cap_embedder.1.weight` in the DiT codec (default q8_2f);
//!   `adaLN_modulation.0.weight` 16-bit (a bf16/f16 source as is, an f32 source as f16 unless a
//!   value does not fit); everything else f32. `siglip*` (omni mode) is left out.
//! - `te.<name without model.>`: Qwen3 layers `0 .. n−2` only (`hidden_states[-2]` is the output
//!   of layer n−2; the last layer and the final norm are never run); `*_proj.weight` in the TE codec
//!   (default q8_2f) except `layers.6.mlp.down_proj`, kept at the source precision (the reference's
//!   measured outlier matrix); `embed_tokens` q8_row when the TE codec quantizes; norms f32.
//! - `vae.decoder.*`: the VAE decoder, f32 by default.
//! - u8 JSON blobs, first: `dit.config_json` (the transformer config), `te.config_json` (the
//!   encoder config with `num_hidden_layers` = layers stored and `final_norm: false`),
//!   `vae.config_json`, `zimage.config_json` (the recipe: variant, steps, guidance, shift, size,
//!   …), `zimage.scheduler_json` (the scheduler config).
//! - header `arch_name: "z_image"` with the text encoder's geometry; the tokenizer.json in the vocab
//!   section; the chat template (when `tokenizer_config.json` has one) in `tokenizer_config`.
//!
//! `--dit-quant f32` makes an exact pack (adaLN weights f32 too) for parity work.
//!
//! Streaming: the safetensors shards are read one tensor at a time (`pread`, no mapping), a small
//! window of tensors is encoded in parallel and written in order, so memory stays at a few
//! tensors whatever the model size.

use cmf_format::{Arch, CmfWriter, Dtype, Header, LayerType, QuantType, TokenizerConfig};
use rayon::prelude::*;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// The text-encoder projection the reference keeps at source precision by default (its measured
/// outlier carrier in Qwen3-4B).
pub const DEFAULT_TE_KEEP: &[&str] = &["layers.6.mlp.down_proj"];

#[derive(Debug, thiserror::Error)]
pub enum ZimagePackError {
    #[error("{path}: {why}")]
    Source { path: PathBuf, why: String },
    #[error("{path}: tensor `{name}`: {why}")]
    Tensor {
        path: PathBuf,
        name: String,
        why: String,
    },
    #[error("{flag}: {why}")]
    Option { flag: String, why: String },
    #[error("{path}: {why}")]
    Output { path: PathBuf, why: String },
}

type Result<T> = std::result::Result<T, ZimagePackError>;

/// Codec of a family of weights.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Codec {
    /// The source's own float type, bytes unchanged.
    Source,
    F32,
    F16,
    Bf16,
    /// A 2-D quantized codec (q8_2f, q8_row, q4_block, q4_tiled, q4tp).
    Quant(Dtype),
}

impl Codec {
    /// `q8` means q8_2f (the reference's spelling); `raw`/`source` keep the source type.
    pub fn parse(s: &str, flag: &str) -> Result<Codec> {
        let c = match s.to_ascii_lowercase().as_str() {
            "raw" | "source" => Codec::Source,
            "f32" | "fp32" => Codec::F32,
            "f16" | "fp16" => Codec::F16,
            "bf16" => Codec::Bf16,
            "q8" => Codec::Quant(Dtype::Q8_2f),
            other => match Dtype::from_name(other) {
                Some(d) if d.is_quantized() => Codec::Quant(d),
                _ => {
                    return Err(ZimagePackError::Option {
                        flag: flag.into(),
                        why: format!("unknown codec `{s}` (f32, f16, bf16, raw, q8_2f, q8_row, q4_block, q4_tiled, q4tp)"),
                    })
                }
            },
        };
        Ok(c)
    }

    pub fn name(self) -> String {
        match self {
            Codec::Source => "raw".into(),
            Codec::F32 => "f32".into(),
            Codec::F16 => "f16".into(),
            Codec::Bf16 => "bf16".into(),
            Codec::Quant(d) => d.name().into(),
        }
    }
}

#[derive(Clone, Debug)]
pub struct ZimageOptions {
    pub dit: Codec,
    pub te: Codec,
    pub vae: Codec,
    /// `te.embed_tokens` codec; default q8_row when `te` quantizes, else `te`.
    pub te_embed: Option<Codec>,
    /// TE projections kept at the source precision: `layers.N.<suffix>` or a bare suffix.
    pub te_keep: Vec<String>,
    /// "turbo" | "base"; default from the scheduler shift (≤ 3.5 → turbo).
    pub variant: Option<String>,
    /// Tensors encoded in parallel (the window size).
    pub threads: usize,
}

impl Default for ZimageOptions {
    fn default() -> Self {
        ZimageOptions {
            dit: Codec::Quant(Dtype::Q8_2f),
            te: Codec::Quant(Dtype::Q8_2f),
            vae: Codec::F32,
            te_embed: None,
            te_keep: DEFAULT_TE_KEEP.iter().map(|s| s.to_string()).collect(),
            variant: None,
            threads: rayon::current_num_threads().max(1),
        }
    }
}

/// What was written.
#[derive(Debug)]
pub struct ZimageReport {
    pub path: PathBuf,
    pub tensors: usize,
    pub bytes: u64,
    /// Stored bytes per codec.
    pub by_codec: BTreeMap<String, u64>,
    pub variant: String,
}

/// Progress of a conversion: tensors done and source bytes read so far, and the totals.
#[derive(Clone, Copy, Debug)]
pub struct PackProgress {
    pub tensors_done: usize,
    pub tensors_total: usize,
    pub bytes_done: u64,
    pub bytes_total: u64,
}

/// Is `root` a diffusers Z-Image tree?
pub fn is_zimage_root(root: &Path) -> bool {
    cmf_format::regular::read(root.join("model_index.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
        .is_some_and(|v| v["_class_name"] == "ZImagePipeline")
}

/// One tensor of a safetensors file.
#[derive(Clone, Debug)]
struct StTensor {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Absolute byte offset in the file.
    offset: u64,
    len: u64,
}

/// Parses a safetensors header (defensively: sizes, offsets, dtypes), tensors in file order.
fn read_st_header(path: &Path) -> Result<(File, Vec<StTensor>)> {
    let bad = |why: String| ZimagePackError::Source {
        path: path.to_path_buf(),
        why,
    };
    let f = cmf_format::regular::open(path).map_err(|e| bad(e.to_string()))?;
    let size = f.metadata().map_err(|e| bad(e.to_string()))?.len();
    let mut pre = [0u8; 8];
    f.read_exact_at(&mut pre, 0)
        .map_err(|e| bad(format!("reading the header length: {e}")))?;
    let hlen = u64::from_le_bytes(pre);
    if hlen == 0 || hlen > 100 << 20 || 8 + hlen > size {
        return Err(bad(format!(
            "header length {hlen} does not fit a {size}-byte safetensors file"
        )));
    }
    let mut raw = vec![0u8; hlen as usize];
    f.read_exact_at(&mut raw, 8)
        .map_err(|e| bad(e.to_string()))?;
    let json: BTreeMap<String, Value> = serde_json::from_slice(&raw)
        .map_err(|e| bad(format!("header is not a JSON object: {e}")))?;
    let base = 8 + hlen;
    let mut out = Vec::new();
    for (name, v) in json {
        if name == "__metadata__" {
            continue;
        }
        let tbad = |why: String| ZimagePackError::Tensor {
            path: path.to_path_buf(),
            name: name.clone(),
            why,
        };
        let dt = v["dtype"].as_str().ok_or_else(|| tbad("no dtype".into()))?;
        let (dtype, item) = match dt {
            "F32" => (Dtype::F32, 4),
            "F16" => (Dtype::F16, 2),
            "BF16" => (Dtype::Bf16, 2),
            // Integer metadata tensors (none in Z-Image) are listed so a plan can skip them.
            "I64" | "U64" => (Dtype::U8, 8),
            "I32" | "U32" => (Dtype::U8, 4),
            "I16" | "U16" => (Dtype::U8, 2),
            "I8" | "U8" | "BOOL" => (Dtype::U8, 1),
            other => return Err(tbad(format!("unsupported dtype {other}"))),
        };
        let shape: Vec<usize> = v["shape"]
            .as_array()
            .and_then(|a| a.iter().map(|x| x.as_u64().map(|x| x as usize)).collect())
            .ok_or_else(|| tbad("bad shape".into()))?;
        let offs: Vec<u64> = v["data_offsets"]
            .as_array()
            .and_then(|a| a.iter().map(|x| x.as_u64()).collect())
            .filter(|o: &Vec<u64>| o.len() == 2)
            .ok_or_else(|| tbad("bad data_offsets".into()))?;
        let (s, e) = (offs[0], offs[1]);
        let numel = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d as u64));
        if s > e || base + e > size || numel.and_then(|n| n.checked_mul(item)) != Some(e - s) {
            return Err(tbad(format!(
                "byte range {s}..{e} does not match {dt} {shape:?} in a {size}-byte file"
            )));
        }
        out.push(StTensor {
            name,
            dtype,
            shape,
            offset: base + s,
            len: e - s,
        });
    }
    out.sort_by_key(|t| t.offset);
    Ok((f, out))
}

/// The weight files of one component: the index's shards, or the single file.
fn component_files(dir: &Path, index: &str, single: &str) -> Result<Vec<PathBuf>> {
    let ip = dir.join(index);
    if ip.exists() {
        let bad = |why: String| ZimagePackError::Source {
            path: ip.clone(),
            why,
        };
        let v: Value = serde_json::from_slice(
            &cmf_format::regular::read(&ip).map_err(|e| bad(e.to_string()))?,
        )
        .map_err(|e| bad(e.to_string()))?;
        let mut files: Vec<String> = v["weight_map"]
            .as_object()
            .ok_or_else(|| bad("no weight_map".into()))?
            .values()
            .filter_map(|x| x.as_str().map(String::from))
            .collect();
        files.sort();
        files.dedup();
        for f in &files {
            if f.contains('/') || f.contains("..") {
                return Err(bad(format!("shard name `{f}` is not a plain file name")));
            }
        }
        Ok(files.into_iter().map(|f| dir.join(f)).collect())
    } else if dir.join(single).exists() {
        Ok(vec![dir.join(single)])
    } else {
        Err(ZimagePackError::Source {
            path: dir.to_path_buf(),
            why: format!("neither {index} nor {single}"),
        })
    }
}

fn read_json(path: &Path) -> Result<(Vec<u8>, Value)> {
    let bad = |why: String| ZimagePackError::Source {
        path: path.to_path_buf(),
        why,
    };
    let raw = cmf_format::regular::read(path).map_err(|e| bad(e.to_string()))?;
    let v = serde_json::from_slice(&raw).map_err(|e| bad(format!("invalid JSON: {e}")))?;
    Ok((raw, v))
}

/// How one output tensor's codec is chosen.
#[derive(Clone, Copy, Debug)]
enum Rule {
    Fixed(Codec),
    /// 16-bit unless the values do not fit f16 (adaLN weights, host precompute only).
    Keep16,
}

struct Item {
    out: String,
    file: usize,
    tensor: usize,
    rule: Rule,
}

/// The recipe stored in `zimage.config_json` (the reference's keys and values).
pub(crate) fn recipe(variant: &str, shift: f64) -> Value {
    let (steps, guidance) = if variant == "turbo" {
        (8, 0.0)
    } else {
        (28, 4.0)
    };
    json!({
        "variant": variant, "steps": steps, "guidance": guidance, "shift": shift,
        "height": 1024, "width": 1024, "cfg_normalization": 0.0, "cfg_truncation": 1.0,
        "negative_prompt": "", "max_sequence_length": 512,
        "template": "qwen3-chat-user-assistant (enable_thinking=True)", "vae_scale": 8
    })
}

/// Converts the tree at `root` into `output` (written to a temp file, renamed at the end).
pub fn convert_zimage(
    root: &Path,
    output: &Path,
    opts: &ZimageOptions,
    progress: &mut dyn FnMut(PackProgress),
) -> Result<ZimageReport> {
    if !is_zimage_root(root) {
        return Err(ZimagePackError::Source {
            path: root.join("model_index.json"),
            why: "not a diffusers ZImagePipeline tree (`_class_name` must be \"ZImagePipeline\")"
                .into(),
        });
    }
    if let Codec::Quant(d) = opts.vae {
        return Err(ZimagePackError::Option {
            flag: "--vae-quant".into(),
            why: format!(
                "{d} is a matrix codec; the VAE's conv kernels are stored as f32, f16 or bf16"
            ),
        });
    }
    let (_, dit_cfg) = read_json(&root.join("transformer/config.json"))?;
    if dit_cfg["_class_name"] != "ZImageTransformer2DModel" {
        return Err(ZimagePackError::Source {
            path: root.join("transformer/config.json"),
            why: "`_class_name` is not ZImageTransformer2DModel".into(),
        });
    }
    let (_, mut te_cfg) = read_json(&root.join("text_encoder/config.json"))?;
    let te_path = root.join("text_encoder/config.json");
    let te_src_layers = te_cfg["num_hidden_layers"]
        .as_u64()
        .filter(|&n| n >= 2)
        .ok_or_else(|| ZimagePackError::Source {
            path: te_path.clone(),
            why: "num_hidden_layers missing or < 2".into(),
        })? as usize;
    let te_keep_layers = te_src_layers - 1;
    te_cfg["num_hidden_layers"] = json!(te_keep_layers);
    te_cfg["final_norm"] = json!(false);
    te_cfg["cortiq_tap"] = json!("hidden_states[-2] of the source (no final norm)");
    if let Some(lt) = te_cfg.get_mut("layer_types").and_then(|v| v.as_array_mut()) {
        lt.truncate(te_keep_layers);
    }
    let (vae_raw, _) = read_json(&root.join("vae/config.json"))?;
    let sched_path = root.join("scheduler/scheduler_config.json");
    let (sched_raw, sched) = read_json(&sched_path)?;
    if sched["use_dynamic_shifting"].as_bool() == Some(true) {
        return Err(ZimagePackError::Source {
            path: sched_path,
            why: "dynamic shifting is not supported (Z-Image schedulers use a static shift)".into(),
        });
    }
    let shift = sched["shift"].as_f64().unwrap_or(3.0);
    let variant = match &opts.variant {
        Some(v) if v == "turbo" || v == "base" => v.clone(),
        Some(v) => {
            return Err(ZimagePackError::Option {
                flag: "--variant".into(),
                why: format!("`{v}`: turbo or base"),
            })
        }
        None if shift <= 3.5 => "turbo".into(),
        None => "base".into(),
    };
    let defaults = recipe(&variant, shift);
    let tok_path = root.join("tokenizer/tokenizer.json");
    let vocab = cmf_format::regular::read(&tok_path).map_err(|e| ZimagePackError::Source {
        path: tok_path.clone(),
        why: e.to_string(),
    })?;
    let chat_template = cmf_format::regular::read(root.join("tokenizer/tokenizer_config.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
        .and_then(|v| v["chat_template"].as_str().map(String::from))
        .or_else(|| {
            cmf_format::regular::read_to_string(root.join("tokenizer/chat_template.jinja")).ok()
        });

    // ── the plan ──
    let mut files: Vec<(PathBuf, File, Vec<StTensor>)> = Vec::new();
    let mut items: Vec<Item> = Vec::new();
    let dit_files = component_files(
        &root.join("transformer"),
        "diffusion_pytorch_model.safetensors.index.json",
        "diffusion_pytorch_model.safetensors",
    )?;
    let is_dit_proj = |n: &str| {
        (n.contains(".attention.to_") && n.ends_with(".weight"))
            || n.contains(".feed_forward.w")
            || n == "cap_embedder.1.weight"
    };
    for p in dit_files {
        let (f, ts) = read_st_header(&p)?;
        let fi = files.len();
        for (ti, t) in ts.iter().enumerate() {
            if t.name.starts_with("siglip") || t.dtype == Dtype::U8 {
                continue;
            }
            let rule = if t.name.ends_with("adaLN_modulation.0.weight") {
                if opts.dit == Codec::F32 {
                    Rule::Fixed(Codec::F32)
                } else {
                    Rule::Keep16
                }
            } else if t.shape.len() == 2 && is_dit_proj(&t.name) {
                Rule::Fixed(opts.dit)
            } else {
                Rule::Fixed(Codec::F32)
            };
            items.push(Item {
                out: format!("dit.{}", t.name),
                file: fi,
                tensor: ti,
                rule,
            });
        }
        files.push((p, f, ts));
    }
    let n_dit = items.len();
    let te_files = component_files(
        &root.join("text_encoder"),
        "model.safetensors.index.json",
        "model.safetensors",
    )?;
    let te_embed = opts.te_embed.unwrap_or(match opts.te {
        Codec::Quant(_) => Codec::Quant(Dtype::Q8Row),
        c => c,
    });
    for p in te_files {
        let (f, ts) = read_st_header(&p)?;
        let fi = files.len();
        for (ti, t) in ts.iter().enumerate() {
            let n = t.name.strip_prefix("model.").unwrap_or(&t.name);
            if n.starts_with("lm_head.") || n == "norm.weight" || t.dtype == Dtype::U8 {
                continue;
            }
            let layer = n
                .strip_prefix("layers.")
                .and_then(|r| r.split('.').next())
                .and_then(|x| x.parse::<usize>().ok());
            if layer.is_some_and(|l| l >= te_keep_layers) {
                continue;
            }
            let rule = if n == "embed_tokens.weight" {
                Rule::Fixed(te_embed)
            } else if t.shape.len() == 2 && n.ends_with("_proj.weight") {
                if opts.te_keep.iter().any(|k| te_keep_match(n, k)) {
                    Rule::Fixed(Codec::Source)
                } else {
                    Rule::Fixed(opts.te)
                }
            } else {
                Rule::Fixed(Codec::F32)
            };
            items.push(Item {
                out: format!("te.{n}"),
                file: fi,
                tensor: ti,
                rule,
            });
        }
        files.push((p, f, ts));
    }
    let n_te = items.len() - n_dit;
    let vae_files = component_files(
        &root.join("vae"),
        "diffusion_pytorch_model.safetensors.index.json",
        "diffusion_pytorch_model.safetensors",
    )?;
    for p in vae_files {
        let (f, ts) = read_st_header(&p)?;
        let fi = files.len();
        for (ti, t) in ts.iter().enumerate() {
            if !t.name.starts_with("decoder.") || t.dtype == Dtype::U8 {
                continue;
            }
            let codec = if t.shape.len() >= 2 {
                opts.vae
            } else {
                Codec::F32
            };
            items.push(Item {
                out: format!("vae.{}", t.name),
                file: fi,
                tensor: ti,
                rule: Rule::Fixed(codec),
            });
        }
        files.push((p, f, ts));
    }
    if n_dit == 0 || n_te == 0 || items.len() == n_dit + n_te {
        return Err(ZimagePackError::Source {
            path: root.to_path_buf(),
            why: format!(
                "found {n_dit} transformer, {n_te} text-encoder and {} VAE decoder tensors",
                items.len() - n_dit - n_te
            ),
        });
    }

    // ── header ──
    let te_geo = |k: &str| te_cfg[k].as_u64().unwrap_or(0) as usize;
    let arch = Arch {
        arch_name: "z_image".into(),
        hidden_size: te_geo("hidden_size"),
        intermediate_size: te_geo("intermediate_size"),
        num_layers: te_keep_layers,
        num_attention_heads: te_geo("num_attention_heads"),
        num_kv_heads: te_geo("num_key_value_heads"),
        head_dim: te_geo("head_dim"),
        vocab_size: te_geo("vocab_size"),
        layer_types: vec![LayerType::FullAttention; te_keep_layers],
        rms_norm_eps: te_cfg["rms_norm_eps"].as_f64().unwrap_or(1e-6),
        max_position_embeddings: te_geo("max_position_embeddings"),
        rope_theta: te_cfg["rope_theta"]
            .as_f64()
            .or_else(|| te_cfg["rope_parameters"]["rope_theta"].as_f64())
            .unwrap_or(1e6),
        tie_word_embeddings: te_cfg["tie_word_embeddings"].as_bool().unwrap_or(false),
        ..Arch::default()
    };
    let quant_type = match opts.dit {
        Codec::Quant(Dtype::Q8_2f) => QuantType::Q8_2f,
        Codec::Quant(Dtype::Q8Row) => QuantType::Q8Row,
        Codec::Quant(Dtype::Q4Block) => QuantType::Q4Block,
        Codec::F32 => QuantType::F32,
        Codec::Bf16 => QuantType::BF16,
        _ => QuantType::F16,
    };
    let mut header = Header::new(arch, quant_type);
    header.provenance = Some(json!({
        "tool": "cmf convert --zimage",
        "pipeline": if variant == "turbo" { "z-image-turbo" } else { "z-image" },
        "components": {"te": format!("qwen3 encoder, layers 0..{} (hidden_states[-2])", te_keep_layers - 1),
                       "dit": "ZImageTransformer2DModel", "vae": "flux vae decoder"},
        "packed_from": crate::source_name(root),
        "dit_codec": opts.dit.name(), "te_codec": opts.te.name(), "vae_codec": opts.vae.name(),
        "defaults": defaults,
        "tensor_name_policy": "diffusers names under dit./te./vae.",
    }));
    if let Some(t) = chat_template {
        header.tokenizer_config = Some(TokenizerConfig {
            chat_template: Some(t),
            ..Default::default()
        });
    }

    // ── write ──
    let blobs: Vec<(&str, Vec<u8>)> = vec![
        (
            "dit.config_json",
            serde_json::to_vec_pretty(&dit_cfg).expect("json"),
        ),
        (
            "te.config_json",
            serde_json::to_vec_pretty(&te_cfg).expect("json"),
        ),
        ("vae.config_json", vae_raw),
        (
            "zimage.config_json",
            serde_json::to_vec_pretty(&defaults).expect("json"),
        ),
        ("zimage.scheduler_json", sched_raw),
    ];
    let out_err = |why: String| ZimagePackError::Output {
        path: output.to_path_buf(),
        why,
    };
    let tc = header.tokenizer_config.clone().unwrap_or_default();
    crate::text_check::check(&tok_path, &vocab, &tc).map_err(|e| ZimagePackError::Source {
        path: tok_path.clone(),
        why: e.to_string(),
    })?;
    let mut w = CmfWriter::create(output, header).map_err(|e| out_err(e.to_string()))?;
    w.set_vocab(vocab);
    let mut by_codec: BTreeMap<String, u64> = BTreeMap::new();
    for (name, bytes) in &blobs {
        w.add_tensor(name, Dtype::U8, &[bytes.len()], bytes)
            .map_err(|e| out_err(e.to_string()))?;
        *by_codec.entry("u8".into()).or_default() += bytes.len() as u64;
    }
    let bytes_total: u64 = items.iter().map(|it| files[it.file].2[it.tensor].len).sum();
    let mut prog = PackProgress {
        tensors_done: 0,
        tensors_total: items.len(),
        bytes_done: 0,
        bytes_total,
    };
    progress(prog);
    for window in items.chunks(opts.threads.max(1)) {
        let encoded: Vec<Result<(Dtype, Vec<u8>)>> = window
            .par_iter()
            .map(|it| {
                let (path, f, ts) = &files[it.file];
                encode_item(path, f, &ts[it.tensor], it.rule)
            })
            .collect();
        for (it, enc) in window.iter().zip(encoded) {
            let (dtype, bytes) = enc?;
            let t = &files[it.file].2[it.tensor];
            w.add_tensor(&it.out, dtype, &t.shape, &bytes)
                .map_err(|e| out_err(format!("{}: {e}", it.out)))?;
            *by_codec.entry(dtype.name().into()).or_default() += bytes.len() as u64;
            prog.tensors_done += 1;
            prog.bytes_done += t.len;
        }
        progress(prog);
    }
    let path = w.finish().map_err(|e| out_err(e.to_string()))?;
    let bytes = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
    Ok(ZimageReport {
        path,
        tensors: items.len() + blobs.len(),
        bytes,
        by_codec,
        variant,
    })
}

/// `--te-keep` entry: `layers.3.mlp.down_proj` matches that tensor, `down_proj` every layer's.
fn te_keep_match(name: &str, key: &str) -> bool {
    if key.starts_with("layers.") {
        name == key || name.starts_with(&format!("{key}."))
    } else {
        name.contains(&format!(".{key}."))
    }
}

/// Reads one source tensor and encodes it.
fn encode_item(path: &Path, f: &File, t: &StTensor, rule: Rule) -> Result<(Dtype, Vec<u8>)> {
    let tbad = |why: String| ZimagePackError::Tensor {
        path: path.to_path_buf(),
        name: t.name.clone(),
        why,
    };
    let mut raw = vec![0u8; t.len as usize];
    f.read_exact_at(&mut raw, t.offset)
        .map_err(|e| tbad(e.to_string()))?;
    let values = || -> Vec<f32> {
        match t.dtype {
            Dtype::F32 => raw
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dtype::F16 => raw
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            _ => raw
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        }
    };
    let codec = match rule {
        Rule::Fixed(c) => c,
        Rule::Keep16 => match t.dtype {
            Dtype::F16 | Dtype::Bf16 => Codec::Source,
            _ if values().iter().all(|v| v.abs() < 65000.0) => Codec::F16,
            _ => Codec::F32,
        },
    };
    let target = match codec {
        Codec::Source => return Ok((t.dtype, raw)),
        Codec::F32 => Dtype::F32,
        Codec::F16 => Dtype::F16,
        Codec::Bf16 => Dtype::Bf16,
        Codec::Quant(d) => d,
    };
    if target == t.dtype {
        return Ok((target, raw));
    }
    if target.is_quantized() && t.shape.len() != 2 {
        return Err(tbad(format!(
            "{} needs a 2-D tensor, this one is {:?}",
            target, t.shape
        )));
    }
    let v = values();
    drop(raw);
    let bytes = cmf_format::codec::encode(target, &t.shape, &v)
        .map_err(|e| tbad(format!("encoding as {target}: {e}")))?;
    Ok((target, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codec_names() {
        assert_eq!(
            Codec::parse("q8", "--dit-quant").unwrap(),
            Codec::Quant(Dtype::Q8_2f)
        );
        assert_eq!(
            Codec::parse("Q8_ROW", "--dit-quant").unwrap(),
            Codec::Quant(Dtype::Q8Row)
        );
        assert_eq!(Codec::parse("raw", "--te-quant").unwrap(), Codec::Source);
        let e = Codec::parse("q3", "--dit-quant").unwrap_err().to_string();
        assert!(e.starts_with("--dit-quant: unknown codec `q3`"), "{e}");
    }

    #[test]
    fn te_keep_rules() {
        assert!(te_keep_match(
            "layers.6.mlp.down_proj.weight",
            "layers.6.mlp.down_proj"
        ));
        assert!(!te_keep_match(
            "layers.16.mlp.down_proj.weight",
            "layers.6.mlp.down_proj"
        ));
        assert!(te_keep_match("layers.16.mlp.down_proj.weight", "down_proj"));
        assert!(te_keep_match(
            "layers.6.self_attn.q_proj.weight",
            "layers.6"
        ));
    }
}
