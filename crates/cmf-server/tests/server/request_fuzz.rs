//! Fuzz-style robustness of the request path: random byte-level and JSON-structure mutations of
//! valid bodies go through `parse_chat` / `parse_completion` and, when they parse, through
//! `prepare` (chat template + tokenizer + context checks). Nothing may panic; every refusal is a
//! 4xx with a message. Deterministic (seeded xoshiro), a few thousand cases, well under a second
//! of work. `fuzz/fuzz_targets/openai_request.rs` runs the same entry points under libFuzzer.

use crate::fixture::{assets, guidance};
use cmf_llm::sampling::Xoshiro256;
use cmf_server::prompt::{prepare, PromptLimits};
use cmf_server::request::{parse_chat, parse_completion, Limits};
use serde_json::{json, Value};

const SEEDS: &[&str] = &[
    r#"{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi there"}],"temperature":0.7,"top_p":0.9,"max_tokens":16,"stream":true,"stream_options":{"include_usage":true},"stop":["\n","END"],"seed":3}"#,
    r#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},{"role":"assistant","content":"c"},{"role":"user","content":"d","name":"x"}],"n":1,"presence_penalty":1.5,"frequency_penalty":-1,"repetition_penalty":1.2,"top_k":5,"min_p":0.1,"max_completion_tokens":4}"#,
    r#"{"prompt":"In the beginning","max_tokens":8,"temperature":0,"stop":"God","echo":false,"best_of":1,"logprobs":null}"#,
    r#"{"prompt":[1,2,3,400],"max_tokens":2}"#,
    r#"{"prompt":[[5,6]],"logit_bias":{},"user":"u","suffix":null}"#,
    r#"{"messages":[{"role":"user","content":"q"},{"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}]},{"role":"tool","tool_call_id":"c","content":"1"}],"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"a":{"type":"integer"}}}}}],"tool_choice":"required","logprobs":true,"top_logprobs":2,"n":2,"logit_bias":{"3":-5}}"#,
    r#"{"messages":[{"role":"user","content":"q"}],"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":{"type":"object","properties":{"b":{"type":"string"}},"required":["b"]}}},"reasoning_effort":"low","metadata":{},"store":false}"#,
    r#"{"prompt":"abc","echo":true,"logprobs":3,"n":2,"best_of":2}"#,
];

struct Rng(Xoshiro256);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        (self.0.next_u64() % n.max(1) as u64) as usize
    }
    fn chance(&mut self, one_in: usize) -> bool {
        self.below(one_in) == 0
    }
}

fn random_value(r: &mut Rng, depth: usize) -> Value {
    match r.below(if depth > 3 { 8 } else { 11 }) {
        0 => Value::Null,
        1 => json!(r.chance(2)),
        2 => json!(r.0.next_u64()),
        3 => json!(-(r.below(1000) as i64)),
        4 => json!([1e308, -1e-308, 0.5, 2.0, 1e19][r.below(5)]),
        5 => json!(
            [
                "",
                "user",
                "system",
                "assistant",
                "text",
                "<|im_end|>",
                "\u{0}\u{ffff}",
                "é😀"
            ][r.below(8)]
        ),
        6 => json!("x".repeat(r.below(3000))),
        7 => json!(i64::MIN),
        8 => Value::Array(
            (0..r.below(4))
                .map(|_| random_value(r, depth + 1))
                .collect(),
        ),
        9 => {
            let keys = [
                "role",
                "content",
                "type",
                "text",
                "include_usage",
                "messages",
                "prompt",
                "zz",
            ];
            Value::Object(
                (0..r.below(4))
                    .map(|_| {
                        (
                            keys[r.below(keys.len())].to_string(),
                            random_value(r, depth + 1),
                        )
                    })
                    .collect(),
            )
        }
        _ => {
            // Deep nesting, up to past serde_json's recursion limit when serialized and reparsed.
            let mut v = json!(1);
            for _ in 0..r.below(200) {
                v = json!([v]);
            }
            v
        }
    }
}

