//! `openai_request`: arbitrary bytes as the body of `POST /v1/chat/completions` and
//! `POST /v1/completions`. The parsers must refuse bad input with an error (400) and never
//! panic; an accepted request must hold parameters the sampler accepts.
#![no_main]

use cmf_server::request::{parse_chat, parse_completion, Limits};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let limits = Limits { ctx: 4096 };
    for parsed in [parse_chat(data, limits), parse_completion(data, limits)] {
        match parsed {
            Ok(req) => {
                assert!(req.sampling.validate().is_ok());
                assert!(req.max_tokens.is_none_or(|m| (1..=4096).contains(&m)));
            }
            Err(e) => assert_eq!(e.status.as_u16(), 400),
        }
    }
});
