//! `cmf info FILE`: what a model file holds, read from its header and directory only (O(directory):
//! tensor data is never touched, so it is instant on a multi-GB file).

use std::collections::BTreeMap;
use std::path::PathBuf;

use cmf_format::{CmfModel, Dtype, TensorView};
use serde_json::json;

use super::human_bytes;

/// Show a model's architecture, tensor counts and sizes by codec, and tokenizer bundle.
#[derive(clap::Args)]
pub struct Args {
    /// A .cmf file, or any shard of a shard set.
    file: PathBuf,
    /// List the tensors whose names start with PREFIX (all tensors when PREFIX is omitted;
    /// write `--tensors=` or put FILE first to list all).
    #[arg(long, value_name = "PREFIX", num_args = 0..=1, default_missing_value = "")]
    tensors: Option<String>,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Default)]
struct DtypeStats {
    count: usize,
    bytes: u64,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let model = CmfModel::open(&args.file)?; // the error names the file
    let mut by_dtype: BTreeMap<&'static str, DtypeStats> = BTreeMap::new();
    for t in model.tensors() {
        let s = by_dtype.entry(t.dtype.name()).or_default();
        s.count += 1;
        s.bytes += t.data.len() as u64;
    }
    let listed: Vec<TensorView> = match &args.tensors {
        Some(prefix) => model
            .tensors()
            .filter(|t| t.name.starts_with(prefix.as_str()))
            .collect(),
        None => Vec::new(),
    };
    if args.json {
        print_json(
            &model,
            &by_dtype,
            args.tensors.is_some().then_some(&listed[..]),
        )
    } else {
        print_text(
            &model,
            &by_dtype,
            args.tensors.as_deref().map(|p| (p, &listed[..])),
        );
        Ok(())
    }
}

fn tensor_bytes(model: &CmfModel) -> u64 {
    model.tensors().map(|t| t.data.len() as u64).sum()
}

fn print_text(
    model: &CmfModel,
    by_dtype: &BTreeMap<&str, DtypeStats>,
    listing: Option<(&str, &[TensorView])>,
) {
    let h = model.header();
    let a = &h.arch;
    let files = model.files();
    let file_bytes: u64 = files.iter().map(|f| f.file_len()).sum();
    println!("file        {}", model.path().display());
    if files.len() > 1 {
        println!(
            "            shard set of {} files, {}",
            files.len(),
            human_bytes(file_bytes)
        );
    } else {
        println!("            {}", human_bytes(file_bytes));
    }
    println!("arch        {}", a.arch_name);
    println!(
        "            hidden {}, ffn {}, layers {}, heads {} (kv {}), head_dim {}, vocab {}",
        a.hidden_size,
        a.intermediate_size,
        a.num_layers,
        a.num_attention_heads,
        a.num_kv_heads,
        a.head_dim,
        a.vocab_size
    );
    let mut layer_kinds: BTreeMap<String, usize> = BTreeMap::new();
    for t in &a.layer_types {
        *layer_kinds.entry(serde_name(t)).or_default() += 1;
    }
    let kinds: Vec<String> = layer_kinds
        .iter()
        .map(|(k, n)| format!("{k} ×{n}"))
        .collect();
    println!(
        "            layers: {}",
        if kinds.is_empty() {
            "-".into()
        } else {
            kinds.join(", ")
        }
    );
    println!(
        "            rope_theta {}, rms_norm_eps {:e}, norm {}, max_pos {}, tied embeddings {}",
        a.rope_theta,
        a.rms_norm_eps,
        serde_name(&a.norm_style),
        a.max_position_embeddings,
        if a.tie_word_embeddings { "yes" } else { "no" }
    );
    if let Some(w) = a.sliding_window {
        println!("            sliding_window {w}");
    }
    if let Some(m) = &a.moe {
        let routing = if m.norm_topk_prob {
            "top-k weights renormalised"
        } else {
            "top-k softmax weights"
        };
        let shared = match m.shared_expert_intermediate_size {
            Some(w) => format!("shared expert ffn {w}"),
            None => "no shared expert".into(),
        };
        println!(
            "            moe: {} experts, top {}, expert ffn {}, {shared}, {routing}",
            m.num_experts, m.top_k, m.moe_intermediate_size
        );
    }
    if !a.extra.is_empty() {
        let keys: Vec<&str> = a.extra.keys().map(String::as_str).collect();
        println!("            other fields: {}", keys.join(", "));
    }
    println!("quant_type  {}", serde_name(&h.quant_type));
    match model.vocab() {
        Some(v) => println!(
            "tokenizer   tokenizer.json embedded ({})",
            human_bytes(v.len() as u64)
        ),
        None => println!("tokenizer   none embedded"),
    }
    match &h.tokenizer_config {
        Some(tc) => {
            let template = match &tc.chat_template {
                Some(t) => format!("yes ({} chars)", t.chars().count()),
                None => "no".into(),
            };
            println!(
                "            chat template: {template}; eos {:?}; bos {:?}; pad {:?}",
                tc.eos_token_ids, tc.bos_token_id, tc.pad_token_id
            );
        }
        None => println!("            chat template: no (no tokenizer_config)"),
    }
    if let Some(p) = &h.provenance {
        println!("provenance  {p}");
    }
    println!(
        "tensors     {} ({})",
        model.len(),
        human_bytes(tensor_bytes(model))
    );
    for (name, s) in by_dtype {
        println!(
            "            {name:<9} {:>6}  {:>10}",
            s.count,
            human_bytes(s.bytes)
        );
    }
    if let Some((prefix, list)) = listing {
        println!();
        if list.is_empty() {
            println!("no tensor name starts with {prefix:?}");
        }
        let width = list.iter().map(|t| t.name.len()).max().unwrap_or(0);
        for t in list {
            println!(
                "{:<width$}  {:<8} {:<16} {:>10}  @{:#x}",
                t.name,
                t.dtype.name(),
                t.shape.to_string(),
                human_bytes(t.data.len() as u64),
                t.file_offset
            );
        }
    }
}

