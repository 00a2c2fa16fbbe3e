//! Against llama.cpp on the SmolLM2-135M-Instruct Q4_1 demo model (`fixtures/llamacpp`, made by
//! `scripts/llamacpp_reference.sh`): the GGUF is imported with cmf-convert's `import-gguf`
//! (default codecs), then
//! - tokenization: identical ids on the 26 strings of `tokenize.json`, special tokens parsed
//!   and not parsed;
//! - chat prompts: the file's template renders the six `greedy.json` conversations to the text
//!   and ids llama.cpp's Jinja engine produced;
//! - greedy: see `smollm2_greedy_follows_llamacpp` for what can and cannot agree, and why;
//! - perplexity on `fixtures/text/kjv-excerpt.txt` at ctx 512 within 1 % of llama-perplexity.
//!
//! The 98 MB GGUF is not in the repository. The tests look for it at `$CMF_SMOLLM2_GGUF`, then
//! `$CMF_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf`, then `~/.cache/cmf/…`
//! (`scripts/fetch-demo-model.sh` downloads it there); without it they print why and pass.

mod common;
use cmf_convert::{Options, Quant};
use cmf_format::CmfModel;
use cmf_llm::chat::{Message, TextAssets};
use cmf_llm::perplexity::perplexity;
use cmf_llm::sampling::argmax;
use cmf_llm::Model;
use serde_json::Value;
use std::path::PathBuf;
use std::sync::OnceLock;

const GGUF_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

fn find_gguf() -> Option<PathBuf> {
    let candidates = [
        std::env::var_os("CMF_SMOLLM2_GGUF").map(PathBuf::from),
        std::env::var_os("CMF_CACHE").map(|d| PathBuf::from(d).join(GGUF_NAME)),
        std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/cmf").join(GGUF_NAME)),
    ];
    candidates.into_iter().flatten().find(|p| p.is_file())
}

/// The demo model imported once per test binary (default codecs, or `quant`).
fn demo_model(quant: Option<Quant>) -> Option<&'static CmfModel> {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    static DEFAULT: OnceLock<Option<CmfModel>> = OnceLock::new();
    static F32: OnceLock<Option<CmfModel>> = OnceLock::new();
    let cell = if quant.is_none() { &DEFAULT } else { &F32 };
    cell.get_or_init(|| {
        let Some(gguf) = find_gguf() else {
            eprintln!("SKIPPED: {GGUF_NAME} not found (set CMF_SMOLLM2_GGUF or CMF_CACHE; scripts/fetch-demo-model.sh fetches it)");
            return None;
        };
        let dir = DIR.get_or_init(|| common::scratch_dir("llamacpp_parity"));
        let out = dir.join(format!("smollm2-{}.cmf", quant.map_or("default", |q| q.name())));
        cmf_convert::import_gguf::import(&gguf, &out, &Options { quant, ..Options::default() }).unwrap();
        Some(CmfModel::open(&out).unwrap())
    })
    .as_ref()
}

fn reference(name: &str) -> Value {
    common::read_json(
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../fixtures/llamacpp")
            .join(name),
    )
}

#[test]
fn smollm2_tokenizer_matches_llamacpp() {
    let Some(file) = demo_model(None) else { return };
    let assets = TextAssets::from_cmf(file).unwrap();
    let plain = assets.tokenizer.special_tokens_as_text();
    let cases = reference("tokenize.json");
    let cases = cases["cases"].as_array().unwrap();
    assert!(cases.len() >= 20);
    for c in cases {
        let text = c["text"].as_str().unwrap();
        assert_eq!(
            assets.tokenizer.encode(text, true).unwrap(),
            common::ids(&c["parse_special"]),
            "{text:?}"
        );
        assert_eq!(
            plain.encode(text, true).unwrap(),
            common::ids(&c["no_parse_special"]),
            "{text:?} (special as text)"
        );
    }
}

