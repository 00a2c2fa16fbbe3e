//! Chat templates and tokenization against transformers on the committed fixtures
//! (`fixtures/llm/*/expected.json`: `apply_chat_template` renderings and ids, tokenizer cases).

mod common;
use cmf_llm::chat::{ChatTemplate, SpecialTokens, Tokenizer};
use common::*;
use minijinja::Value;

fn special_tokens(cfg: &serde_json::Value) -> SpecialTokens {
    let s = |k: &str| cfg[k].as_str().map(str::to_string);
    SpecialTokens {
        bos_token: s("bos_token"),
        eos_token: s("eos_token"),
        unk_token: s("unk_token"),
        pad_token: s("pad_token"),
    }
}

fn load(name: &str) -> (Tokenizer, ChatTemplate, Value) {
    let dir = fixture_dir(name);
    let tok = Tokenizer::from_bytes(&std::fs::read(dir.join("tokenizer.json")).unwrap()).unwrap();
    let cfg = read_json(dir.join("tokenizer_config.json"));
    let template =
        ChatTemplate::new(cfg["chat_template"].as_str().unwrap(), special_tokens(&cfg)).unwrap();
    // Parsed as a minijinja value so dict key order is kept (it shows in `tojson` output).
    let text = std::fs::read_to_string(dir.join("expected.json")).unwrap();
    let expected: Value = serde_json::from_str(&text).unwrap();
    (tok, template, expected)
}

fn to_ids(v: &Value) -> Vec<u32> {
    v.try_iter()
        .unwrap()
        .map(|x| u32::try_from(x).unwrap())
        .collect()
}

#[test]
fn chat_templates_render_and_tokenize_like_transformers() {
    for name in FIXTURES {
        let (tok, template, exp) = load(name);
        let cases = exp.get_attr("chat_template_cases").unwrap();
        let mut n = 0;
        for key in cases.try_iter().unwrap() {
            let case = cases.get_item(&key).unwrap();
            let tools = case.get_attr("tools").ok().filter(|t| !t.is_undefined());
            let add_gen = case.get_attr("add_generation_prompt").unwrap().is_true();
            let rendered = template
                .render_values(case.get_attr("messages").unwrap(), tools, add_gen)
                .unwrap();
            let want = case.get_attr("rendered").unwrap();
            assert_eq!(
                rendered,
                want.as_str().unwrap(),
                "{name}/{key}: rendering differs"
            );
            assert_eq!(
                tok.encode(&rendered, false).unwrap(),
                to_ids(&case.get_attr("ids").unwrap()),
                "{name}/{key}: ids differ"
            );
            n += 1;
        }
        assert!(n >= 1, "{name}: no template cases");
    }
}

#[test]
fn tokenizer_matches_transformers() {
    for name in FIXTURES {
        let (tok, _, exp) = load(name);
        let cases = exp
            .get_attr("tokenization")
            .unwrap()
            .get_attr("cases")
            .unwrap();
        for case in cases.try_iter().unwrap() {
            let text = case.get_attr("text").unwrap();
            let text = text.as_str().unwrap();
            let ids = tok.encode(text, true).unwrap();
            assert_eq!(
                ids,
                to_ids(&case.get_attr("ids").unwrap()),
                "{name}: {text:?}"
            );
            let tokens: Vec<String> = case
                .get_attr("tokens")
                .unwrap()
                .try_iter()
                .unwrap()
                .map(|t| t.as_str().unwrap().to_string())
                .collect();
            assert_eq!(
                tok.tokens(&ids)
                    .into_iter()
                    .map(Option::unwrap)
                    .collect::<Vec<_>>(),
                tokens,
                "{name}: {text:?}"
            );
            let decoded = case.get_attr("decoded").unwrap();
            assert_eq!(
                tok.decode(&ids, false).unwrap(),
                decoded.as_str().unwrap(),
                "{name}: {text:?}"
            );
        }
    }
}

/// Streaming decode, one id at a time, reassembles exactly the full decode, and never emits a
/// piece that ends inside a multi-byte character (byte-level BPE splits them across ids).
#[test]
fn streaming_decode_reassembles_multibyte_text() {
    let (tok, _, exp) = load("qwen3-tiny");
    let cases = exp
        .get_attr("tokenization")
        .unwrap()
        .get_attr("cases")
        .unwrap();
    let mut saw_split = false;
    for case in cases.try_iter().unwrap() {
        let ids = to_ids(&case.get_attr("ids").unwrap());
        let want = tok.decode(&ids, true).unwrap();
        let mut dec = tok.text_decoder(&[], true);
        let mut got = String::new();
        for &id in &ids {
            let piece = dec.push(id).unwrap();
            assert!(
                !piece.contains('\u{FFFD}'),
                "partial character emitted: {piece:?}"
            );
            if piece.is_empty() {
                saw_split = true;
            }
            got.push_str(&piece);
        }
        got.push_str(&dec.flush().unwrap());
        assert_eq!(got, want);
    }
    assert!(
        saw_split,
        "no case held a token back: the fixture cases should include split characters"
    );
}
