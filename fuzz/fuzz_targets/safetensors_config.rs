//! `safetensors_config`: see `cmf_convert::fuzzing::safetensors_config` (the body, shared with the corpus test under `cargo test`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    cmf_llm::fuzzing::abort_on_unguarded_panics();
    cmf_convert::fuzzing::safetensors_config(data)
});
