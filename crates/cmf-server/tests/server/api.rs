//! Every endpoint through real HTTP on 127.0.0.1. Answers are compared with what
//! `cmf_llm::generate` computes for the same prompt ids and sampling parameters (never with
//! hard-coded strings).

use crate::client::{connect, get, post, request, send, EventStream};
use crate::fixture::*;
use cmf_llm::generate::FinishReason;
use cmf_llm::sampling::SamplingParams;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::time::Duration;

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";

fn finish(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Eos | FinishReason::Stop => "stop",
        FinishReason::Length | FinishReason::ContextFull => "length",
        FinishReason::Cancelled => unreachable!(),
    }
}

/// The content deltas (chat) or text pieces (completions) of a stream, its last choice chunk,
/// and the events after it. Checks the framing on the way: one id, the chunk object, `[DONE]`.
struct Streamed {
    text: String,
    last: Value,
    all: Vec<Value>,
}

fn read_stream(addr: SocketAddr, path: &str, body: &Value) -> Streamed {
    let s = EventStream::open(addr, path, body);
    assert_eq!(s.status, 200);
    let ct = s
        .headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("content-type"))
        .map(|(_, v)| v.clone());
    assert_eq!(ct.as_deref(), Some("text/event-stream"));
    let data = s.collect();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
    let events: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let id = events[0]["id"].as_str().unwrap().to_string();
    let chat = path == CHAT;
    let mut text = String::new();
    let mut last = Value::Null;
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e["id"], id.as_str(), "one id per stream");
        assert_eq!(
            e["object"],
            if chat {
                "chat.completion.chunk"
            } else {
                "text_completion"
            }
        );
        assert_eq!(e["model"], MODEL_ID);
        let Some(c) = e["choices"].as_array().and_then(|c| c.first()) else {
            continue; // the usage-only chunk
        };
        if chat && i == 0 {
            assert_eq!(c["delta"]["role"], "assistant");
        }
        let piece = if chat {
            &c["delta"]["content"]
        } else {
            &c["text"]
        };
        text.push_str(piece.as_str().unwrap_or(""));
        if !c["finish_reason"].is_null() {
            last = e.clone();
        }
    }
    assert!(!last.is_null(), "a chunk with finish_reason");
    Streamed {
        text,
        last,
        all: events,
    }
}

#[test]
fn health_and_models() {
    let srv = start(config());
    let a = srv.addr();
    let h = get(a, "/health");
    assert_eq!(h.status, 200);
    assert_eq!(h.json()["status"], "ok");
    assert_eq!(h.json()["model"], MODEL_ID);

    let m = get(a, "/v1/models");
    assert_eq!(m.status, 200);
    let v = m.json();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], MODEL_ID);
    assert_eq!(v["data"][0]["object"], "model");
    assert_eq!(
        get(a, &format!("/v1/models/{MODEL_ID}")).json()["id"],
        MODEL_ID
    );

    let e = get(a, "/v1/models/gpt-4");
    assert_eq!(e.status, 404);
    assert_eq!(e.json()["error"]["code"], "model_not_found");
}

#[test]
fn chat_greedy_equals_generate_plain_and_streamed() {
    let srv = start(config());
    let msgs = [
        ("system", "You are a helpful assistant."),
        (
            "user",
            "In the beginning God created the heaven and the earth.",
        ),
    ];
    let ids = chat_ids(&msgs);
    let (want, stats) = reference(&ids, &gen_config(24, greedy(), &[]));
    assert!(!want.is_empty());
    let body = json!({
        "model": MODEL_ID,
        "messages": msgs.iter().map(|(r, c)| json!({"role": r, "content": c})).collect::<Vec<_>>(),
        "temperature": 0,
        "max_tokens": 24,
    });

    let r = post(srv.addr(), CHAT, &body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("application/json"));
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["message"]["content"], want.as_str());
    assert_eq!(v["choices"][0]["finish_reason"], finish(stats.finish));
    assert_eq!(v["usage"]["prompt_tokens"], ids.len());
    assert_eq!(v["usage"]["completion_tokens"], stats.generated_tokens);
    assert_eq!(
        v["usage"]["total_tokens"],
        ids.len() + stats.generated_tokens
    );

    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let s = read_stream(srv.addr(), CHAT, &sbody);
    assert_eq!(s.text, want);
    assert_eq!(s.last["choices"][0]["finish_reason"], finish(stats.finish));
    assert_eq!(s.last["usage"]["prompt_tokens"], ids.len());
    assert_eq!(s.last["usage"]["completion_tokens"], stats.generated_tokens);
    assert!(s.all.len() > 3, "text arrives in several chunks");

    let usage = s.last["usage"].clone();

    // OpenAI's include_usage: one more chunk, no choices, the same usage, and the usage only
    // there (clients that add up the usage of every chunk must count it once).
    sbody["stream_options"] = json!({"include_usage": true});
    let s = read_stream(srv.addr(), CHAT, &sbody);
    assert_eq!(s.text, want);
    let tail = s.all.last().unwrap();
    assert_eq!(tail["choices"], json!([]));
    assert_eq!(tail["usage"], usage);
    let with_usage = s.all.iter().filter(|e| !e["usage"].is_null()).count();
    assert_eq!(with_usage, 1, "usage sent once");
}

