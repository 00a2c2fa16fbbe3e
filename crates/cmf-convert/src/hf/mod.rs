//! `cmf convert --model DIR`: a Hugging Face checkpoint directory → one CMF file.
//!
//! Tensor names stay the checkpoint's (`model.layers.0.self_attn.q_proj.weight`, ...). Every
//! tensor in the checkpoint is carried over except `*.rotary_emb.inv_freq` buffers (derived from
//! the config) and, when `tie_word_embeddings` is true, `lm_head.weight` (transformers ties it to
//! the embedding and ignores the stored copy). The tensors the model needs are checked for
//! presence and shape against the config before anything is written; a MoE checkpoint must
//! hold one tensor per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`, the hub layout).
//! Codec policy: [`crate::quant`]. Memory: one chunk of rows per worker thread (emit.rs).

pub mod checkpoint;
pub mod config;
mod moe;
pub mod qwen3_next;
pub mod tokenizer;

use std::path::Path;

use cmf_format::{CmfWriter, Header, LayerType};
use serde_json::json;

use crate::emit::{rows_cols, write_tensor, TensorStats};
use crate::error::{ConvertError, Result};
use crate::quant::Quant;
use crate::{Options, Report};
use checkpoint::{Checkpoint, StTensor};
use config::HfConfig;

pub fn read_config(dir: &Path) -> Result<HfConfig> {
    let path = dir.join("config.json");
    let text =
        cmf_format::regular::read_to_string(&path).map_err(|e| ConvertError::io(&path, e))?;
    let json = serde_json::from_str(&text).map_err(|cause| ConvertError::Json {
        path: path.clone(),
        cause,
    })?;
    config::parse_config(&path, &json)
}

/// Shapes the model needs, from the config: (name, shape).
pub(crate) fn required_tensors(c: &HfConfig) -> Vec<(String, Vec<usize>)> {
    let a = &c.arch;
    let (h, hd, q, kv) = (
        a.hidden_size,
        a.head_dim,
        a.num_attention_heads,
        a.num_kv_heads,
    );
    let mut v = vec![
        (
            "model.embed_tokens.weight".to_owned(),
            vec![a.vocab_size, h],
        ),
        ("model.norm.weight".to_owned(), vec![h]),
    ];
    if !a.tie_word_embeddings {
        v.push(("lm_head.weight".into(), vec![a.vocab_size, h]));
    }
    // Gated attention (qwen3_next): q_proj emits a gate row per query row.
    let q_rows = if c.qwen3_next.is_some() {
        2 * q * hd
    } else {
        q * hd
    };
    for i in 0..a.num_layers {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        v.push((p("input_layernorm.weight"), vec![h]));
        v.push((p("post_attention_layernorm.weight"), vec![h]));
        match &c.qwen3_next {
            Some(hy) if a.layer_types[i] == LayerType::LinearAttention => {
                v.extend(hy.gdn_tensors(&format!("model.layers.{i}"), h));
            }
            _ => {
                v.push((p("self_attn.q_proj.weight"), vec![q_rows, h]));
                v.push((p("self_attn.k_proj.weight"), vec![kv * hd, h]));
                v.push((p("self_attn.v_proj.weight"), vec![kv * hd, h]));
                v.push((p("self_attn.o_proj.weight"), vec![h, q * hd]));
            }
        }
        if c.attention_bias {
            v.push((p("self_attn.q_proj.bias"), vec![q * hd]));
            v.push((p("self_attn.k_proj.bias"), vec![kv * hd]));
            v.push((p("self_attn.v_proj.bias"), vec![kv * hd]));
        }
        let qk_norm = matches!(a.arch_name.as_str(), "qwen3" | "qwen3_moe")
            || (c.qwen3_next.is_some() && a.layer_types[i] != LayerType::LinearAttention);
        if qk_norm {
            v.push((p("self_attn.q_norm.weight"), vec![hd]));
            v.push((p("self_attn.k_norm.weight"), vec![hd]));
        }
        match &a.moe {
            Some(m) if c.sparse_layers[i] => {
                v.extend(moe::required(m, h, &format!("model.layers.{i}")))
            }
            _ => v.extend(moe::mlp(&p("mlp"), h, a.intermediate_size)),
        }
    }
    v
}

/// Sort key putting tensors in model order: embeddings, layers by number, then the rest.
pub fn model_order(name: &str) -> (usize, usize, String) {
    if let Some(rest) = name.strip_prefix("model.layers.") {
        if let Some((n, tail)) = rest.split_once('.') {
            if let Ok(n) = n.parse::<usize>() {
                return (1, n, tail.to_owned());
            }
        }
    }
    let group = if name.contains("embed_tokens") { 0 } else { 2 };
    (group, 0, name.to_owned())
}

