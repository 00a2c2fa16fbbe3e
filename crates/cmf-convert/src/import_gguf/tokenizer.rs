//! GGUF tokenizer metadata → an equivalent Hugging Face `tokenizer.json`.
//!
//! The target is *llama.cpp's* behaviour on the same GGUF (the reference the engine is tested
//! against), expressed with the `tokenizers` building blocks:
//! - `gpt2` (byte-level BPE, SmolLM2/Qwen/Llama 3): the pre-tokenizer regexes llama.cpp uses for
//!   the `tokenizer.ggml.pre` name (`src/llama-vocab.cpp`, `llm_tokenizer_bpe` constructor) become
//!   a sequence of `Split(Isolated)` steps — llama.cpp's `unicode_regex_split` keeps both matches
//!   and the text between them, exactly as `Isolated` does — followed by a `ByteLevel` step without
//!   its own regex. `ignore_merges` and the BOS default follow the same table
//!   (`llama_vocab::impl::load`).
//! - `llama` (SentencePiece BPE with byte fallback, Llama 2/Mistral): the normalizer, decoder and
//!   model of transformers' `LlamaConverter` (legacy mode), with merges derived from the scores the
//!   way transformers' `SentencePieceExtractor` does — llama.cpp's `llm_tokenizer_spm` merges the
//!   adjacent pair whose concatenation has the highest score, which is BPE with merge ranks
//!   ordered by that score.
//!
//! Token types (`tokenizer.ggml.token_type`, `llama_token_type`): CONTROL (3) tokens become
//! special added tokens, USER_DEFINED (4) non-special added tokens; both are split out of the
//! input before the model runs, as llama.cpp's `tokenizer_st_partition` does with special parsing
//! enabled.

use std::collections::{HashMap, HashSet};

use serde_json::{json, Map, Value as Json};

use crate::gguf::{Gguf, Value, ValueType};

const TOKEN_NORMAL: i32 = 1;
const TOKEN_UNKNOWN: i32 = 2;
const TOKEN_CONTROL: i32 = 3;
const TOKEN_USER_DEFINED: i32 = 4;
const TOKEN_BYTE: i32 = 6;

/// The GPT-2 pre-tokenizer regex (also the second step of several other pre types).
const GPT2_REGEX: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
const LLAMA3_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN35_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const TEKKEN_REGEX: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Token texts llama.cpp adds to its end-of-generation set when they are control tokens
/// (`llama_vocab::impl::load`, the `special_eog_ids` text heuristics; common subset).
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<EOT>",
];

/// How llama.cpp pre-tokenizes for one `tokenizer.ggml.pre` name.
struct PreTokenizer {
    regexes: &'static [&'static str],
    ignore_merges: bool,
    /// llama.cpp's default for `add_bos` when `tokenizer.ggml.add_bos_token` is absent.
    add_bos_default: bool,
}

fn pre_tokenizer_for(pre: &str) -> Option<PreTokenizer> {
    let p = |regexes, ignore_merges, add_bos_default| {
        Some(PreTokenizer {
            regexes,
            ignore_merges,
            add_bos_default,
        })
    };
    match pre {
        "" | "default" => p(
            &[
                r"[\p{P}\$\+<=>\^~\|]+",
                GPT2_REGEX,
                r"\p{N}+",
                "[0-9][0-9][0-9]",
            ],
            false,
            false,
        ),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "pixtral" => {
            p(&[LLAMA3_REGEX], true, true)
        }
        "gpt-2" | "phi-2" | "roberta-bpe" | "mpt" | "olmo" => p(&[GPT2_REGEX], false, false),
        "qwen2" | "deepseek-r1-qwen" | "stablelm2" | "megrez" => p(&[QWEN2_REGEX], false, false),
        "qwen35" => p(&[QWEN35_REGEX], false, false),
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => {
            p(&[r"\p{N}", GPT2_REGEX], false, false)
        }
        "tekken" => p(&[TEKKEN_REGEX], true, true),
        _ => None,
    }
}

/// The tokenizer rebuilt from a GGUF file, with the special ids the CMF header records.
#[derive(Debug, Clone)]
pub struct RebuiltTokenizer {
    /// The Hugging Face `tokenizer.json` document.
    pub json: Json,
    pub bos_token_id: Option<u32>,
    /// Every id that ends generation, `tokenizer.ggml.eos_token_id` first.
    pub eos_token_ids: Vec<u32>,
    pub pad_token_id: Option<u32>,
    pub add_bos: bool,
    pub chat_template: Option<String>,
    /// `tokenizer.ggml.model` and `tokenizer.ggml.pre`, for provenance.
    pub model: String,
    pub pre: String,
    /// Entries in `tokenizer.ggml.tokens`.
    pub n_tokens: usize,
}