#[test]
fn completions_raw_prompt_equals_generate() {
    let srv = start(config());
    let prompt = "And God said, Let there be light:";
    let ids = text_ids(prompt);
    let (want, stats) = reference(&ids, &gen_config(20, greedy(), &[]));
    let body = json!({"prompt": prompt, "temperature": 0.0, "max_tokens": 20});
    let v = post(srv.addr(), COMPLETIONS, &body).json();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], want.as_str());
    assert_eq!(v["choices"][0]["finish_reason"], finish(stats.finish));
    assert_eq!(v["usage"]["prompt_tokens"], ids.len());
    assert_eq!(v["usage"]["completion_tokens"], stats.generated_tokens);

    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let s = read_stream(srv.addr(), COMPLETIONS, &sbody);
    assert_eq!(s.text, want);
    assert_eq!(s.last["usage"]["completion_tokens"], stats.generated_tokens);

    // The same prompt as token ids.
    let body = json!({"prompt": ids, "temperature": 0.0, "max_tokens": 20});
    let v = post(srv.addr(), COMPLETIONS, &body).json();
    assert_eq!(v["choices"][0]["text"], want.as_str());
}

/// Temperature, top-k/p, min-p, penalties and the seed reach the sampler unchanged: a seeded
/// request equals `generate` with the same parameters, and repeats itself.
#[test]
fn seeded_sampling_equals_generate() {
    let srv = start(config());
    let prompt = "Thus the heavens and the earth were finished";
    let ids = text_ids(prompt);
    let sampling = SamplingParams {
        temperature: 0.9,
        top_k: 50,
        top_p: 0.95,
        min_p: 0.02,
        repeat_penalty: 1.1,
        presence_penalty: 0.3,
        frequency_penalty: 0.2,
        seed: 1234,
        ..SamplingParams::default()
    };
    let (want, _) = reference(&ids, &gen_config(24, sampling, &[]));
    let body = json!({
        "prompt": prompt, "max_tokens": 24, "temperature": 0.9, "top_k": 50, "top_p": 0.95,
        "min_p": 0.02, "repetition_penalty": 1.1, "presence_penalty": 0.3,
        "frequency_penalty": 0.2, "seed": 1234,
    });
    let a = post(srv.addr(), COMPLETIONS, &body).json();
    let b = post(srv.addr(), COMPLETIONS, &body).json();
    assert_eq!(a["choices"][0]["text"], want.as_str());
    assert_eq!(b["choices"][0]["text"], want.as_str());
    let (greedy_text, _) = reference(&ids, &gen_config(24, greedy(), &[]));
    assert_ne!(want, greedy_text, "the sampling parameters were used");
}

