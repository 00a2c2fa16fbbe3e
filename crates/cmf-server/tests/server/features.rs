//! The OpenAI features beyond plain generation, through HTTP: log-probabilities (checked against
//! a teacher-forced pass, as `cmf ppl` scores), `echo`, `n`, `logit_bias`, structured output
//! (a property test over random schemas), forced tool calls (whole and streamed, and their
//! results rendered back through a tool-aware template), routes without `/v1`, CORS.

use crate::client::{get, post, request, EventStream};
use crate::fixture::*;
use cmf_format::CmfModel;
use cmf_llm::chat::TextAssets;
use cmf_llm::sampling::{argmax, SamplingParams, Xoshiro256};
use cmf_llm::Model;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::OnceLock;

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";

fn ok(r: crate::client::Resp) -> Value {
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

/// −log p of every token after the first of `ids`, from one teacher-forced pass (f32 cache),
/// as `cmf ppl` computes them.
pub fn teacher_forced(ids: &[u32]) -> Vec<f64> {
    let file = CmfModel::open(model_path()).unwrap();
    let model = Model::load(&file).unwrap();
    let mut st = model
        .new_state_with(ids.len(), cmf_kernels::KvDtype::F32)
        .unwrap();
    let mut out = vec![0.0; ids.len() - 1];
    model
        .forward_scored(&mut st, ids, 0, |i, logits| {
            if i + 1 < ids.len() {
                let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
                out[i] = (logits[ids[i + 1] as usize] - max) as f64 - sum.ln();
            }
        })
        .unwrap();
    out
}

/// Greedy continuation of `ids` on an f32 cache (what the f32 server generates at temperature 0).
fn greedy_f32(ids: &[u32], n: usize) -> Vec<u32> {
    let file = CmfModel::open(model_path()).unwrap();
    let model = Model::load(&file).unwrap();
    let eos = assets().eos_ids;
    let mut st = model
        .new_state_with(ids.len() + n, cmf_kernels::KvDtype::F32)
        .unwrap();
    let mut t = argmax(model.prefill(&mut st, ids).unwrap());
    let mut out = Vec::new();
    while out.len() < n && !eos.contains(&t) {
        out.push(t);
        t = argmax(model.decode(&mut st, t).unwrap());
    }
    out
}

fn f32_server() -> cmf_server::RunningServer {
    let mut cfg = config();
    cfg.engine.kv_dtype = cmf_kernels::KvDtype::F32;
    start(cfg)
}

#[test]
fn logprobs_and_echo_match_a_teacher_forced_pass() {
    let srv = f32_server();
    let prompt = "In the beginning God created";
    let ids = text_ids(prompt);
    let gen = greedy_f32(&ids, 6);
    assert_eq!(gen.len(), 6, "the fixture should not stop early here");
    let all: Vec<u32> = ids.iter().chain(&gen).copied().collect();
    let want = teacher_forced(&all);

    let v = ok(post(
        srv.addr(),
        COMPLETIONS,
        &json!({"prompt": prompt, "max_tokens": 6, "temperature": 0, "echo": true, "logprobs": 3}),
    ));
    let c = &v["choices"][0];
    assert!(c["text"].as_str().unwrap().starts_with(prompt));
    let lp = &c["logprobs"];
    let got = lp["token_logprobs"].as_array().unwrap();
    assert_eq!(got.len(), all.len(), "{lp}");
    assert!(
        got[0].is_null(),
        "the first prompt token has no log-probability"
    );
    for (i, w) in want.iter().enumerate() {
        let g = got[i + 1].as_f64().unwrap();
        assert!((g - w).abs() < 1e-3, "token {}: {g} vs {w}", i + 1);
    }
    // The greedy token is the most likely one: first among its alternatives.
    for i in ids.len()..all.len() {
        let top = lp["top_logprobs"][i].as_object().unwrap();
        assert_eq!(top.len(), 3);
        let best = top
            .values()
            .map(|x| x.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        assert!((best - got[i].as_f64().unwrap()).abs() < 1e-6);
    }
    let offsets = lp["text_offset"].as_array().unwrap();
    assert_eq!(offsets[0], 0);

    // Chat: the answer's tokens, streamed and whole, the same numbers.
    let body = json!({"messages": user("Hello"), "max_tokens": 5, "temperature": 0,
                      "logprobs": true, "top_logprobs": 2});
    let ids = chat_ids(&[("user", "Hello")]);
    let gen = greedy_f32(&ids, 5);
    let all: Vec<u32> = ids.iter().chain(&gen).copied().collect();
    let want = &teacher_forced(&all)[ids.len() - 1..];
    let v = ok(post(srv.addr(), CHAT, &body));
    let content = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(content.len(), gen.len());
    for (e, w) in content.iter().zip(want) {
        assert!((e["logprob"].as_f64().unwrap() - w).abs() < 1e-3);
        assert_eq!(e["top_logprobs"].as_array().unwrap().len(), 2);
        assert_eq!(
            e["bytes"].as_array().unwrap().len(),
            e["token"].as_str().unwrap().len()
        );
    }
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let streamed: Vec<Value> = EventStream::open(srv.addr(), CHAT, &sbody)
        .collect()
        .iter()
        .filter(|d| *d != "[DONE]")
        .flat_map(|d| {
            let e: Value = serde_json::from_str(d).unwrap();
            e["choices"][0]["logprobs"]["content"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .collect();
    assert_eq!(streamed, content);
}

#[test]
fn n_choices_are_seeded_one_after_the_other() {
    let srv = start(config());
    let ids = chat_ids(&[("user", "Tell me a story")]);
    let v = ok(post(
        srv.addr(),
        CHAT,
        &json!({"messages": user("Tell me a story"), "n": 3, "seed": 11, "temperature": 0.9, "max_tokens": 8}),
    ));
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    let mut total = 0;
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        let sampling = SamplingParams {
            temperature: 0.9,
            seed: 11 + i as u64,
            ..SamplingParams::default()
        };
        let (want, stats) = reference(&ids, &gen_config(8, sampling, &[]));
        assert_eq!(c["message"]["content"], want.as_str(), "choice {i}");
        total += stats.generated_tokens;
    }
    assert_eq!(v["usage"]["prompt_tokens"], ids.len());
    assert_eq!(v["usage"]["completion_tokens"], total);

    // Streamed: every choice opens, finishes, and the usage comes once at the end.
    let data = EventStream::open(
        srv.addr(),
        COMPLETIONS,
        &json!({"prompt": "Once", "n": 2, "max_tokens": 4, "stream": true,
                "stream_options": {"include_usage": true}}),
    )
    .collect();
    let events: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let finished: Vec<i64> = events
        .iter()
        .filter(|e| !e["choices"][0]["finish_reason"].is_null())
        .map(|e| e["choices"][0]["index"].as_i64().unwrap())
        .collect();
    assert_eq!(finished, vec![0, 1]);
    assert_eq!(events.iter().filter(|e| !e["usage"].is_null()).count(), 1);
}

#[test]
fn logit_bias_forces_and_bans_tokens() {
    let srv = start(config());
    let a = assets();
    let the = a.tokenizer.encode(" the", false).unwrap();
    assert_eq!(the.len(), 1);
    let body = |bias: Value| json!({"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0, "logit_bias": bias});
    let v = ok(post(
        srv.addr(),
        COMPLETIONS,
        &body(json!({the[0].to_string(): 100})),
    ));
    assert_eq!(v["choices"][0]["text"], " the the the");

    let plain = ok(post(srv.addr(), COMPLETIONS, &body(json!({}))));
    let ids = text_ids("Once upon a time");
    let first = greedy_f32(&ids, 1)[0];
    let v = ok(post(
        srv.addr(),
        COMPLETIONS,
        &body(json!({first.to_string(): -100})),
    ));
    assert_ne!(v["choices"][0]["text"], plain["choices"][0]["text"]);

    let r = post(srv.addr(), COMPLETIONS, &body(json!({"99999999": 1})));
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["param"], "logit_bias.99999999");
}

/// `ignore_eos`: an end-of-sequence id forced by `logit_bias` ends the answer at once without it
/// and is generated like any token with it, until `max_tokens`.
#[test]
fn ignore_eos_runs_to_max_tokens() {
    let srv = start(config());
    let eos = assets().eos_ids[0];
    let body = |ignore: bool| {
        json!({"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0,
               "logit_bias": {eos.to_string(): 100}, "ignore_eos": ignore})
    };
    let v = ok(post(srv.addr(), COMPLETIONS, &body(false)));
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["usage"]["completion_tokens"], 0);
    let v = ok(post(srv.addr(), COMPLETIONS, &body(true)));
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 4);
    let r = post(
        srv.addr(),
        COMPLETIONS,
        &json!({"prompt": "x", "ignore_eos": 1}),
    );
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["param"], "ignore_eos");
}

#[test]
fn a_character_cut_by_the_budget_is_dropped() {
    let srv = start(config());
    // Byte-level BPE: "Ã" is the token of the lone byte 0xC3, the first half of "é".
    let half = assets().tokenizer.token_to_id("Ã").unwrap();
    for stream in [false, true] {
        let body = json!({"messages": user("Hi"), "max_tokens": 1, "logit_bias": {half.to_string(): 100},
                          "stream": stream});
        let text = if stream {
            EventStream::open(srv.addr(), CHAT, &body)
                .collect()
                .iter()
                .filter(|d| *d != "[DONE]")
                .map(|d| {
                    let e: Value = serde_json::from_str(d).unwrap();
                    e["choices"][0]["delta"]["content"]
                        .as_str()
                        .unwrap_or("")
                        .to_string()
                })
                .collect::<String>()
        } else {
            let v = ok(post(srv.addr(), CHAT, &body));
            assert_eq!(v["choices"][0]["finish_reason"], "length");
            assert_eq!(v["usage"]["completion_tokens"], 1);
            v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_string()
        };
        assert_eq!(text, "", "stream {stream}");
    }
}

/// A random JSON schema of bounded size (so a random model can always finish it).
fn random_schema(r: &mut Xoshiro256, depth: usize) -> Value {
    let pick = r.next_u64() % if depth > 1 { 5 } else { 7 };
    match pick {
        0 => json!({"type": "string", "maxLength": 1 + r.next_u64() % 8}),
        1 => json!({"type": "integer", "minimum": -50, "maximum": 50}),
        2 => json!({"type": "boolean"}),
        3 => json!({"enum": ["red", "green", 7, null]}),
        4 => json!({"type": "null"}),
        5 => json!({"type": "array", "items": random_schema(r, depth + 1), "maxItems": 3}),
        _ => {
            let n = 1 + r.next_u64() % 3;
            let props: serde_json::Map<String, Value> = (0..n)
                .map(|i| (format!("k{i}"), random_schema(r, depth + 1)))
                .collect();
            let required: Vec<&String> = props.keys().collect();
            json!({"type": "object", "properties": props, "required": required,
                   "additionalProperties": false})
        }
    }
}

/// Whether `v` matches a schema of [`random_schema`]'s subset.
fn matches(schema: &Value, v: &Value) -> bool {
    if let Some(e) = schema.get("enum") {
        return e.as_array().unwrap().contains(v);
    }
    match schema["type"].as_str().unwrap() {
        "string" => v
            .as_str()
            .is_some_and(|s| s.chars().count() as u64 <= schema["maxLength"].as_u64().unwrap()),
        // JSON Schema's integers are numbers without a fraction (`-0` included).
        "integer" => v
            .as_f64()
            .is_some_and(|x| x.fract() == 0.0 && (-50.0..=50.0).contains(&x)),
        "boolean" => v.is_boolean(),
        "null" => v.is_null(),
        "array" => v
            .as_array()
            .is_some_and(|a| a.len() <= 3 && a.iter().all(|x| matches(&schema["items"], x))),
        "object" => v.as_object().is_some_and(|o| {
            let props = schema["properties"].as_object().unwrap();
            o.len() == props.len()
                && props
                    .iter()
                    .all(|(k, s)| o.get(k).is_some_and(|x| matches(s, x)))
        }),
        t => panic!("type {t}"),
    }
}

#[test]
fn structured_output_always_matches_random_schemas() {
    let srv = start(config());
    let mut r = Xoshiro256::seed(0x5c4e3a);
    for case in 0..40 {
        let schema = random_schema(&mut r, 0);
        let stream = case % 4 == 3;
        let body = json!({
            "messages": user(&format!("Answer {case}")),
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "t", "strict": true, "schema": schema}},
            "temperature": 1.0, "seed": case, "max_tokens": 200, "n": if stream { 1 } else { 2 },
            "stream": stream,
        });
        let texts: Vec<String> = if stream {
            let mut t = String::new();
            for d in EventStream::open(srv.addr(), CHAT, &body).collect() {
                if d != "[DONE]" {
                    let e: Value = serde_json::from_str(&d).unwrap();
                    t.push_str(e["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
                }
            }
            vec![t]
        } else {
            let v = ok(post(srv.addr(), CHAT, &body));
            v["choices"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| {
                    assert_eq!(c["finish_reason"], "stop", "{c}");
                    c["message"]["content"].as_str().unwrap().to_string()
                })
                .collect()
        };
        for t in texts {
            let v: Value = serde_json::from_str(&t)
                .unwrap_or_else(|e| panic!("case {case}: {e}: {t:?} for {schema}"));
            assert!(
                matches(&schema, &v),
                "case {case}: {t} does not match {schema}"
            );
        }
    }
    // json_object: some JSON object.
    let v = ok(post(
        srv.addr(),
        CHAT,
        &json!({"messages": user("x"), "response_format": {"type": "json_object"}, "max_tokens": 64,
                "temperature": 0, "logit_bias": {assets().tokenizer.encode("}", false).unwrap()[0].to_string(): 5}}),
    ));
    let c = &v["choices"][0];
    if c["finish_reason"] == "stop" {
        let t = c["message"]["content"].as_str().unwrap();
        assert!(serde_json::from_str::<Value>(t).unwrap().is_object(), "{t}");
    }
    let r = post(
        srv.addr(),
        CHAT,
        &json!({"messages": user("x"), "response_format": {"type": "json_schema",
               "json_schema": {"name": "bad", "schema": {"type": "frobnicate"}}}}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "response_format");
}

/// A Hermes-style template that renders tools, assistant tool calls and tool results (the
/// shape of Qwen2.5's), on the qwen2-tiny weights with a 1024-token context.
const TOOL_TEMPLATE: &str = r#"{%- if tools %}<|im_start|>system
<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content }}{% for tc in message.tool_calls %}<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"#;

pub fn tool_model() -> &'static PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| model_with_template("qwen2-tools", TOOL_TEMPLATE))
}