/// What went wrong, naming the metadata key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("GGUF tokenizer, key '{key}': {message}")]
pub struct TokenizerError {
    pub key: String,
    pub message: String,
}

fn err(key: &str, message: impl Into<String>) -> TokenizerError {
    TokenizerError {
        key: key.into(),
        message: message.into(),
    }
}

fn string_array<'a>(g: &'a Gguf, key: &str) -> Result<Vec<&'a str>, TokenizerError> {
    match g.get(key).and_then(Value::as_array) {
        Some((ValueType::String, items)) => Ok(items
            .iter()
            .map(|v| v.as_str().expect("typed array"))
            .collect()),
        Some((t, _)) => Err(err(
            key,
            format!(
                "expected an array of strings, found an array of {}",
                t.name()
            ),
        )),
        None => Err(err(key, "missing")),
    }
}

fn optional_id(g: &Gguf, key: &str, n_vocab: usize) -> Result<Option<u32>, TokenizerError> {
    let Some(v) = g.get(key) else { return Ok(None) };
    // llama.cpp writes -1 (as u32::MAX or i32 -1) for "none".
    if v.as_int() == Some(-1) || v.as_int() == Some(u32::MAX as i128) {
        return Ok(None);
    }
    match v.as_u64() {
        Some(id) if (id as usize) < n_vocab => Ok(Some(id as u32)),
        Some(id) => Err(err(
            key,
            format!("token id {id} is outside the vocabulary of {n_vocab}"),
        )),
        None => Err(err(
            key,
            format!("expected a token id, found {}", v.summary()),
        )),
    }
}

fn optional_bool(g: &Gguf, key: &str) -> Result<Option<bool>, TokenizerError> {
    match g.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_bool()
            .map(Some)
            .ok_or_else(|| err(key, format!("expected a bool, found {}", v.summary()))),
    }
}

/// Longest token text accepted. Real vocabularies stay under a few hundred bytes; deriving
/// SentencePiece merges costs the square of a token's length, so one 300 000-byte token would
/// take seconds.
pub const MAX_TOKEN_BYTES: usize = 1024;