#[test]
fn stop_strings_cut_the_answer() {
    let srv = start(config());
    let prompt = "And the evening and the morning were";
    let ids = text_ids(prompt);
    let (full, _) = reference(&ids, &gen_config(32, greedy(), &[]));
    // A stop string from the middle of the greedy answer: the answer ends right before its
    // first occurrence, with finish_reason "stop".
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() > 12, "{full:?}");
    let stop: String = chars[6..9].iter().collect();
    let cut = &full[..full.find(&stop).unwrap()];
    for stop_field in [json!(stop), json!(["never-appears", stop])] {
        let body =
            json!({"prompt": prompt, "temperature": 0, "max_tokens": 32, "stop": stop_field});
        let v = post(srv.addr(), COMPLETIONS, &body).json();
        assert_eq!(v["choices"][0]["text"], cut, "stop {stop_field}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        let mut sb = body.clone();
        sb["stream"] = json!(true);
        let s = read_stream(srv.addr(), COMPLETIONS, &sb);
        assert_eq!(s.text, cut);
        assert_eq!(s.last["choices"][0]["finish_reason"], "stop");
    }
    // A stop string that never appears changes nothing.
    let body =
        json!({"prompt": prompt, "temperature": 0, "max_tokens": 32, "stop": "\u{1F600}\u{1F600}"});
    assert_eq!(
        post(srv.addr(), COMPLETIONS, &body).json()["choices"][0]["text"],
        full.as_str()
    );
}

#[test]
fn max_tokens_default_is_capped_by_the_context() {
    let mut cfg = config();
    cfg.engine.ctx = Some(40);
    cfg.max_tokens_default = 1000;
    let srv = start(cfg);
    let prompt = "In the beginning";
    let ids = text_ids(prompt);
    let room = 40 - ids.len();
    let (want, stats) = reference(&ids, &gen_config(room, greedy(), &[]));
    let v = post(
        srv.addr(),
        COMPLETIONS,
        &json!({"prompt": prompt, "temperature": 0}),
    )
    .json();
    // The budget cut the answer; the server and the library run the same loop, which drops a
    // character cut in half (one trailing U+FFFD) either way.
    assert_eq!(stats.finish, FinishReason::Length);
    assert_eq!(v["choices"][0]["text"], want.as_str());
    assert_eq!(v["usage"]["completion_tokens"], stats.generated_tokens);
    assert!(stats.generated_tokens <= room);
}

fn error_of(r: &crate::client::Resp, status: u16) -> Value {
    assert_eq!(r.status, status, "{}", r.text());
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("application/json"));
    let v = r.json();
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(e["type"].is_string(), "{v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
    e.clone()
}

