//! `text_assets`: see `cmf_llm::fuzzing::text_assets` (the body, shared with the corpus test under `cargo test`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    cmf_llm::fuzzing::abort_on_unguarded_panics();
    cmf_llm::fuzzing::text_assets(data)
});
