//! `cmf import-gguf FILE`: a llama.cpp GGUF model → one CMF file.
//!
//! - Metadata → [`Arch`] (llama.cpp's key names, `gguf-py/gguf/constants.py` `Keys.LLM` /
//!   `Keys.Attention` / `Keys.Rope`, prefixed by `general.architecture`).
//! - Tensors → Hugging Face names ([`names`]), dequantized to f32 row by row
//!   ([`crate::gguf::dequant`], bit-exact with gguf-py), Q/K rows of llama-architecture models put
//!   back in Hugging Face order, llama.cpp's qwen3next changes undone ([`qwen3next`]), then
//!   encoded with the chosen codec.
//! - Tokenizer → an equivalent `tokenizer.json` ([`tokenizer`]); chat template from
//!   `tokenizer.chat_template`.
//!
//! Default codec when `--quant` is not given, per GGUF tensor type: F32 → f32, F16 → f16,
//! BF16 → bf16, every quantized type → q8_row. Requantizing to 8 bits adds an error far below the
//! source's own 4–6-bit quantization error (measured on the demo model in docs/convert.md);
//! re-quantizing to 4 bits would compound two 4-bit roundings. 1-D tensors are always f32.

pub mod names;
pub mod qwen3next;
pub mod tokenizer;

use std::path::Path;

use cmf_format::{
    limits, Arch, CmfWriter, Dtype, Header, LayerType, Moe, NormStyle, QuantType, TokenizerConfig,
};
use serde_json::{json, Map, Value as Json};

use crate::emit::{rows_cols, write_tensor, TensorStats};
use crate::error::{ConvertError, Result};
use crate::gguf::{dequant, GgmlType, Gguf, GgufFile, TensorInfo, Value};
use crate::hf::qwen3_next::Qwen3Next;
use crate::quant::Quant;
use crate::{Options, Report};
use qwen3next::Fix;

pub const ARCHITECTURES: &[&str] = &["llama", "qwen2", "qwen3", "qwen3moe", "qwen3next"];

struct Meta<'a> {
    g: &'a Gguf,
    file: &'a Path,
    arch: &'a str,
}

impl Meta<'_> {
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }

    fn get(&self, k: &str) -> Option<&Value> {
        self.g.get(&self.key(k))
    }

    fn usize_opt(&self, k: &str) -> Result<Option<usize>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v.as_u64().map(|u| Some(u as usize)).ok_or_else(|| {
                ConvertError::field(
                    self.file,
                    self.key(k),
                    format!("expected an unsigned integer, found {}", v.summary()),
                )
            }),
        }
    }

    fn usize_req(&self, k: &str) -> Result<usize> {
        match self.usize_opt(k)? {
            Some(0) => Err(ConvertError::field(
                self.file,
                self.key(k),
                "must be positive",
            )),
            Some(v) => Ok(v),
            None => Err(ConvertError::field(self.file, self.key(k), "missing")),
        }
    }

    fn f64_opt(&self, k: &str) -> Result<Option<f64>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| {
                ConvertError::field(
                    self.file,
                    self.key(k),
                    format!("expected a number, found {}", v.summary()),
                )
            }),
        }
    }
}

/// The architecture described by the GGUF metadata and tensor shapes.
pub fn arch_from_gguf(gf: &GgufFile) -> Result<Arch> {
    Ok(arch_and_hybrid(gf)?.0)
}