#[test]
fn errors_have_openai_shape_and_status() {
    let mut cfg = config();
    cfg.engine.ctx = Some(64);
    cfg.max_body_bytes = 4096;
    let srv = start(cfg);
    let a = srv.addr();
    let raw = |path: &str, body: &str| request(a, "POST", path, &[], Some(body.as_bytes()));

    let e = error_of(&raw(CHAT, "{\"messages\": ["), 400);
    assert_eq!(e["code"], "invalid_json");
    let e = error_of(&raw(CHAT, ""), 400);
    assert_eq!(e["code"], "invalid_json");
    let e = error_of(
        &raw(
            CHAT,
            r#"{"messages":[{"role":"user","content":"hi"}],"temperature":-1}"#,
        ),
        400,
    );
    assert_eq!(e["param"], "temperature");
    let e = error_of(
        &raw(
            CHAT,
            r#"{"messages":[{"role":"user","content":"hi"}],"n":17}"#,
        ),
        400,
    );
    assert_eq!(e["param"], "n");
    let e = error_of(
        &raw(CHAT, r#"{"messages":[{"role":"robot","content":"hi"}]}"#),
        400,
    );
    assert_eq!(e["param"], "messages[0].role");
    let e = error_of(&raw(COMPLETIONS, r#"{"prompt":"a","wat":1}"#), 400);
    assert_eq!(e["param"], "wat");
    assert_eq!(e["code"], "unknown_parameter");
    let e = error_of(&raw(COMPLETIONS, r#"{"prompt":[600]}"#), 400);
    assert_eq!(e["param"], "prompt[0]");
    let e = error_of(&raw(COMPLETIONS, r#"{"prompt":"a","max_tokens":65}"#), 400);
    assert_eq!(e["param"], "max_tokens");

    // Context: a prompt that does not fit, and max_tokens beyond what the prompt leaves.
    let long = "And God saw the light, that it was good. ".repeat(20);
    let e = error_of(&post(a, COMPLETIONS, &json!({"prompt": long})), 400);
    assert_eq!(e["code"], "context_length_exceeded");
    assert_eq!(e["param"], "prompt");
    let e = error_of(
        &post(
            a,
            CHAT,
            &json!({"messages": [{"role": "user", "content": long}]}),
        ),
        400,
    );
    assert_eq!(e["param"], "messages");
    let n = text_ids("In the beginning").len();
    let e = error_of(
        &post(
            a,
            COMPLETIONS,
            &json!({"prompt": "In the beginning", "max_tokens": 64 - n + 1}),
        ),
        400,
    );
    assert_eq!(e["code"], "context_length_exceeded");
    assert_eq!(e["param"], "max_tokens");
    let ok = post(
        a,
        COMPLETIONS,
        &json!({"prompt": "In the beginning", "max_tokens": 64 - n, "temperature": 0}),
    );
    assert_eq!(ok.status, 200, "{}", ok.text());

    // Body over the limit: by Content-Length, and chunked without one.
    let big = format!(r#"{{"prompt":"{}"}}"#, "a".repeat(5000));
    let e = error_of(&raw(COMPLETIONS, &big), 413);
    assert_eq!(e["code"], "request_too_large");
    let e = error_of(&chunked_post(a, COMPLETIONS, big.as_bytes()), 413);
    assert_eq!(e["code"], "request_too_large");

    // Unknown path, wrong method.
    let e = error_of(&get(a, "/v2/nothing"), 404);
    assert_eq!(e["code"], "not_found");
    error_of(&get(a, CHAT), 405);
    error_of(&request(a, "DELETE", "/v1/models", &[], None), 405);
}

/// A POST with `Transfer-Encoding: chunked` (no Content-Length), the body in 1 KiB chunks.
fn chunked_post(a: SocketAddr, path: &str, body: &[u8]) -> crate::client::Resp {
    use std::io::{Read, Write};
    let mut s = connect(a);
    let mut out = format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    .into_bytes();
    for c in body.chunks(1024) {
        out.extend_from_slice(format!("{:x}\r\n", c.len()).as_bytes());
        out.extend_from_slice(c);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"0\r\n\r\n");
    let _ = s.write_all(&out);
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw);
    let (head, rest) = text.split_once("\r\n\r\n").expect("a response");
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let headers = head
        .lines()
        .skip(1)
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    crate::client::Resp {
        status,
        headers,
        body: rest.as_bytes().to_vec(),
    }
}

#[test]
fn api_key_is_required_when_set() {
    let mut cfg = config();
    cfg.api_key = Some("s3cret".into());
    let srv = start(cfg);
    let a = srv.addr();
    let body = json!({"prompt": "In", "max_tokens": 2}).to_string();
    for auth in [
        None,
        Some("Bearer nope"),
        Some("s3cret"),
        Some("Basic s3cret"),
    ] {
        let hdr: Vec<(&str, &str)> = auth.map(|v| ("Authorization", v)).into_iter().collect();
        let r = request(a, "POST", COMPLETIONS, &hdr, Some(body.as_bytes()));
        let e = error_of(&r, 401);
        assert_eq!(e["code"], "invalid_api_key");
        assert_eq!(
            error_of(&request(a, "GET", "/v1/models", &hdr, None), 401)["type"],
            "authentication_error"
        );
    }
    let ok = [("Authorization", "Bearer s3cret")];
    assert_eq!(
        request(a, "POST", COMPLETIONS, &ok, Some(body.as_bytes())).status,
        200
    );
    assert_eq!(request(a, "GET", "/v1/models", &ok, None).status, 200);
    assert_eq!(get(a, "/health").status, 200, "health needs no key");
}

fn health(a: SocketAddr) -> Value {
    get(a, "/health").json()
}

/// A streaming client that hangs up after the first tokens stops its generation within a few
/// tokens (the worker checks before every forward pass), not after max_tokens.
#[test]
fn disconnect_mid_stream_cancels_generation() {
    let srv = start_paced(Duration::from_millis(20), 4);
    let a = srv.addr();
    let body = json!({"prompt": "In the beginning", "max_tokens": 200, "temperature": 0,
                      "stream": true});
    let mut s = EventStream::open(a, COMPLETIONS, &body);
    assert_eq!(s.status, 200);
    let first = s.next_data().expect("a first event");
    assert!(first.contains("text_completion"), "{first}");
    drop(s);
    assert!(
        wait_until(Duration::from_secs(10), || health(a)["cancelled"] == 1),
        "cancelled: {}",
        health(a)
    );
    let h = health(a);
    assert_eq!(h["finished"], 0);
    assert_eq!(h["busy"], false);
    // At 20 ms per token, 200 tokens take 4 s; the hang-up is seen within a few tokens.
    let tokens = h["generated_tokens"].as_u64().unwrap();
    assert!(
        tokens < 50,
        "{tokens} tokens generated after the client left"
    );

    // The server is still fine afterwards.
    let r = post(a, COMPLETIONS, &json!({"prompt": "In", "max_tokens": 3}));
    assert_eq!(r.status, 200);
    assert_eq!(health(a)["finished"], 1);
}

/// The same for a non-streaming request: the handler is dropped when the client leaves.
#[test]
fn disconnect_while_waiting_for_a_whole_answer_cancels() {
    let srv = start_paced(Duration::from_millis(20), 4);
    let a = srv.addr();
    let body =
        json!({"prompt": "In the beginning", "max_tokens": 200, "ignore_eos": true}).to_string();
    let mut s = connect(a);
    send(&mut s, "POST", COMPLETIONS, &[], Some(body.as_bytes()));
    assert!(wait_until(Duration::from_secs(10), || health(a)["busy"] == true));
    drop(s);
    assert!(
        wait_until(Duration::from_secs(10), || health(a)["cancelled"] == 1),
        "{}",
        health(a)
    );
    assert!(health(a)["generated_tokens"].as_u64().unwrap() < 100);
}

/// One request runs, `queue` wait, the next gets 503 with Retry-After; a queued request whose
/// client left is skipped.
#[test]
fn full_queue_answers_503() {
    let srv = start_paced(Duration::from_millis(20), 1);
    let a = srv.addr();
    let body = json!({"prompt": "In the beginning", "max_tokens": 200, "stream": true, "ignore_eos": true});
    let running = EventStream::open(a, COMPLETIONS, &body);
    assert!(wait_until(Duration::from_secs(10), || health(a)["busy"] == true));
    let waiting = EventStream::open(a, COMPLETIONS, &body);
    assert!(wait_until(Duration::from_secs(10), || health(a)["waiting"] == 1));
    let r = post(a, COMPLETIONS, &body);
    let e = error_of(&r, 503);
    assert_eq!(e["code"], "queue_full");
    assert_eq!(r.header("retry-after"), Some("1"));
    drop(waiting);
    drop(running);
    assert!(
        wait_until(Duration::from_secs(10), || health(a)["cancelled"] == 2),
        "{}",
        health(a)
    );
    assert_eq!(health(a)["waiting"], 0);
    assert_eq!(
        post(a, COMPLETIONS, &json!({"prompt": "In", "max_tokens": 2})).status,
        200
    );
}

/// `generate_cancellable` (the cmf-llm hook the worker uses) stops before the forward pass
/// after the check turns true, and `generate` is unchanged by it.
#[test]
fn generate_cancellable_stops_between_tokens() {
    use cmf_format::CmfModel;
    use cmf_llm::chat::TextAssets;
    use cmf_llm::generate::generate_cancellable;
    use std::cell::Cell;
    let file = CmfModel::open(model_path()).unwrap();
    let model = cmf_llm::Model::load(&file).unwrap();
    let assets = TextAssets::from_cmf(&file).unwrap();
    let ids = text_ids("In the beginning");
    let cfg = gen_config(20, greedy(), &[]);
    let (full, _) = reference(&ids, &cfg);
    // The check runs before the prefill (call 1) and before each decode step (call k + 1
    // comes after token k was sampled).
    for cancel_at in [1usize, 2, 6] {
        let calls = Cell::new(0usize);
        let mut engine =
            cmf_llm::engine::CpuEngine::new(&model, 256, cmf_kernels::KvDtype::F16).unwrap();
        let mut text = String::new();
        let stats = generate_cancellable(
            &mut engine,
            &assets.tokenizer,
            &ids,
            &mut Vec::new(),
            &cfg,
            &mut |t| text.push_str(t),
            &|| {
                calls.set(calls.get() + 1);
                calls.get() >= cancel_at
            },
        )
        .unwrap();
        assert_eq!(stats.finish, FinishReason::Cancelled);
        assert_eq!(calls.get(), cancel_at);
        assert_eq!(stats.generated_tokens, cancel_at - 1);
        let cached = if cancel_at == 1 {
            0
        } else {
            ids.len() + cancel_at - 2
        };
        assert_eq!(engine.state.len(), cached);
        assert!(full.starts_with(&text), "{text:?} vs {full:?}");
    }
}