/// Replaces, removes or adds one node somewhere in `v`.
fn mutate_value(r: &mut Rng, v: &mut Value, depth: usize) {
    let fields = [
        "messages",
        "prompt",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "seed",
        "stop",
        "n",
        "stream",
        "stream_options",
        "logprobs",
        "tools",
        "response_format",
        "tool_choice",
        "echo",
        "suffix",
        "best_of",
        "logit_bias",
        "user",
        "model",
        "bogus",
    ];
    match v {
        Value::Object(m) if !m.is_empty() && (depth == 0 || !r.chance(3)) => {
            let keys: Vec<String> = m.keys().cloned().collect();
            match r.below(4) {
                0 => {
                    m.remove(&keys[r.below(keys.len())]);
                }
                1 => {
                    m.insert(fields[r.below(fields.len())].into(), random_value(r, depth));
                }
                _ => {
                    let k = &keys[r.below(keys.len())];
                    mutate_value(r, m.get_mut(k).unwrap(), depth + 1);
                }
            }
        }
        Value::Array(a) if !a.is_empty() && !r.chance(3) => {
            let i = r.below(a.len());
            match r.below(3) {
                0 => {
                    a.remove(i);
                }
                1 => a.push(random_value(r, depth)),
                _ => mutate_value(r, &mut a[i], depth + 1),
            }
        }
        _ => *v = random_value(r, depth),
    }
}

fn mutate_bytes(r: &mut Rng, b: &mut Vec<u8>) {
    for _ in 0..1 + r.below(4) {
        let n = b.len();
        match r.below(6) {
            0 if n > 0 => {
                let i = r.below(n);
                b[i] ^= 1 << r.below(8);
            }
            1 => {
                let i = r.below(n + 1);
                let tokens: [&[u8]; 10] = [
                    b"{",
                    b"}",
                    b"[",
                    b"]",
                    b"\"",
                    b",",
                    b":",
                    b"\\u",
                    b"\xff\xfe",
                    b"1e999",
                ];
                let t = tokens[r.below(tokens.len())];
                b.splice(i..i, t.iter().copied());
            }
            2 if n > 0 => {
                let i = r.below(n);
                let j = (i + r.below(16)).min(n);
                b.drain(i..j);
            }
            3 if n > 0 => b.truncate(r.below(n)),
            4 if n > 0 => {
                let i = r.below(n);
                let j = (i + r.below(32)).min(n);
                let dup = b[i..j].to_vec();
                b.splice(i..i, dup);
            }
            _ => b.push(r.below(256) as u8),
        }
    }
}

#[test]
fn mutated_requests_never_panic() {
    let assets = assets();
    let guidance = guidance();
    let limits = Limits { ctx: 256 };
    let prompt_limits = PromptLimits {
        ctx: 256,
        max_tokens_default: 16,
        vocab_size: 512,
    };
    let mut r = Rng(Xoshiro256::seed(0x5eed));
    let (mut ok, mut refused) = (0usize, 0usize);
    for case in 0..6000 {
        let seed = SEEDS[case % SEEDS.len()];
        let body: Vec<u8> = if case % 2 == 0 {
            let mut v: Value = serde_json::from_str(seed).unwrap();
            for _ in 0..1 + r.below(3) {
                mutate_value(&mut r, &mut v, 0);
            }
            serde_json::to_vec(&v).unwrap()
        } else {
            let mut b = seed.as_bytes().to_vec();
            mutate_bytes(&mut r, &mut b);
            b
        };
        for parsed in [parse_chat(&body, limits), parse_completion(&body, limits)] {
            let outcome =
                parsed.and_then(|req| prepare(&assets, &guidance, &req, prompt_limits, 1));
            match outcome {
                Ok(p) => {
                    ok += 1;
                    assert!(!p.ids.is_empty() && p.ids.len() < 256);
                    assert!(p.gen.max_tokens >= 1 && p.ids.len() + p.gen.max_tokens <= 256);
                    p.gen.sampling.validate().unwrap();
                }
                Err(e) => {
                    refused += 1;
                    assert_eq!(
                        e.status.as_u16(),
                        400,
                        "{e} for {:?}",
                        String::from_utf8_lossy(&body)
                    );
                    assert!(!e.message.is_empty());
                }
            }
        }
    }
    // The mutations must exercise both outcomes, or the test proves little.
    assert!(ok > 300 && refused > 3000, "ok {ok}, refused {refused}");
}
