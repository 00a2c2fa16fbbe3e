//! `gguf`: see `cmf_convert::fuzzing::gguf` (the body, shared with the corpus test under `cargo test`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // libfuzzer-sys aborts on every panic; a panic inside the tokenizer guard is caught and
    // becomes an error by design, so only the others count as crashes.
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let abort_hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !cmf_llm::chat::tokenizer::inside_guard() {
                abort_hook(info);
            }
        }));
    });
    cmf_convert::fuzzing::gguf(data)
});