/// The qwen2-tiny weights with `template` as their chat template. Tool definitions take
/// hundreds of tokens of this 512-entry vocabulary: the context is 1024 rather than the
/// fixture's 256 (the weights are random either way).
fn model_with_template(name: &str, template: &str) -> PathBuf {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/llm/qwen2-tiny");
    let dir = scratch_dir(&format!("cmf-server-{name}"));
    for f in std::fs::read_dir(&src).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
    }
    let edit = |file: &str, key: &str, value: Value| {
        let path = dir.join(file);
        let mut v: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        v[key] = value;
        std::fs::write(&path, v.to_string()).unwrap();
    };
    edit("tokenizer_config.json", "chat_template", json!(template));
    edit("config.json", "max_position_embeddings", json!(1024));
    let out = dir.join(format!("{name}.cmf"));
    let opts = cmf_convert::Options {
        quant: Some(cmf_convert::Quant::F32),
        ..Default::default()
    };
    cmf_convert::hf::convert(&dir, &out, &opts).unwrap();
    out
}

#[test]
fn template_kwargs_and_reasoning_effort_reach_the_template() {
    let template = "<|im_start|>user\n{{ messages[0].content }}\
        {% if enable_thinking is false %} /no_think{% endif %}\
        {% if reasoning_effort %} effort={{ reasoning_effort }}{% endif %}<|im_end|>\n<|im_start|>assistant\n";
    let path = model_with_template("qwen2-kwargs", template);
    let mut cfg = config();
    cfg.model = path.clone();
    let srv = start(cfg);
    let assets = TextAssets::from_cmf(&CmfModel::open(&path).unwrap()).unwrap();
    let mut counts = Vec::new();
    for (extra, kwargs, suffix) in [
        (json!({}), vec![], ""),
        (
            json!({"chat_template_kwargs": {"enable_thinking": false}}),
            vec![("enable_thinking".to_string(), minijinja::Value::from(false))],
            " /no_think",
        ),
        (
            json!({"reasoning_effort": "high"}),
            vec![(
                "reasoning_effort".to_string(),
                minijinja::Value::from("high"),
            )],
            " effort=high",
        ),
    ] {
        let mut body = json!({"messages": user("Hi"), "max_tokens": 1});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let v = ok(post(srv.addr(), CHAT, &body));
        let text = assets
            .template
            .render_with_kwargs(
                minijinja::Value::from_serialize(user("Hi")),
                None,
                &kwargs,
                true,
            )
            .unwrap();
        assert!(text.contains(&format!("Hi{suffix}<|im_end|>")), "{text:?}");
        let ids = assets.tokenizer.encode(&text, false).unwrap();
        assert_eq!(v["usage"]["prompt_tokens"], ids.len(), "{suffix:?}");
        counts.push(ids.len());
    }
    assert!(counts[0] < counts[1] && counts[0] < counts[2], "{counts:?}");
}

