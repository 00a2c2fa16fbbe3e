//! Unit tests of the request parser (kept beside it; `tests/request_fuzz.rs` fuzzes it).

use super::*;

const L: Limits = Limits { ctx: 256 };

fn msg(role: &str, content: &str) -> Value {
    json!({"role": role, "content": content})
}

fn chat_prompt(messages: Vec<Value>) -> PromptInput {
    PromptInput::Chat(ChatPrompt {
        messages,
        tools: vec![],
        kwargs: vec![],
    })
}

fn chat(body: &str) -> Result<GenRequest, ApiError> {
    parse_chat(body.as_bytes(), L)
}

fn param(r: Result<GenRequest, ApiError>) -> String {
    let e = r.unwrap_err();
    assert_eq!(e.status.as_u16(), 400, "{e}");
    e.param.unwrap_or_default()
}

#[test]
fn minimal_chat_gets_openai_defaults() {
    let r = chat(r#"{"messages":[{"role":"user","content":"hi"}]}"#).unwrap();
    assert_eq!(r.prompt, chat_prompt(vec![msg("user", "hi")]));
    assert!(!r.stream && r.max_tokens.is_none() && r.seed.is_none());
    assert_eq!((r.n, r.logprobs, r.echo), (1, None, false));
    assert_eq!(r.sampling.temperature, 1.0);
    assert_eq!(r.sampling.top_p, 1.0);
}

#[test]
fn every_supported_field_is_read() {
    let r = chat(
        r#"{"model":"x","messages":[{"role":"developer","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},{"role":"user","content":"q","name":"n"}],
        "stream":true,"stream_options":{"include_usage":true},"max_completion_tokens":7,"temperature":0.5,"top_p":0.9,
        "top_k":40,"min_p":0.05,"presence_penalty":0.5,"frequency_penalty":-0.5,"repetition_penalty":1.1,"seed":-1,
        "stop":["x","yy"],"n":1,"user":"u","logprobs":false,"logit_bias":{},"response_format":{"type":"text"},"tools":[],"tool_choice":"none"}"#,
    )
    .unwrap();
    let mut user = msg("user", "q");
    user["name"] = json!("n");
    assert_eq!(r.prompt, chat_prompt(vec![msg("system", "a\nb"), user]));
    assert!(r.stream && r.include_usage);
    assert_eq!(r.max_tokens, Some(7));
    let s = &r.sampling;
    assert_eq!(
        (s.temperature, s.top_p, s.top_k, s.min_p),
        (0.5, 0.9, 40, 0.05)
    );
    assert_eq!(
        (s.presence_penalty, s.frequency_penalty, s.repeat_penalty),
        (0.5, -0.5, 1.1)
    );
    assert_eq!(r.seed, Some(u64::MAX));
    assert_eq!(r.stop, vec!["x".to_string(), "yy".to_string()]);
}