/// Greedy ids of `model` after `prompt`, `n` steps, every sampled id fed back.
fn greedy(model: &Model, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut st = model.new_state(prompt.len() + n).unwrap();
    let mut logits = model.prefill(&mut st, prompt).unwrap().to_vec();
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let t = argmax(&logits);
        out.push(t);
        if out.len() < n {
            logits = model.decode(&mut st, t).unwrap().to_vec();
        }
    }
    out
}

#[test]
fn smollm2_chat_prompts_render_like_llamacpp() {
    let Some(file) = demo_model(None) else { return };
    let assets = TextAssets::from_cmf(file).unwrap();
    let refs = reference("greedy.json");
    for p in refs["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["kind"] == "chat")
    {
        let msgs: Vec<_> = p["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| Message::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
            .collect();
        let text = assets.template.render(&msgs, true).unwrap();
        assert_eq!(
            text,
            p["prompt_text"].as_str().unwrap(),
            "{}: template rendering",
            p["name"]
        );
        assert_eq!(
            assets.tokenizer.encode(&text, false).unwrap(),
            common::ids(&p["prompt_ids"]),
            "{}",
            p["name"]
        );
    }
}

/// With the weights evaluated exactly (`import-gguf --quant f32`: Q4_1/Q8_0 dequantized to f32),
/// the logits equal those of transformers on the same dequantized GGUF
/// (`tests/data/smollm2_dequant_logits.json`, made by `scripts/make_smollm2_dequant_reference.py`):
/// the 20 largest logits at the last position of each prompt within 2e-3 (logits ≈ 25; measured
/// worst difference ≈ 1e-4), same order.
#[test]
fn smollm2_exact_weights_match_transformers() {
    let Some(file) = demo_model(Some(Quant::F32)) else {
        return;
    };
    let model = Model::load(file).unwrap();
    let refs = common::read_json(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/smollm2_dequant_logits.json"),
    );
    for p in refs["prompts"].as_array().unwrap() {
        let prompt = common::ids(&p["prompt_ids"]);
        let mut st = model.new_state(prompt.len()).unwrap();
        let logits = model.prefill(&mut st, &prompt).unwrap();
        let mut worst = 0f64;
        for e in p["top20"].as_array().unwrap() {
            worst = worst.max(
                (logits[e[0].as_u64().unwrap() as usize] as f64 - e[1].as_f64().unwrap()).abs(),
            );
        }
        println!(
            "{}: worst |Δ| over the top 20 logits {worst:.2e}",
            p["name"]
        );
        assert!(worst < 2e-3, "{}: {worst}", p["name"]);
        assert_eq!(argmax(logits) as u64, p["top20"][0][0].as_u64().unwrap());
    }
}

/// Greedy decoding with the weights evaluated exactly (`import-gguf --quant f32`): on three of
/// the six `greedy.json` prompts all 64 free-running ids equal llama.cpp's. On the other three
/// (chat_capital_france, raw_story, raw_kjv) a step where llama.cpp's top-1/top-2 margin is small
/// (≤ 0.24, measured: docs/llm.md) flips under its 8-bit activations, and the continuations part
/// there; their agreeing prefix is printed, not asserted.
#[test]
fn smollm2_exact_weights_greedy_equals_llamacpp_for_64_tokens() {
    const IDENTICAL: [&str; 3] = [
        "chat_capital_france_system",
        "chat_system_haiku",
        "raw_code",
    ];
    let Some(file) = demo_model(Some(Quant::F32)) else {
        return;
    };
    let model = Model::load(file).unwrap();
    let refs = reference("greedy.json");
    let mut checked = 0;
    for p in refs["prompts"].as_array().unwrap() {
        let name = p["name"].as_str().unwrap();
        let prompt = common::ids(&p["prompt_ids"]);
        let want = common::ids(&p["generated_ids"]);
        assert_eq!(want.len(), 64, "{name}");
        let got = greedy(&model, &prompt, want.len());
        let prefix = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
        println!("{name} (exact weights): free-running ids equal llama.cpp's for {prefix}/64");
        if IDENTICAL.contains(&name) {
            assert_eq!(got, want, "{name}: differs from llama.cpp at id {prefix}");
            checked += 1;
        }
    }
    assert_eq!(checked, IDENTICAL.len());
}

/// Greedy decoding against llama.cpp. Identical 64-token continuations are not attainable by an
/// engine that computes exactly: llama.cpp quantizes the activations to 8 bits (Q8_1/Q8_0) inside
/// its Q4_1/Q8_0 products, which moves logit gaps by up to ~0.8 (measured by emulating only that
/// on the exact weights in transformers), and its top-1/top-2 margins in these continuations go
/// down to 0.019. Measured (docs/llm.md): our logit gaps differ from llama.cpp's by up to 1.5
/// along its continuations, and the argmax differs only at steps where llama.cpp's margin is at
/// most 0.55. So the test requires, teacher-forced along llama.cpp's 64 ids of each prompt:
/// the same argmax at every step whose llama.cpp margin exceeds 1.0 — and, free-running, the
/// demo answer: the same ids as llama.cpp up to and including its first end-of-generation token
/// ("The capital of France is Paris.").
#[test]
fn smollm2_greedy_follows_llamacpp() {
    const MARGIN: f64 = 1.0;
    let Some(file) = demo_model(None) else { return };
    let model = Model::load(file).unwrap();
    let refs = reference("greedy.json");
    let mut failures = Vec::new();
    for p in refs["prompts"].as_array().unwrap() {
        let name = p["name"].as_str().unwrap();
        let prompt = common::ids(&p["prompt_ids"]);
        let want = common::ids(&p["generated_ids"]);
        let mut st = model.new_state(prompt.len() + want.len()).unwrap();
        let mut logits = model.prefill(&mut st, &prompt).unwrap().to_vec();
        let (mut flips, mut required) = (0, 0);
        for (i, step) in p["steps"].as_array().unwrap().iter().enumerate() {
            let margin = step["margin"].as_f64().unwrap();
            let agree = argmax(&logits) == want[i];
            flips += usize::from(!agree);
            if margin > MARGIN {
                required += 1;
                if !agree {
                    failures.push(format!(
                        "{name} step {i}: {} vs llama.cpp {} (margin {margin})",
                        argmax(&logits),
                        want[i]
                    ));
                }
            }
            if i + 1 < want.len() {
                logits = model.decode(&mut st, want[i]).unwrap().to_vec();
            }
        }
        let free = greedy(&model, &prompt, want.len());
        let prefix = free.iter().zip(&want).take_while(|(a, b)| a == b).count();
        println!("{name}: teacher-forced argmax differs at {flips}/64 steps ({required} steps had margin > {MARGIN}); free-running agrees for {prefix}/64 ids");
        if let Some(eog) = p["first_eog_index"].as_u64() {
            if name == "chat_capital_france_system" && prefix <= eog as usize {
                failures.push(format!("{name}: free-running differs at {prefix}, before llama.cpp's end of generation at {eog}"));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn smollm2_perplexity_within_1pct_of_llamacpp() {
    let Some(file) = demo_model(None) else { return };
    let model = Model::load(file).unwrap();
    let assets = TextAssets::from_cmf(file).unwrap();
    let refs = reference("ppl.json");
    let text = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/text/kjv-excerpt.txt"),
    )
    .unwrap();
    let tokens = assets.tokenizer.encode(&text, true).unwrap();
    assert_eq!(
        tokens.len() as u64,
        refs["n_tokens"].as_u64().unwrap(),
        "token count differs from llama.cpp's"
    );
    let r = perplexity(&model, &tokens, 512, None, None, &mut |_, _| {}).unwrap();
    let want = refs["final_ppl"].as_f64().unwrap();
    println!(
        "PPL {:.4} ± {:.5} (llama.cpp {want}), {} chunks",
        r.ppl, r.ppl_stderr, r.chunks
    );
    assert_eq!(r.chunks as u64, refs["n_chunks"].as_u64().unwrap());
    assert!(
        (r.ppl / want - 1.0).abs() < 0.01,
        "PPL {} vs llama.cpp {want}",
        r.ppl
    );
}