/// Rebuilds the tokenizer of `g`. Errors name the metadata key at fault; an unknown tokenizer
/// model or pre-tokenizer name is refused rather than approximated.
pub fn rebuild(g: &Gguf) -> Result<RebuiltTokenizer, TokenizerError> {
    let model_key = "tokenizer.ggml.model";
    let model = g
        .get(model_key)
        .ok_or_else(|| err(model_key, "missing: the GGUF file carries no tokenizer"))?
        .as_str()
        .ok_or_else(|| err(model_key, "expected a string"))?
        .to_owned();
    let tokens = string_array(g, "tokenizer.ggml.tokens")?;
    let n = tokens.len();
    if n == 0 {
        return Err(err("tokenizer.ggml.tokens", "empty vocabulary"));
    }
    if let Some((i, t)) = tokens
        .iter()
        .enumerate()
        .find(|(_, t)| t.len() > MAX_TOKEN_BYTES)
    {
        return Err(err(
            "tokenizer.ggml.tokens",
            format!(
                "token #{i} is {} bytes long, above the limit of {MAX_TOKEN_BYTES}",
                t.len()
            ),
        ));
    }
    let types: Vec<i32> = match g.get("tokenizer.ggml.token_type").and_then(Value::as_array) {
        None => vec![TOKEN_NORMAL; n],
        Some((_, items)) => {
            let t: Option<Vec<i32>> = items
                .iter()
                .map(|v| v.as_int().and_then(|i| i32::try_from(i).ok()))
                .collect();
            let t =
                t.ok_or_else(|| err("tokenizer.ggml.token_type", "expected an array of integers"))?;
            if t.len() != n {
                return Err(err(
                    "tokenizer.ggml.token_type",
                    format!("has {} entries for {n} tokens", t.len()),
                ));
            }
            t
        }
    };
    let bos = optional_id(g, "tokenizer.ggml.bos_token_id", n)?;
    let eos = optional_id(g, "tokenizer.ggml.eos_token_id", n)?;
    let pad = optional_id(g, "tokenizer.ggml.padding_token_id", n)?;
    let unk = optional_id(g, "tokenizer.ggml.unknown_token_id", n)?;
    let add_bos_key = optional_bool(g, "tokenizer.ggml.add_bos_token")?;
    let add_eos = optional_bool(g, "tokenizer.ggml.add_eos_token")?.unwrap_or(false);
    let pre = match g.get("tokenizer.ggml.pre") {
        None => String::new(),
        Some(v) => v
            .as_str()
            .ok_or_else(|| err("tokenizer.ggml.pre", "expected a string"))?
            .to_owned(),
    };

    let (model_json, normalizer, pre_tokenizer, decoder, add_bos_default) = match model.as_str() {
        "gpt2" => {
            let spec = pre_tokenizer_for(&pre).ok_or_else(|| {
                err("tokenizer.ggml.pre", format!("pre-tokenizer '{pre}' is not supported (known: llama-bpe, qwen2, smollm, gpt-2, default, ...)"))
            })?;
            let merges = merges(g)?;
            let mut steps: Vec<Json> = spec
                .regexes
                .iter()
                .map(|r| json!({"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": false}))
                .collect();
            steps.push(json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}));
            let model = json!({
                "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                "ignore_merges": spec.ignore_merges,
                "vocab": vocab_map(&tokens, |_| true), "merges": merges,
            });
            let decoder = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false});
            (
                model,
                Json::Null,
                json!({"type": "Sequence", "pretokenizers": steps}),
                decoder,
                spec.add_bos_default,
            )
        }
        "llama" => {
            let add_space_prefix =
                optional_bool(g, "tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
            let (model, normalizer, decoder) =
                sentencepiece_bpe(g, &tokens, &types, unk, add_space_prefix)?;
            (model, normalizer, Json::Null, decoder, true)
        }
        other => {
            return Err(err(
                model_key,
                format!("tokenizer model '{other}' is not supported (supported: gpt2, llama)"),
            ));
        }
    };
    let add_bos = add_bos_key.unwrap_or(add_bos_default) && bos.is_some();

    let mut added = Vec::new();
    for (id, (&text, &ty)) in tokens.iter().zip(&types).enumerate() {
        let special = match ty {
            TOKEN_CONTROL => true,
            TOKEN_USER_DEFINED => false,
            // SentencePiece's <unk>/<s>/</s> are stored as UNKNOWN/CONTROL; keep <unk> special too.
            TOKEN_UNKNOWN if model == "llama" => true,
            _ => continue,
        };
        added.push(json!({
            "id": id, "content": text, "single_word": false, "lstrip": false, "rstrip": false,
            "normalized": false, "special": special,
        }));
    }

    let post_processor = post_processor(
        &tokens,
        if add_bos { bos } else { None },
        if add_eos { eos } else { None },
    );

    let json = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": decoder,
        "model": model_json,
    });

    let mut eos_ids: Vec<u32> = eos.into_iter().collect();
    for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
        if let Some(id) = optional_id(g, key, n)? {
            eos_ids.push(id);
        }
    }
    for (id, (&text, &ty)) in tokens.iter().zip(&types).enumerate() {
        if ty == TOKEN_CONTROL && EOG_TEXTS.contains(&text) {
            eos_ids.push(id as u32);
        }
    }
    let mut seen = HashSet::new();
    eos_ids.retain(|id| seen.insert(*id));

    let chat_template = match g.get("tokenizer.chat_template") {
        None => None,
        Some(v) => Some(
            v.as_str()
                .ok_or_else(|| err("tokenizer.chat_template", "expected a string"))?
                .to_owned(),
        ),
    };
    Ok(RebuiltTokenizer {
        json,
        bos_token_id: bos,
        eos_token_ids: eos_ids,
        pad_token_id: pad,
        add_bos,
        chat_template,
        model,
        pre,
        n_tokens: n,
    })
}

/// token → id. On duplicate texts the later id wins, as in llama.cpp's `token_to_id`.
fn vocab_map(tokens: &[&str], keep: impl Fn(usize) -> bool) -> Map<String, Json> {
    let mut m = Map::new();
    for (id, t) in tokens.iter().enumerate() {
        if keep(id) {
            m.insert((*t).to_owned(), json!(id));
        }
    }
    m
}

/// `tokenizer.ggml.merges` as `[left, right]` pairs. llama.cpp splits each entry at the first
/// space after the first byte (`llama_vocab::impl::load`: `word.find(' ', 1)`).
fn merges(g: &Gguf) -> Result<Vec<Json>, TokenizerError> {
    let key = "tokenizer.ggml.merges";
    let raw = string_array(g, key)?;
    raw.iter()
        .enumerate()
        .map(|(i, m)| {
            // Byte offsets, as std::string::find: a space byte is always a char boundary.
            let pos = m
                .as_bytes()
                .iter()
                .skip(1)
                .position(|&b| b == b' ')
                .map(|p| p + 1);
            match pos {
                Some(p) => Ok(json!([&m[..p], &m[p + 1..]])),
                None => Err(err(
                    key,
                    format!("merge #{i} {m:?} has no separating space"),
                )),
            }
        })
        .collect()
}