#[test]
fn bad_fields_are_named() {
    let m = r#""messages":[{"role":"user","content":"hi"}]"#;
    for (extra, want) in [
        (r#""temperature":-0.1"#, "temperature"),
        (r#""temperature":"hot""#, "temperature"),
        (r#""top_p":0"#, "top_p"),
        (r#""top_p":1.5"#, "top_p"),
        (r#""min_p":2"#, "min_p"),
        (r#""top_k":-1"#, "top_k"),
        (r#""max_tokens":0"#, "max_tokens"),
        (r#""max_tokens":257"#, "max_tokens"),
        (r#""max_tokens":1.5"#, "max_tokens"),
        (
            r#""max_tokens":3,"max_completion_tokens":4"#,
            "max_completion_tokens",
        ),
        (r#""stop":[1]"#, "stop[0]"),
        (r#""stop":"""#, "stop"),
        (r#""stream":"yes""#, "stream"),
        (
            r#""stream_options":{"include_usage":true}"#,
            "stream_options",
        ),
        (r#""seed":"x""#, "seed"),
        (r#""presence_penalty":3"#, "presence_penalty"),
        (r#""repetition_penalty":0"#, "repetition_penalty"),
        (r#""frobnicate":1"#, "frobnicate"),
        (r#""frobnicate":null"#, "frobnicate"),
        (r#""n":0"#, "n"),
        (r#""n":17"#, "n"),
        (r#""top_logprobs":2"#, "top_logprobs"),
        (r#""logprobs":true,"top_logprobs":21"#, "top_logprobs"),
        (r#""logit_bias":{"x":1}"#, "logit_bias.x"),
        (r#""logit_bias":{"5":101}"#, "logit_bias.5"),
        (r#""tools":[{"type":"function"}]"#, "tools[0].function"),
        (
            r#""tools":[{"type":"function","function":{"name":"a b"}}]"#,
            "tools[0].function.name",
        ),
        (r#""tool_choice":"required""#, "tool_choice"),
        (
            r#""tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":{"type":"function","function":{"name":"g"}}"#,
            "tool_choice",
        ),
        (
            r#""response_format":{"type":"xml"}"#,
            "response_format.type",
        ),
        (
            r#""response_format":{"type":"json_schema","json_schema":{}}"#,
            "response_format.json_schema.name",
        ),
        (r#""modalities":["audio"]"#, "modalities[0]"),
        (r#""audio":{"voice":"x"}"#, "audio"),
        (r#""functions":[]"#, "functions"),
        (r#""reasoning_effort":"max""#, "reasoning_effort"),
        (r#""chat_template_kwargs":1"#, "chat_template_kwargs"),
        (
            r#""stream":true,"stream_options":{"x":1}"#,
            "stream_options.x",
        ),
    ] {
        let body = format!("{{{m},{extra}}}");
        assert_eq!(param(chat(&body)), want, "{body}");
    }
    for (msgs, want) in [
        (r#"[]"#, "messages"),
        (r#""hi""#, "messages"),
        (r#"[{"content":"x"}]"#, "messages[0].role"),
        (
            r#"[{"role":"user","content":"x"},{"role":"wizard","content":"x"}]"#,
            "messages[1].role",
        ),
        (r#"[{"role":"user"}]"#, "messages[0].content"),
        (
            r#"[{"role":"tool","content":"x"}]"#,
            "messages[0].tool_call_id",
        ),
        (
            r#"[{"role":"user","content":"x","tool_calls":[]}]"#,
            "messages[0].tool_calls",
        ),
        (
            r#"[{"role":"assistant","tool_calls":[{"function":{}}]}]"#,
            "messages[0].tool_calls[0].function.name",
        ),
        (r#"[{"role":"user","content":7}]"#, "messages[0].content"),
        (
            r#"[{"role":"user","content":[{"type":"image_url"}]}]"#,
            "messages[0].content[0].type",
        ),
        (
            r#"[{"role":"user","content":"x","extra":1}]"#,
            "messages[0].extra",
        ),
    ] {
        let body = format!(r#"{{"messages":{msgs}}}"#);
        assert_eq!(param(chat(&body)), want, "{body}");
    }
    assert_eq!(param(chat("{}")), "messages");
}

#[test]
fn openai_fields_and_nulls_are_accepted() {
    // A history as the openai client's `message.model_dump()` writes it, and the fields of
    // OpenAI's reference that do not apply here.
    let r = chat(
        r#"{"messages":[{"role":"user","content":"q","name":null},
        {"role":"assistant","content":null,"refusal":null,"annotations":null,"audio":null,"function_call":null,
         "tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{\"a\": 1}"}}]},
        {"role":"tool","content":"42","tool_call_id":"c1"}],
        "reasoning_effort":"low","metadata":{"k":"v"},"store":false,"service_tier":"auto","modalities":["text"],
        "prediction":{"type":"content","content":"x"},"verbosity":"low","prompt_cache_key":"k","safety_identifier":"s",
        "stream":true,"stream_options":{"include_usage":true,"include_obfuscation":false},"web_search_options":null,
        "chat_template_kwargs":{"enable_thinking":false},"top_logprobs":null,"audio":null,"functions":null,
        "tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}],
        "tool_choice":{"type":"function","function":{"name":"f"}},"parallel_tool_calls":false,
        "logprobs":true,"n":3,"logit_bias":{"7":-100}}"#,
    )
    .unwrap();
    let PromptInput::Chat(c) = &r.prompt else {
        panic!()
    };
    assert_eq!(
        c.messages[1]["tool_calls"][0]["function"]["arguments"],
        json!({"a": 1})
    );
    assert_eq!(c.messages[1]["content"], "");
    assert_eq!(c.messages[2]["tool_call_id"], "c1");
    assert_eq!(
        c.kwargs,
        vec![
            ("enable_thinking".to_string(), json!(false)),
            ("reasoning_effort".to_string(), json!("low"))
        ]
    );
    assert_eq!(r.tool_choice, ToolChoice::Function("f".into()));
    assert!(!r.parallel_tool_calls);
    assert_eq!((r.n, r.logprobs), (3, Some(0)));
    assert_eq!(r.logit_bias, vec![(7, -100.0)]);
    let r = chat(
        r#"{"messages":[{"role":"user","content":"q"}],"response_format":{"type":"json_schema","json_schema":{"name":"x","strict":true,"schema":{"type":"object"}}}}"#,
    )
    .unwrap();
    assert_eq!(r.json_schema, Some(json!({"type":"object"})));
}

#[test]
fn malformed_bodies_are_400_without_param() {
    for body in [
        "",
        "  ",
        "{",
        "[]",
        "null",
        "\"x\"",
        "{\"messages\": [}",
        "\u{0}",
    ] {
        let e = chat(body).unwrap_err();
        assert_eq!(e.status.as_u16(), 400);
        assert_eq!(e.code, Some("invalid_json"), "{body:?}: {e}");
    }
}

#[test]
fn completion_prompt_forms() {
    let p = |b: &str| parse_completion(b.as_bytes(), L).map(|r| r.prompt);
    assert_eq!(
        p(r#"{"prompt":"a"}"#).unwrap(),
        PromptInput::Text("a".into())
    );
    assert_eq!(
        p(r#"{"prompt":["a"]}"#).unwrap(),
        PromptInput::Text("a".into())
    );
    assert_eq!(
        p(r#"{"prompt":[1,2]}"#).unwrap(),
        PromptInput::Tokens(vec![1, 2])
    );
    assert_eq!(
        p(r#"{"prompt":[[3]]}"#).unwrap(),
        PromptInput::Tokens(vec![3])
    );
    for (b, want) in [
        (r#"{"prompt":["a","b"]}"#, "prompt"),
        (r#"{"prompt":[]}"#, "prompt"),
        (r#"{"prompt":[-1]}"#, "prompt[0]"),
        (r#"{"prompt":[4294967296]}"#, "prompt[0]"),
        (r#"{"prompt":{}}"#, "prompt"),
        (r#"{}"#, "prompt"),
        (r#"{"prompt":"a","best_of":2}"#, "best_of"),
        (r#"{"prompt":"a","logprobs":21}"#, "logprobs"),
        (r#"{"prompt":"a","suffix":"b"}"#, "suffix"),
        (r#"{"prompt":"a","messages":[]}"#, "messages"),
    ] {
        assert_eq!(param(parse_completion(b.as_bytes(), L)), want, "{b}");
    }
}

#[test]
fn unknown_key_names_are_escaped_and_cut() {
    let key = format!("\u{1b}[31m{}", "k".repeat(100));
    let body = format!(
        r#"{{"prompt":"a",{}:1}}"#,
        serde_json::to_string(&key).unwrap()
    );
    let e = parse_completion(body.as_bytes(), L).unwrap_err();
    let p = e.param.unwrap();
    assert!(
        p.starts_with("\\u{1b}[31m") && p.ends_with('…') && p.len() < 90,
        "{p}"
    );
}