fn weather_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "w", "parameters": {"type": "object",
          "properties": {"c": {"type": "string", "maxLength": 6},
                         "d": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["c", "d"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "t", "parameters": {"type": "object",
          "properties": {"z": {"enum": ["U", "C"]}}, "required": ["z"]}}}
    ])
}

#[test]
fn forced_tool_calls_round_trip_whole_and_streamed() {
    let mut cfg = config();
    cfg.model = tool_model().clone();
    let srv = start(cfg);
    let a = srv.addr();
    let messages = json!([{"role": "user", "content": "Weather?"}]);
    for (choice, name) in [
        (json!("required"), None),
        (
            json!({"type": "function", "function": {"name": "t"}}),
            Some("t"),
        ),
    ] {
        let body = json!({"messages": messages, "tools": weather_tools(), "tool_choice": choice,
                          "temperature": 0.8, "seed": 5, "max_tokens": 100, "parallel_tool_calls": false});
        let v = ok(post(a, CHAT, &body));
        let c = &v["choices"][0];
        assert_eq!(c["finish_reason"], "tool_calls", "{v}");
        let calls = c["message"]["tool_calls"].as_array().unwrap().clone();
        assert_eq!(calls.len(), 1);
        let f = &calls[0]["function"];
        if let Some(n) = name {
            assert_eq!(f["name"], n);
        }
        let args: Value = serde_json::from_str(f["arguments"].as_str().unwrap()).unwrap();
        let tools = weather_tools();
        let tool = tools
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["function"]["name"] == f["name"])
            .unwrap();
        for k in tool["function"]["parameters"]["required"]
            .as_array()
            .unwrap()
        {
            assert!(args.get(k.as_str().unwrap()).is_some(), "{args}");
        }

        // Streamed with the same seed: the deltas add up to the same call.
        let mut sbody = body.clone();
        sbody["stream"] = json!(true);
        let (mut id, mut fname, mut fargs, mut finish) = (None, None, String::new(), None);
        for d in EventStream::open(a, CHAT, &sbody).collect() {
            if d == "[DONE]" {
                continue;
            }
            let e: Value = serde_json::from_str(&d).unwrap();
            let ch = &e["choices"][0];
            if let Some(tc) = ch["delta"]["tool_calls"].as_array() {
                assert_eq!(tc[0]["index"], 0);
                if let Some(i) = tc[0]["id"].as_str() {
                    id = Some(i.to_string());
                    fname = tc[0]["function"]["name"].as_str().map(str::to_string);
                }
                fargs.push_str(tc[0]["function"]["arguments"].as_str().unwrap_or(""));
            }
            if !ch["finish_reason"].is_null() {
                finish = ch["finish_reason"].as_str().map(str::to_string);
            }
        }
        assert!(id.is_some_and(|i| i.starts_with("call_")));
        assert_eq!(fname.as_deref(), f["name"].as_str());
        assert_eq!(fargs, f["arguments"].as_str().unwrap());
        assert_eq!(finish.as_deref(), Some("tool_calls"));

        // The call and its result go back through the template (as `model_dump()` writes them).
        let mut assistant = c["message"].clone();
        assistant["audio"] = Value::Null;
        assistant["function_call"] = Value::Null;
        assistant["annotations"] = Value::Null;
        let history = json!([messages[0], assistant,
            {"role": "tool", "tool_call_id": calls[0]["id"], "content": "22"}]);
        let v = ok(post(
            a,
            CHAT,
            &json!({"messages": history, "tools": weather_tools(), "max_tokens": 2}),
        ));
        let file = CmfModel::open(tool_model()).unwrap();
        let assets = TextAssets::from_cmf(&file).unwrap();
        let mut tmpl_history = history.clone();
        tmpl_history[1]["tool_calls"][0]["function"]["arguments"] = args.clone();
        tmpl_history[1]["content"] = json!("");
        let text = assets
            .template
            .render_values(
                minijinja::Value::from_serialize(&tmpl_history),
                Some(minijinja::Value::from_serialize(weather_tools())),
                true,
            )
            .unwrap();
        assert!(text.contains("<tool_response>\n22"), "{text}");
        assert!(text.contains("<tool_call>\n{\"name\": \""), "{text}");
        let ids = assets.tokenizer.encode(&text, false).unwrap();
        assert_eq!(v["usage"]["prompt_tokens"], ids.len());
    }
}