fn print_json(
    model: &CmfModel,
    by_dtype: &BTreeMap<&str, DtypeStats>,
    listing: Option<&[TensorView]>,
) -> anyhow::Result<()> {
    let h = model.header();
    let header: serde_json::Value = serde_json::to_value(h)?;
    let mut out = json!({
        "path": model.path(),
        "files": model.files().iter().map(|f| json!({"path": f.path(), "bytes": f.file_len(), "tensors": f.len()})).collect::<Vec<_>>(),
        "arch": header["arch"],
        "quant_type": header["quant_type"],
        "provenance": header.get("provenance"),
        "tokenizer": {
            "vocab_bytes": model.vocab().map(|v| v.len()),
            "chat_template": h.tokenizer_config.as_ref().is_some_and(|t| t.chat_template.is_some()),
            "eos_token_ids": h.tokenizer_config.as_ref().map(|t| &t.eos_token_ids),
            "bos_token_id": h.tokenizer_config.as_ref().and_then(|t| t.bos_token_id),
            "pad_token_id": h.tokenizer_config.as_ref().and_then(|t| t.pad_token_id),
        },
        "tensor_count": model.len(),
        "tensor_bytes": tensor_bytes(model),
        "by_dtype": by_dtype.iter().map(|(k, s)| (k.to_string(), json!({"count": s.count, "bytes": s.bytes}))).collect::<serde_json::Map<_, _>>(),
    });
    if let Some(list) = listing {
        out["tensors"] = list
            .iter()
            .map(|t| {
                json!({
                    "name": t.name,
                    "dtype": t.dtype.name(),
                    "dtype_id": Dtype::id(t.dtype),
                    "shape": t.shape.as_slice(),
                    "bytes": t.data.len(),
                    "offset": t.file_offset,
                    "hash": format!("{:016x}", t.hash),
                })
            })
            .collect();
    }
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

/// How the header spells an enum value (`Q4_BLOCK`, `gemma`, ...).
fn serde_name(v: &impl serde::Serialize) -> String {
    match serde_json::to_value(v) {
        Ok(serde_json::Value::String(s)) => s,
        other => format!("{other:?}"),
    }
}