/// The architecture, and for `qwen3next` its GatedDeltaNet geometry.
fn arch_and_hybrid(gf: &GgufFile) -> Result<(Arch, Option<Qwen3Next>)> {
    let (g, file) = (&gf.gguf, gf.path.as_path());
    let arch = g.architecture().ok_or_else(|| {
        ConvertError::field(file, "general.architecture", "missing or not a string")
    })?;
    if !ARCHITECTURES.contains(&arch) {
        return Err(ConvertError::unsupported(
            file,
            format!(
                "GGUF architecture '{arch}' is not supported (supported: {})",
                ARCHITECTURES.join(", ")
            ),
        ));
    }
    let m = Meta { g, file, arch };
    let hidden = m.usize_req("embedding_length")?;
    let heads = m.usize_req("attention.head_count")?;
    let kv_heads = m.usize_opt("attention.head_count_kv")?.unwrap_or(heads);
    if kv_heads == 0 || heads % kv_heads != 0 {
        return Err(ConvertError::field(
            file,
            m.key("attention.head_count_kv"),
            format!("{kv_heads} does not divide head_count {heads}"),
        ));
    }
    let head_dim = match m.usize_opt("attention.key_length")? {
        Some(d) if d > 0 => d,
        _ => hidden / heads,
    };
    let rope_dims = m.usize_opt("rope.dimension_count")?.unwrap_or(head_dim);
    if rope_dims == 0 || rope_dims > head_dim || rope_dims % 2 != 0 {
        return Err(ConvertError::field(
            file,
            m.key("rope.dimension_count"),
            format!("{rope_dims} is not an even number ≤ head_dim {head_dim}"),
        ));
    }
    let embd = g
        .tensor("token_embd.weight")
        .ok_or_else(|| ConvertError::tensor(file, "token_embd.weight", "missing"))?;
    let shape = embd.shape();
    if shape.len() != 2 || shape[1] as usize != hidden {
        return Err(ConvertError::tensor(
            file,
            "token_embd.weight",
            format!("shape {shape:?} is not [vocab, {hidden}]"),
        ));
    }
    let vocab = shape[0] as usize;
    let num_layers = m.usize_req("block_count")?;
    // Checked before the per-layer tables are sized by it.
    limits::check_size("block_count", num_layers, limits::MAX_LAYERS)
        .map_err(|(k, msg)| ConvertError::field(file, m.key(&k), msg))?;

    let mut extra = Map::new();
    let rope_theta = m.f64_opt("rope.freq_base")?.unwrap_or(10_000.0);
    if let Some(s) = rope_scaling(&m, gf, head_dim, rope_theta)? {
        extra.insert("rope_scaling".into(), Json::Object(s));
    }
    let attention_bias = g.tensor("blk.0.attn_q.bias").is_some();
    extra.insert("attention_bias".into(), attention_bias.into());
    extra.insert("hidden_act".into(), "silu".into());
    let sliding_window = m.usize_opt("attention.sliding_window")?.filter(|&w| w > 0);
    let moe = match arch {
        "qwen3moe" => Some(moe_from_gguf(&m)?),
        "qwen3next" => Some(Moe {
            shared_expert_intermediate_size: Some(
                m.usize_req("expert_shared_feed_forward_length")?,
            ),
            ..moe_from_gguf(&m)?
        }),
        _ => None,
    };
    let hybrid = match arch {
        "qwen3next" => {
            if m.usize_opt("nextn_predict_layers")?.unwrap_or(0) > 0 {
                return Err(ConvertError::unsupported(
                    file,
                    format!(
                        "{} > 0: multi-token-prediction layers are not supported",
                        m.key("nextn_predict_layers")
                    ),
                ));
            }
            Some(qwen3next::parse(&m, num_layers, &mut extra)?)
        }
        _ => None,
    };
    let arch = Arch {
        // The Hugging Face spelling, as `cmf convert` writes it.
        arch_name: match arch {
            "qwen3moe" => "qwen3_moe".to_owned(),
            "qwen3next" => "qwen3_next".to_owned(),
            a => a.to_owned(),
        },
        hidden_size: hidden,
        intermediate_size: m.usize_req("feed_forward_length")?,
        num_layers,
        num_attention_heads: heads,
        num_kv_heads: kv_heads,
        head_dim,
        vocab_size: vocab,
        layer_types: match &hybrid {
            Some((types, _)) => types.clone(),
            None => vec![
                if sliding_window.is_some() {
                    LayerType::SlidingAttention
                } else {
                    LayerType::FullAttention
                };
                num_layers
            ],
        },
        rms_norm_eps: m
            .f64_opt("attention.layer_norm_rms_epsilon")?
            .unwrap_or(1e-5),
        // Qwen3-Next's zero-centred RMSNorms scale by (1 + w).
        norm_style: match hybrid {
            Some(_) => NormStyle::Gemma,
            None => NormStyle::Qwen,
        },
        rope_theta,
        tie_word_embeddings: g.tensor("output.weight").is_none(),
        partial_rotary_factor: rope_dims as f32 / head_dim as f32,
        sliding_window,
        max_position_embeddings: m.usize_opt("context_length")?.unwrap_or(4096),
        yarn: None,
        moe,
        extra,
    };
    limits::check_arch(&arch).map_err(|(k, msg)| {
        // The GGUF key the field comes from.
        let key = match k.as_str() {
            "hidden_size" => m.key("embedding_length"),
            "intermediate_size" => m.key("feed_forward_length"),
            "num_layers" => m.key("block_count"),
            "num_attention_heads" => m.key("attention.head_count"),
            "num_kv_heads" => m.key("attention.head_count_kv"),
            "head_dim" => m.key("attention.key_length"),
            "vocab_size" => "token_embd.weight (rows)".into(),
            "max_position_embeddings" => m.key("context_length"),
            "rms_norm_eps" => m.key("attention.layer_norm_rms_epsilon"),
            "rope_theta" => m.key("rope.freq_base"),
            "moe.num_experts" => m.key("expert_count"),
            "moe.top_k" => m.key("expert_used_count"),
            "moe.moe_intermediate_size" => m.key("expert_feed_forward_length"),
            _ => m.key("rope.dimension_count"),
        };
        ConvertError::field(file, key, msg)
    })?;
    Ok((arch, hybrid.map(|(_, geo)| geo)))
}