fn post_processor(tokens: &[&str], bos: Option<u32>, eos: Option<u32>) -> Json {
    if bos.is_none() && eos.is_none() {
        return Json::Null;
    }
    let special = |id: u32| json!({"SpecialToken": {"id": tokens[id as usize], "type_id": 0}});
    let seq = |name: &str, type_id: u32| json!({"Sequence": {"id": name, "type_id": type_id}});
    let mut single = Vec::new();
    let mut pair = Vec::new();
    let mut specials = Map::new();
    for id in [bos, eos].into_iter().flatten() {
        let t = tokens[id as usize];
        specials.insert(t.to_owned(), json!({"id": t, "ids": [id], "tokens": [t]}));
    }
    if let Some(b) = bos {
        single.push(special(b));
        pair.push(special(b));
    }
    single.push(seq("A", 0));
    pair.push(seq("A", 0));
    if let Some(e) = eos {
        single.push(special(e));
        pair.push(special(e));
    }
    if let Some(b) = bos {
        pair.push(json!({"SpecialToken": {"id": tokens[b as usize], "type_id": 1}}));
    }
    pair.push(seq("B", 1));
    if let Some(e) = eos {
        pair.push(json!({"SpecialToken": {"id": tokens[e as usize], "type_id": 1}}));
    }
    json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials})
}

/// SentencePiece BPE (Llama 2 / Mistral v0.1 style): model, normalizer and decoder.
fn sentencepiece_bpe(
    g: &Gguf,
    tokens: &[&str],
    types: &[i32],
    unk: Option<u32>,
    add_space_prefix: bool,
) -> Result<(Json, Json, Json), TokenizerError> {
    let key = "tokenizer.ggml.scores";
    let scores: Vec<f32> = match g.get(key).and_then(Value::as_array) {
        Some((ValueType::F32, items)) => items
            .iter()
            .map(|v| v.as_f64().expect("typed array") as f32)
            .collect(),
        Some((t, _)) => {
            return Err(err(
                key,
                format!("expected an array of float32, found {}", t.name()),
            ))
        }
        None => return Err(err(key, "missing (needed to derive SentencePiece merges)")),
    };
    if scores.len() != tokens.len() {
        return Err(err(
            key,
            format!("has {} entries for {} tokens", scores.len(), tokens.len()),
        ));
    }
    // Only normal (and user-defined) pieces take part in merging; byte and control tokens do not
    // (llama.cpp's `llm_tokenizer_spm` looks pieces up by text, and byte/control texts such as
    // "<0x41>" or "<s>" never arise from merging characters).
    let mergeable: HashMap<&str, usize> = tokens
        .iter()
        .enumerate()
        .filter(|&(id, _)| matches!(types[id], TOKEN_NORMAL | TOKEN_USER_DEFINED))
        .map(|(id, t)| (*t, id))
        .collect();
    // transformers' SentencePieceExtractor: every split of a piece into two pieces is a merge,
    // ranked by the merged piece's score (highest first), ties by the merged piece's id, then by
    // the left piece's id.
    let mut merges: Vec<(f32, usize, usize, &str, &str)> = Vec::new();
    for (&piece, &id) in &mergeable {
        for (split, _) in piece.char_indices().skip(1) {
            let (l, r) = piece.split_at(split);
            if let (Some(&li), Some(_)) = (mergeable.get(l), mergeable.get(r)) {
                merges.push((scores[id], id, li, l, r));
            }
        }
    }
    merges.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let merges: Vec<Json> = merges
        .into_iter()
        .map(|(_, _, _, l, r)| json!([l, r]))
        .collect();
    let vocab = vocab_map(tokens, |_| true);
    let unk_token = unk.map(|u| tokens[u as usize]);
    let has_bytes = types.contains(&TOKEN_BYTE);
    let model = json!({
        "type": "BPE", "dropout": null, "unk_token": unk_token, "continuing_subword_prefix": null,
        "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": has_bytes, "ignore_merges": false,
        "vocab": vocab, "merges": merges,
    });
    let mut norm = Vec::new();
    if add_space_prefix {
        norm.push(json!({"type": "Prepend", "prepend": "▁"}));
    }
    norm.push(json!({"type": "Replace", "pattern": {"String": " "}, "content": "▁"}));
    let mut dec = vec![
        json!({"type": "Replace", "pattern": {"String": "▁"}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if add_space_prefix {
        dec.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    Ok((
        model,
        json!({"type": "Sequence", "normalizers": norm}),
        json!({"type": "Sequence", "decoders": dec}),
    ))
}