/// Converts `dir` into `output`; `opts.quant` defaults to q8.
pub fn convert(dir: &Path, output: &Path, opts: &Options) -> Result<Report> {
    let quant = opts.quant.unwrap_or(Quant::Q8);
    let progress = opts.progress;
    let cfg = read_config(dir)?;
    let ckpt = Checkpoint::open(dir)?;
    let mut notes = Vec::new();

    for (name, shape) in required_tensors(&cfg) {
        let t = ckpt.get(&name).ok_or_else(|| {
            ConvertError::tensor(
                dir,
                &name,
                "missing from the checkpoint (required by config.json)",
            )
        })?;
        if t.shape != shape {
            return Err(ConvertError::tensor(
                ckpt.file_of(t),
                &name,
                format!(
                    "shape {:?} does not match config.json, expected {shape:?}",
                    t.shape
                ),
            ));
        }
    }
    let mut names: Vec<&String> = ckpt
        .tensors
        .keys()
        .filter(|n| !n.ends_with("rotary_emb.inv_freq"))
        .filter(|n| {
            let drop = cfg.arch.tie_word_embeddings && n.as_str() == "lm_head.weight";
            if drop {
                notes.push("lm_head.weight dropped: tie_word_embeddings is true".into());
            }
            !drop
        })
        .collect();
    names.sort_by_key(|n| model_order(n));

    let tok = tokenizer::read(dir, &cfg)?;
    let mut source_dtypes: Vec<&str> = ckpt.tensors.values().map(|t| t.dtype.name()).collect();
    source_dtypes.sort();
    source_dtypes.dedup();
    let mut header = Header::new(cfg.arch.clone(), quant.header_quant_type());
    header.tokenizer_config = Some(tok.config.clone());

    let plan: Vec<(&String, &StTensor, cmf_format::Dtype)> = names
        .iter()
        .map(|n| {
            let t = &ckpt.tensors[*n];
            let keep = qwen3_next::keeps_f32(n);
            let d = match keep {
                true => cmf_format::Dtype::F32,
                false => quant.dtype_for(&t.shape),
            };
            if !keep && t.shape.len() >= 2 && d != quant.matrix_dtype() {
                notes.push(format!(
                    "{n}: shape {:?} cannot be {}, stored as {d}",
                    t.shape,
                    quant.matrix_dtype()
                ));
            }
            (*n, t, d)
        })
        .collect();
    header.provenance = Some(json!({
        "converter": concat!("cmf-convert ", env!("CARGO_PKG_VERSION")),
        "source": {
            "format": "huggingface-safetensors",
            "name": crate::source_name(dir),
            "files": ckpt.files.iter().map(|f| f.file_name().map(|s| s.to_string_lossy().into_owned())).collect::<Vec<_>>(),
            "dtypes": source_dtypes,
        },
        "quant": quant.name(),
        "codecs": {"matrices": quant.matrix_dtype().name(), "vectors": "f32"},
        "notes": notes,
    }));

    crate::text_check::check(dir, &tok.tokenizer_json, &tok.config)?;
    let mut w = CmfWriter::create(output, header)?;
    w.set_vocab(tok.tokenizer_json);
    let total: u64 = plan
        .iter()
        .map(|(_, t, _)| t.shape.iter().product::<usize>() as u64)
        .sum();
    progress.start(total);
    let mut stats = TensorStats::default();
    let mut per_tensor = Vec::with_capacity(plan.len());
    for (name, t, dtype) in &plan {
        let (_, cols) = rows_cols(&t.shape);
        let file = ckpt.file_of(t);
        let s = write_tensor(
            &mut w,
            file,
            name,
            *dtype,
            &t.shape,
            opts.measure_error,
            &|r0, r1, out| {
                debug_assert_eq!(out.len(), (r1 - r0) * cols);
                ckpt.read_f32(t, r0 * cols, out);
                Ok(())
            },
        )?;
        ckpt.release(t);
        stats.add(s);
        per_tensor.push(((*name).clone(), *dtype, s));
        progress.tensor_done(name, t.shape.iter().product::<usize>() as u64);
    }
    let output = w.finish()?;
    progress.finish();
    Ok(Report {
        output,
        tensors: per_tensor,
        total: stats,
        notes,
    })
}