/// llama.cpp's expert keys → the CMF `moe` descriptor. llama.cpp's `qwen3moe` graph always
/// renormalises the top-k weights (`build_moe_ffn(..., norm_w = true, ...)`), so
/// `norm_topk_prob` is true unless `expert_weights_norm` says otherwise.
fn moe_from_gguf(m: &Meta) -> Result<Moe> {
    let norm = match m.get("expert_weights_norm") {
        None => true,
        Some(v) => v.as_bool().ok_or_else(|| {
            ConvertError::field(m.file, m.key("expert_weights_norm"), "expected a bool")
        })?,
    };
    Ok(Moe {
        num_experts: m.usize_req("expert_count")?,
        top_k: m.usize_req("expert_used_count")?,
        moe_intermediate_size: m.usize_req("expert_feed_forward_length")?,
        norm_topk_prob: norm,
        shared_expert_intermediate_size: None,
        extra: Map::new(),
    })
}

/// `rope.scaling.*` keys → the Hugging Face `rope_scaling` dict. A `rope_freqs.weight` tensor
/// (how llama.cpp stores Llama 3 scaling) is accepted when it equals the factors of the standard
/// Llama 3 parameters (low 1, high 4, original context 8192, factor = its largest value).
fn rope_scaling(
    m: &Meta,
    gf: &GgufFile,
    head_dim: usize,
    theta: f64,
) -> Result<Option<Map<String, Json>>> {
    let mut s = Map::new();
    let ty = match m.get("rope.scaling.type") {
        None => None,
        Some(v) => Some(v.as_str().ok_or_else(|| {
            ConvertError::field(m.file, m.key("rope.scaling.type"), "expected a string")
        })?),
    };
    match ty {
        None | Some("none") => {}
        Some(t @ ("linear" | "yarn")) => {
            s.insert("rope_type".into(), t.into());
            let factor = m.f64_opt("rope.scaling.factor")?.ok_or_else(|| {
                ConvertError::field(m.file, m.key("rope.scaling.factor"), "missing")
            })?;
            s.insert("factor".into(), factor.into());
            if t == "yarn" {
                if let Some(o) = m.usize_opt("rope.scaling.original_context_length")? {
                    s.insert("original_max_position_embeddings".into(), o.into());
                }
                for (k, hf) in [
                    ("rope.scaling.yarn_beta_fast", "beta_fast"),
                    ("rope.scaling.yarn_beta_slow", "beta_slow"),
                    ("rope.scaling.attn_factor", "attention_factor"),
                ] {
                    if let Some(v) = m.f64_opt(k)? {
                        s.insert(hf.into(), v.into());
                    }
                }
            }
        }
        Some(other) => {
            return Err(ConvertError::unsupported(
                m.file,
                format!("RoPE scaling type '{other}' is not supported"),
            ))
        }
    }
    if let Some(t) = gf.gguf.tensor("rope_freqs.weight") {
        if !s.is_empty() {
            return Err(ConvertError::unsupported(
                m.file,
                "both rope.scaling.type and rope_freqs.weight are present",
            ));
        }
        let factors = gf
            .dequantize(t)
            .map_err(|e| ConvertError::tensor(m.file, "rope_freqs.weight", e))?;
        let llama3 = fit_llama3(&factors, head_dim, theta).ok_or_else(|| {
            ConvertError::tensor(m.file, "rope_freqs.weight", "per-frequency RoPE factors that are not standard Llama 3 scaling are not supported; convert the Hugging Face checkpoint instead")
        })?;
        return Ok(Some(llama3));
    }
    Ok((!s.is_empty()).then_some(s))
}

