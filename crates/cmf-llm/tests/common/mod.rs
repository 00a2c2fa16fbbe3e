//! Test helpers: the committed transformers fixtures (`fixtures/llm/*`) read without Python.
#![allow(dead_code)]

use cmf_format::Dtype;
use cmf_llm::{TensorRef, TensorSource};
use safetensors::SafeTensors;
use serde_json::Value;
use std::path::PathBuf;

pub const FIXTURES: [&str; 4] = ["llama-tiny", "mistral-tiny", "qwen2-tiny", "qwen3-tiny"];
/// The mixture-of-experts fixtures (same tokenizer and templates as the dense ones).
pub const MOE_FIXTURES: [&str; 3] = ["qwen3-moe-tiny", "qwen3-moe-unnorm-tiny", "qwen2-moe-tiny"];

/// A transformers fixture (`fixtures/llm/<name>`, found as `cmf_test_support::fixtures` says).
pub fn fixture_dir(name: &str) -> PathBuf {
    cmf_test_support::fixtures::path("llm").join(name)
}

pub fn read_json(path: PathBuf) -> Value {
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The safetensors files of a Hugging Face model directory (single file or sharded).
pub fn read_weight_files(dir: &std::path::Path) -> Vec<Vec<u8>> {
    let single = dir.join("model.safetensors");
    if single.exists() {
        return vec![std::fs::read(single).unwrap()];
    }
    let index = read_json(dir.join("model.safetensors.index.json"));
    let mut files: Vec<String> = index["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    files.sort();
    files.dedup();
    files
        .iter()
        .map(|f| std::fs::read(dir.join(f)).unwrap())
        .collect()
}

/// Tensors straight from safetensors files (f32/f16/bf16), as a [`TensorSource`].
pub struct SafetensorsSource<'a>(pub Vec<SafeTensors<'a>>);

impl<'a> SafetensorsSource<'a> {
    pub fn new(files: &'a [Vec<u8>]) -> Self {
        SafetensorsSource(
            files
                .iter()
                .map(|b| SafeTensors::deserialize(b).unwrap())
                .collect(),
        )
    }
}

impl<'a> TensorSource<'a> for SafetensorsSource<'a> {
    fn tensor(&self, name: &str) -> Option<TensorRef<'a>> {
        let t = self.0.iter().find_map(|s| s.tensor(name).ok())?;
        let dtype = match t.dtype() {
            safetensors::Dtype::F32 => Dtype::F32,
            safetensors::Dtype::F16 => Dtype::F16,
            safetensors::Dtype::BF16 => Dtype::Bf16,
            other => panic!("{name}: unexpected dtype {other:?}"),
        };
        Some(TensorRef {
            dtype,
            shape: t.shape().to_vec(),
            data: t.data(),
        })
    }
}

