//! Multi-turn chat over one KV cache: the second answer equals the answer of a fresh session
//! given the same conversation (so reusing the cached prefix changes nothing), `reset` forgets,
//! and a conversation longer than the context is refused without changing the history.

mod common;
use cmf_convert::{Options, Quant};
use cmf_format::CmfModel;
use cmf_kernels::KvDtype;
use cmf_llm::chat::{ChatSession, Message, TextAssets};
use cmf_llm::generate::{FinishReason, GenerationConfig};
use cmf_llm::{LlmError, Model};

#[test]
fn second_turn_reuses_the_cache_without_changing_the_answer() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("m.cmf");
    cmf_convert::hf::convert(
        &common::fixture_dir("qwen3-tiny"),
        &path,
        &Options {
            quant: Some(Quant::F32),
            ..Options::default()
        },
    )
    .unwrap();
    let file = CmfModel::open(&path).unwrap();
    let model = Model::load(&file).unwrap();
    let a = TextAssets::from_cmf(&file).unwrap();
    let cfg = GenerationConfig {
        max_tokens: 12,
        eos_ids: a.eos_ids.clone(),
        ..Default::default()
    };

    let mut chat = ChatSession::new(
        &model,
        &a.tokenizer,
        &a.template,
        Some("Be brief."),
        256,
        KvDtype::F32,
    )
    .unwrap();
    let (first, _) = chat.send("In the beginning", &cfg, &mut |_| {}).unwrap();
    let (second, stats) = chat.send("And then?", &cfg, &mut |_| {}).unwrap();
    // Only the new turn (and whatever of the last answer the template re-renders differently) ran.
    let full = a
        .tokenizer
        .encode(
            &a.template.render(&chat.messages[..4], true).unwrap(),
            false,
        )
        .unwrap();
    assert!(
        stats.prompt_tokens < full.len(),
        "{} of {} prompt tokens re-run",
        stats.prompt_tokens,
        full.len()
    );

    let mut fresh = ChatSession::new(
        &model,
        &a.tokenizer,
        &a.template,
        Some("Be brief."),
        256,
        KvDtype::F32,
    )
    .unwrap();
    fresh
        .messages
        .push(Message::new("user", "In the beginning"));
    fresh
        .messages
        .push(Message::new("assistant", first.clone()));
    let (again, _) = fresh.send("And then?", &cfg, &mut |_| {}).unwrap();
    assert_eq!(second, again);
    assert_eq!(chat.messages.len(), 5);

    chat.reset();
    assert_eq!(chat.messages, vec![Message::new("system", "Be brief.")]);
    let (after_reset, _) = chat.send("In the beginning", &cfg, &mut |_| {}).unwrap();
    assert_eq!(after_reset, first);

    let mut small =
        ChatSession::new(&model, &a.tokenizer, &a.template, None, 8, KvDtype::F32).unwrap();
    let err = small
        .send(
            "a long message that does not fit in eight tokens",
            &cfg,
            &mut |_| {},
        )
        .unwrap_err();
    assert!(matches!(err, LlmError::ContextFull { .. }), "{err}");
    assert!(small.messages.is_empty());

    // The context limit ends generation cleanly.
    let mut tight =
        ChatSession::new(&model, &a.tokenizer, &a.template, None, 24, KvDtype::F32).unwrap();
    let long = GenerationConfig {
        max_tokens: 100,
        eos_ids: vec![],
        ..Default::default()
    };
    let (_, stats) = tight.send("Hi", &long, &mut |_| {}).unwrap();
    assert_eq!(stats.finish, FinishReason::ContextFull);
}