/// transformers' `_compute_llama3_parameters` for one parameter set, as factors per frequency.
fn llama3_factors(dim: usize, theta: f64, factor: f64, low: f64, high: f64, orig: f64) -> Vec<f64> {
    (0..dim / 2)
        .map(|i| {
            let freq = 1.0 / theta.powf((2 * i) as f64 / dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            if wavelen < orig / high {
                1.0
            } else if wavelen > orig / low {
                factor
            } else {
                let smooth = (orig / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .collect()
}

fn fit_llama3(factors: &[f32], head_dim: usize, theta: f64) -> Option<Map<String, Json>> {
    let factor = factors.iter().cloned().fold(f32::MIN, f32::max) as f64;
    let (low, high, orig) = (1.0, 4.0, 8192.0);
    let want = llama3_factors(head_dim, theta, factor, low, high, orig);
    let ok = want.len() == factors.len()
        && want
            .iter()
            .zip(factors)
            .all(|(w, &f)| ((w - f as f64) / w).abs() < 1e-5);
    ok.then(|| {
        let v = json!({"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                       "high_freq_factor": high, "original_max_position_embeddings": orig as u64});
        v.as_object().cloned().expect("object")
    })
}

/// The default codec for a GGUF tensor type (see the module docs).
pub fn default_dtype(ty: GgmlType, shape: &[usize]) -> Dtype {
    if shape.len() < 2 {
        return Dtype::F32;
    }
    match ty {
        GgmlType::F32 => Dtype::F32,
        GgmlType::F16 => Dtype::F16,
        GgmlType::BF16 => Dtype::Bf16,
        _ => Dtype::Q8Row,
    }
}

fn header_quant(dtypes: &[Dtype]) -> QuantType {
    let most = |d: Dtype| dtypes.iter().filter(|&&x| x == d).count();
    let best = [
        Dtype::Q8Row,
        Dtype::Q8_2f,
        Dtype::Q4Tiled,
        Dtype::F16,
        Dtype::Bf16,
        Dtype::F32,
    ]
    .into_iter()
    .max_by_key(|&d| most(d))
    .unwrap_or(Dtype::F32);
    match best {
        Dtype::Q8Row => QuantType::Q8Row,
        Dtype::Q8_2f => QuantType::Q8_2f,
        Dtype::Q4Tiled => QuantType::Q4Block,
        Dtype::F16 => QuantType::F16,
        Dtype::Bf16 => QuantType::BF16,
        _ => QuantType::F32,
    }
}

pub fn import(path: &Path, output: &Path, opts: &Options) -> Result<Report> {
    let file = GgufFile::open(path)?;
    let g = &file.gguf;
    let (arch, hybrid) = arch_and_hybrid(&file)?;
    let tok = tokenizer::rebuild(g).map_err(|cause| ConvertError::GgufTokenizer {
        file: path.into(),
        cause,
    })?;
    if tok.n_tokens > arch.vocab_size {
        return Err(ConvertError::tensor(
            path,
            "token_embd.weight",
            format!(
                "{} rows for a vocabulary of {} tokens",
                arch.vocab_size, tok.n_tokens
            ),
        ));
    }
    let permute = arch.arch_name == "llama";
    let mut notes = Vec::new();

    // Plan: every tensor mapped to its Hugging Face name; unknown names are an error, not a
    // silent drop.
    struct Item<'a> {
        info: &'a TensorInfo,
        hf: String,
        shape: Vec<usize>,
        dtype: Dtype,
        heads: Option<usize>,
        /// First row of this item in the GGUF tensor (an expert's slice of a stacked tensor).
        row0: usize,
        /// qwen3next: the `attn_gate` half of a regrouped `in_proj_qkvz` (`info` is `attn_qkv`).
        gate: Option<&'a TensorInfo>,
        fix: Fix,
    }
    let mut plan = Vec::new();
    for t in &g.tensors {
        if t.name == "rope_freqs.weight" {
            notes.push("rope_freqs.weight folded into arch.rope_scaling".to_owned());
            continue;
        }
        if let Some((layer, leaf)) = names::expert_stack(&t.name) {
            let shape: Vec<usize> = t.shape().iter().map(|&d| d as usize).collect();
            let experts = arch.moe.as_ref().map_or(0, |m| m.num_experts);
            if shape.len() != 3 || shape[0] != experts {
                return Err(ConvertError::tensor(
                    path,
                    &t.name,
                    format!("shape {shape:?} is not [{experts} experts, rows, cols]"),
                ));
            }
            if !t.ty.can_dequantize() {
                return Err(ConvertError::tensor(
                    path,
                    &t.name,
                    format!("GGUF tensor type {} is not supported", t.ty),
                ));
            }
            let one = vec![shape[1], shape[2]];
            for e in 0..experts {
                plan.push(Item {
                    info: t,
                    hf: names::expert_name(layer, e, leaf),
                    dtype: match opts.quant {
                        Some(q) => q.dtype_for(&one),
                        None => default_dtype(t.ty, &one),
                    },
                    shape: one.clone(),
                    heads: None,
                    row0: e * shape[1],
                    gate: None,
                    fix: Fix::None,
                });
            }
            continue;
        }
        if let Some(geo) = &hybrid {
            if let Some(item) = qwen3next::regrouped_qkvz(path, g, geo, t, opts)? {
                plan.extend(item.into_iter().map(|(hf, shape, dtype, gate)| Item {
                    info: t,
                    hf,
                    shape,
                    dtype,
                    heads: None,
                    row0: 0,
                    gate,
                    fix: Fix::None,
                }));
                continue;
            }
        }
        let hf = names::hf_name(&t.name).ok_or_else(|| {
            ConvertError::tensor(
                path,
                &t.name,
                format!(
                    "no Hugging Face counterpart known for architecture '{}'",
                    arch.arch_name
                ),
            )
        })?;
        if !t.ty.can_dequantize() {
            return Err(ConvertError::tensor(
                path,
                &t.name,
                format!("GGUF tensor type {} is not supported", t.ty),
            ));
        }
        let shape = match &hybrid {
            Some(_) => qwen3next::hf_shape(path, t, &hf)?,
            None => t.shape().iter().map(|&d| d as usize).collect(),
        };
        let dtype = match opts.quant {
            // The same tensors `cmf convert` keeps in f32 whatever the codec.
            _ if crate::hf::qwen3_next::keeps_f32(&hf) => Dtype::F32,
            Some(q) => q.dtype_for(&shape),
            None => default_dtype(t.ty, &shape),
        };
        let fix = match &hybrid {
            Some(_) if t.name.ends_with(".ssm_a") => Fix::ALog,
            Some(_) if qwen3next::stores_one_plus(&t.name) => Fix::MinusOne,
            _ => Fix::None,
        };
        let heads = if permute {
            names::permuted_heads(&t.name, arch.num_attention_heads, arch.num_kv_heads)
        } else {
            None
        };
        if let Some(h) = heads {
            if shape[0] != h * arch.head_dim {
                return Err(ConvertError::tensor(
                    path,
                    &t.name,
                    format!("{} rows, expected {h} heads × {}", shape[0], arch.head_dim),
                ));
            }
        }
        plan.push(Item {
            info: t,
            hf,
            shape,
            dtype,
            heads,
            row0: 0,
            gate: None,
            fix,
        });
    }
    plan.sort_by_key(|it| crate::hf::model_order(&it.hf));
    if let Some(geo) = &hybrid {
        let have: Vec<(&str, &[usize])> = plan
            .iter()
            .map(|i| (i.hf.as_str(), i.shape.as_slice()))
            .collect();
        qwen3next::check_tensors(path, &arch, geo, &have)?;
        notes.push("qwen3next: ssm_a, the 1 + w norms and attn_qkv/attn_gate converted back to the Hugging Face tensors".to_owned());
    }

    let dtypes: Vec<Dtype> = plan
        .iter()
        .filter(|i| i.shape.len() >= 2)
        .map(|i| i.dtype)
        .collect();
    let mut header = Header::new(arch.clone(), header_quant(&dtypes));
    let mut tc_extra = Map::new();
    tc_extra.insert("add_bos_token".into(), tok.add_bos.into());
    header.tokenizer_config = Some(TokenizerConfig {
        chat_template: tok.chat_template.clone(),
        eos_token_ids: tok.eos_token_ids.clone(),
        bos_token_id: tok.bos_token_id,
        pad_token_id: tok.pad_token_id,
        extra: tc_extra,
    });
    let mut src_types: Vec<&str> = g.tensors.iter().map(|t| t.ty.name()).collect();
    src_types.sort();
    src_types.dedup();
    header.provenance = Some(json!({
        "converter": concat!("cmf-convert ", env!("CARGO_PKG_VERSION")),
        "source": {
            "format": "gguf",
            "file": crate::source_name(path),
            "gguf_version": g.version,
            "name": g.get("general.name").and_then(Value::as_str),
            "tensor_types": src_types,
            "tokenizer": {"model": tok.model, "pre": tok.pre},
        },
        "quant": opts.quant.map(Quant::name).unwrap_or("default (quantized → q8_row, f16/bf16/f32 kept)"),
        "qk_unpermuted": permute,
        "notes": notes,
    }));

    let vocab = serde_json::to_vec(&tok.json).expect("JSON serializes");
    let tc = header.tokenizer_config.clone().unwrap_or_default();
    crate::text_check::check(path, &vocab, &tc)?;
    let mut w = CmfWriter::create(output, header)?;
    w.set_vocab(vocab);
    let elements = |i: &Item| i.shape.iter().product::<usize>() as u64;
    let total: u64 = plan.iter().map(elements).sum();
    opts.progress.start(total);
    let mut stats = TensorStats::default();
    let mut per_tensor = Vec::with_capacity(plan.len());
    for it in &plan {
        let data = file.tensor_bytes(it.info);
        let (_, cols) = rows_cols(&it.shape);
        let row_bytes = it
            .info
            .ty
            .nbytes(cols as u64)
            .expect("validated by the parser") as usize;
        let ty = it.info.ty;
        let hd = arch.head_dim;
        let read_rows =
            |r0: usize, r1: usize, out: &mut [f32]| -> std::result::Result<(), String> {
                if let (Some(gate), Some(geo)) = (it.gate, &hybrid) {
                    let gate_data = file.tensor_bytes(gate);
                    let gate_row =
                        gate.ty
                            .nbytes(cols as u64)
                            .expect("validated by the parser") as usize;
                    for (k, o) in out.chunks_exact_mut(cols).enumerate() {
                        let (d, t, rb, s) = match qwen3next::qkvz_source_row(geo, r0 + k) {
                            (false, s) => (data, ty, row_bytes, s),
                            (true, s) => (gate_data, gate.ty, gate_row, s),
                        };
                        dequant::dequantize(t, &d[s * rb..(s + 1) * rb], o)?;
                    }
                    return Ok(());
                }
                let (r0, r1) = (it.row0 + r0, it.row0 + r1);
                match it.heads {
                    None => dequant::dequantize(ty, &data[r0 * row_bytes..r1 * row_bytes], out),
                    // 1-D bias: one "row" of heads·hd elements, permuted element-wise.
                    Some(_) if it.shape.len() == 1 => {
                        let mut src = vec![0f32; out.len()];
                        dequant::dequantize(ty, data, &mut src)?;
                        for (e, o) in out.iter_mut().enumerate() {
                            *o = src[names::unpermuted_source_row(e, hd)];
                        }
                        Ok(())
                    }
                    Some(_) => {
                        for (k, o) in out.chunks_exact_mut(cols).enumerate() {
                            let s = names::unpermuted_source_row(r0 + k, hd);
                            dequant::dequantize(ty, &data[s * row_bytes..(s + 1) * row_bytes], o)?;
                        }
                        Ok(())
                    }
                }
            };
        let rows_fn = |r0: usize, r1: usize, out: &mut [f32]| -> std::result::Result<(), String> {
            read_rows(r0, r1, out)?;
            qwen3next::apply(it.fix, out)
        };
        let s = write_tensor(
            &mut w,
            path,
            &it.hf,
            it.dtype,
            &it.shape,
            opts.measure_error,
            &rows_fn,
        )?;
        stats.add(s);
        per_tensor.push((it.hf.clone(), it.dtype, s));
        opts.progress.tensor_done(&it.hf, elements(it));
    }
    let output = w.finish()?;
    opts.progress.finish();
    Ok(Report {
        output,
        tensors: per_tensor,
        total: stats,
        notes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What llama.cpp's converter writes as `rope_freqs.weight` for Llama 3.1 (head_dim 128,
    /// theta 500000, factor 8) maps back to the standard parameters; other parameters are refused.
    #[test]
    fn llama3_rope_freqs_round_trip() {
        let factors: Vec<f32> = llama3_factors(128, 500_000.0, 8.0, 1.0, 4.0, 8192.0)
            .iter()
            .map(|&f| f as f32)
            .collect();
        assert!(
            factors.iter().any(|&f| f > 1.0 && f < 8.0),
            "has interpolated frequencies"
        );
        let s = fit_llama3(&factors, 128, 500_000.0).unwrap();
        assert_eq!(s["rope_type"], "llama3");
        assert_eq!(s["factor"], 8.0);
        assert_eq!(s["original_max_position_embeddings"], 8192);
        let odd: Vec<f32> = llama3_factors(16, 10_000.0, 8.0, 1.0, 4.0, 32.0)
            .iter()
            .map(|&f| f as f32)
            .collect();
        assert!(fit_llama3(&odd, 16, 10_000.0).is_none());
    }

    #[test]
    fn default_codecs_per_gguf_type() {
        assert_eq!(default_dtype(GgmlType::Q4_K, &[8, 256]), Dtype::Q8Row);
        assert_eq!(default_dtype(GgmlType::BF16, &[8, 256]), Dtype::Bf16);
        assert_eq!(default_dtype(GgmlType::F16, &[8, 256]), Dtype::F16);
        assert_eq!(default_dtype(GgmlType::Q8_0, &[256]), Dtype::F32);
    }
}