/// A `[rows, cols]` f32 tensor of `expected.safetensors`.
pub fn expected_matrix(dir: &std::path::Path, name: &str) -> (Vec<f32>, usize) {
    let bytes = std::fs::read(dir.join("expected.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(name).unwrap();
    assert_eq!(t.dtype(), safetensors::Dtype::F32);
    let v = t
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    (v, t.shape()[1])
}

/// Fixture `name`'s model (its safetensors and config), tokenizer and `expected.json` prompt
/// ids; `f` gets them.
pub fn with_fixture<R>(
    name: &str,
    f: impl FnOnce(&cmf_llm::Model, &cmf_llm::chat::Tokenizer, &[u32]) -> R,
) -> R {
    let dir = fixture_dir(name);
    let files = read_weight_files(&dir);
    let source = SafetensorsSource::new(&files);
    let config = cmf_llm::ModelConfig::from_json(&read_json(dir.join("config.json"))).unwrap();
    let model = cmf_llm::Model::from_source(&source, config, "").unwrap();
    let tok_json = std::fs::read(dir.join("tokenizer.json")).unwrap();
    let tok = cmf_llm::chat::Tokenizer::from_bytes(&tok_json).unwrap();
    let prompt = ids(&read_json(dir.join("expected.json"))["prompt_ids"]);
    f(&model, &tok, &prompt)
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// max |a − b| / max |b| — the per-row relative error the fixtures README prescribes.
pub fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    let num = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    let den = b.iter().map(|y| y.abs()).fold(0f32, f32::max);
    num / den
}

pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Writes fixture `name` as a CMF file with every matrix in `matrix_dtype` (1-D tensors f32),
/// the header built from `config.json` the way a converter would (HF extras such as
/// `rope_scaling` carried in `arch`), tokenizer and chat template included. A stand-in for
/// `cmf convert` in tests of the CMF path and of the quantized codecs.
pub fn write_cmf(name: &str, matrix_dtype: Dtype, out: &std::path::Path) {
    use cmf_format::{Arch, CmfWriter, Header, LayerType, QuantType, TokenizerConfig};
    let dir = fixture_dir(name);
    let cfg = read_json(dir.join("config.json"));
    let c = cfg.as_object().unwrap();
    let u = |k: &str| c[k].as_u64().unwrap() as usize;
    let mut arch = Arch {
        arch_name: c["model_type"].as_str().unwrap().to_string(),
        hidden_size: u("hidden_size"),
        intermediate_size: u("intermediate_size"),
        num_layers: u("num_hidden_layers"),
        num_attention_heads: u("num_attention_heads"),
        num_kv_heads: u("num_key_value_heads"),
        head_dim: c
            .get("head_dim")
            .and_then(|v| v.as_u64())
            .map(|v| v as usize)
            .unwrap_or(u("hidden_size") / u("num_attention_heads")),
        vocab_size: u("vocab_size"),
        layer_types: vec![LayerType::FullAttention; u("num_hidden_layers")],
        rms_norm_eps: c["rms_norm_eps"].as_f64().unwrap(),
        max_position_embeddings: u("max_position_embeddings"),
        tie_word_embeddings: c
            .get("tie_word_embeddings")
            .and_then(|v| v.as_bool())
            .unwrap_or(false),
        sliding_window: c
            .get("sliding_window")
            .and_then(|v| v.as_u64())
            .map(|v| v as usize),
        ..Arch::default()
    };
    if let Some(t) = c.get("rope_theta").and_then(|v| v.as_f64()) {
        arch.rope_theta = t;
    }
    for key in [
        "rope_scaling",
        "rope_parameters",
        "attention_bias",
        "hidden_act",
        "use_sliding_window",
        // MoE geometry in its Hugging Face spelling (the runtime reads either).
        "num_local_experts",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "shared_expert_intermediate_size",
        "mlp_only_layers",
        "decoder_sparse_step",
    ] {
        if let Some(v) = c.get(key) {
            arch.extra.insert(key.to_string(), v.clone());
        }
    }
    let tok_cfg = read_json(dir.join("tokenizer_config.json"));
    let gen_cfg = read_json(dir.join("generation_config.json"));
    let eos: Vec<u32> = match &gen_cfg["eos_token_id"] {
        serde_json::Value::Array(a) => a.iter().map(|v| v.as_u64().unwrap() as u32).collect(),
        serde_json::Value::Number(n) => vec![n.as_u64().unwrap() as u32],
        _ => Vec::new(),
    };
    let mut header = Header::new(arch, QuantType::F32);
    let mut tc = TokenizerConfig {
        chat_template: tok_cfg["chat_template"].as_str().map(str::to_string),
        eos_token_ids: eos,
        bos_token_id: gen_cfg["bos_token_id"].as_u64().map(|v| v as u32),
        pad_token_id: gen_cfg["pad_token_id"].as_u64().map(|v| v as u32),
        ..Default::default()
    };
    for key in ["bos_token", "eos_token", "pad_token", "unk_token"] {
        if let Some(s) = tok_cfg[key].as_str() {
            tc.extra
                .insert(key.to_string(), serde_json::Value::String(s.to_string()));
        }
    }
    header.tokenizer_config = Some(tc);
    let mut w = CmfWriter::create(out, header).unwrap();
    w.set_vocab(std::fs::read(dir.join("tokenizer.json")).unwrap());
    let files = read_weight_files(&dir);
    let src = SafetensorsSource::new(&files);
    let mut names: Vec<String> = src
        .0
        .iter()
        .flat_map(|s| s.names().into_iter().map(str::to_string))
        .collect();
    names.sort();
    for n in names {
        let t = src.tensor(&n).unwrap();
        let values = cmf_format::codec::decode_vec(t.dtype, &t.shape, t.data).unwrap();
        let dtype = if t.shape.len() == 2 {
            matrix_dtype
        } else {
            Dtype::F32
        };
        w.add_f32(&n, dtype, &t.shape, &values).unwrap();
    }
    w.finish().unwrap();
}

/// How a model compares with a fixture's transformers outputs.
#[derive(Debug)]
pub struct Comparison {
    /// Worst per-row relative error of the teacher-forced prompt logits.
    pub prompt_err: f32,
    /// Worst per-row relative error of the greedy decode steps' logits (fed the reference ids).
    pub decode_err: f32,
    /// Greedy ids generated by the model itself.
    pub greedy: Vec<u32>,
    pub want_greedy: Vec<u32>,
}

impl Comparison {
    /// Generated ids equal to the reference before the first difference.
    pub fn greedy_agree(&self) -> usize {
        self.greedy
            .iter()
            .zip(&self.want_greedy)
            .take_while(|(a, b)| a == b)
            .count()
    }
}

pub fn compare(model: &cmf_llm::Model, name: &str) -> Comparison {
    let dir = fixture_dir(name);
    let exp = read_json(dir.join("expected.json"));
    let prompt = ids(&exp["prompt_ids"]);
    let vocab = model.config.vocab_size;

    let (want, cols) = expected_matrix(&dir, "logits");
    assert_eq!(cols, vocab);
    let mut st = model.new_state(256).unwrap();
    let mut prompt_err = 0f32;
    model
        .forward_scored(&mut st, &prompt, 0, |i, got| {
            prompt_err = prompt_err.max(rel_err(got, &want[i * vocab..(i + 1) * vocab]))
        })
        .unwrap();

    // Decode steps fed the reference ids (so a flipped token does not derail the comparison),
    // and separately the model's own greedy continuation.
    let want_greedy = ids(&exp["greedy"]["generated_ids"]);
    let (step_logits, _) = expected_matrix(&dir, "decode_logits");
    let mut st = model.new_state(256).unwrap();
    let mut logits = model.prefill(&mut st, &prompt).unwrap().to_vec();
    let mut decode_err = 0f32;
    for (i, &t) in want_greedy.iter().enumerate() {
        decode_err = decode_err.max(rel_err(&logits, &step_logits[i * vocab..(i + 1) * vocab]));
        logits = model.decode(&mut st, t).unwrap().to_vec();
    }
    let mut st = model.new_state(256).unwrap();
    let mut logits = model.prefill(&mut st, &prompt).unwrap().to_vec();
    let mut greedy = Vec::new();
    for _ in 0..want_greedy.len() {
        let t = argmax(&logits);
        greedy.push(t);
        logits = model.decode(&mut st, t).unwrap().to_vec();
    }
    Comparison {
        prompt_err,
        decode_err,
        greedy,
        want_greedy,
    }
}

/// A scratch directory `name` this test binary makes once and shares (see
/// `cmf_test_support::scratch`).
pub fn scratch_dir(name: &str) -> PathBuf {
    cmf_test_support::scratch::scratch_dir(env!("CARGO_TARGET_TMPDIR"), name)
}

#[allow(unused_imports)] // not every test binary needs a device
pub use cmf_test_support::gpu as gpu_skip;

/// The SmolLM2 demo GGUF: `$CMF_SMOLLM2_GGUF`, `$CMF_CACHE/…`, then `~/.cache/cmf/…`
/// (`scripts/fetch-demo-model.sh` puts it there); None when absent.
pub fn demo_gguf() -> Option<PathBuf> {
    const NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
    [
        std::env::var_os("CMF_SMOLLM2_GGUF").map(PathBuf::from),
        std::env::var_os("CMF_CACHE").map(|d| PathBuf::from(d).join(NAME)),
        std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/cmf").join(NAME)),
    ]
    .into_iter()
    .flatten()
    .find(|p| p.is_file())
}
