//! `model_loader`: see `cmf_llm::fuzzing::model_loader` (the body, shared with the corpus test under `cargo test`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    cmf_llm::fuzzing::abort_on_unguarded_panics();
    cmf_llm::fuzzing::model_loader(data)
});