#[test]
fn routes_without_v1_cors_and_bad_paths() {
    let mut cfg = config();
    cfg.cors_origins = vec!["http://localhost:3000".into()];
    let srv = start(cfg);
    let a = srv.addr();
    assert_eq!(ok(get(a, "/models"))["data"][0]["id"], MODEL_ID);
    let v = ok(post(
        a,
        "/chat/completions",
        &json!({"messages": user("hi"), "max_tokens": 2}),
    ));
    assert_eq!(v["object"], "chat.completion");
    ok(post(
        a,
        "/completions",
        &json!({"prompt": "hi", "max_tokens": 2}),
    ));

    let pre = request(
        a,
        "OPTIONS",
        "/v1/chat/completions",
        &[
            ("Origin", "http://localhost:3000"),
            ("Access-Control-Request-Method", "POST"),
            (
                "Access-Control-Request-Headers",
                "authorization, content-type",
            ),
        ],
        None,
    );
    assert!(pre.status < 300, "{}", pre.status);
    assert_eq!(
        pre.header("access-control-allow-origin"),
        Some("http://localhost:3000")
    );
    let other = request(
        a,
        "GET",
        "/v1/models",
        &[("Origin", "http://evil.example")],
        None,
    );
    assert_eq!(other.header("access-control-allow-origin"), None);

    // CORS is off by default.
    let plain = start(config());
    let r = request(
        plain.addr(),
        "GET",
        "/v1/models",
        &[("Origin", "http://localhost:3000")],
        None,
    );
    assert_eq!(r.header("access-control-allow-origin"), None);

    let r = get(a, "/v1/models/%FF%FE");
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["code"], "invalid_path");
}
