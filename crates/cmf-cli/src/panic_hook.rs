//! The process's panic hook, for two panics that are not bugs of ours:
//! - `cmf … | head` closes stdout early. Rust ignores SIGPIPE, so the next `println!` panics with
//!   "failed printing to stdout: Broken pipe"; a reader that stopped reading is not an error, so
//!   that panic ends the process quietly with exit 0.
//! - A malformed `tokenizer.json` can make the `tokenizers` crate panic; cmf-llm catches it and
//!   returns an error carrying the message, so the hook stays silent about it.
//!
//! Every other panic keeps the default report.

pub fn install() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        if msg.starts_with("failed printing to std") && msg.contains(&broken_pipe_text()) {
            std::process::exit(0);
        }
        if cmf_llm::chat::tokenizer::inside_guard() {
            return;
        }
        default(info);
    }));
}

/// How `println!` reports EPIPE in its panic ("Broken pipe (os error 32)" on Linux).
fn broken_pipe_text() -> String {
    std::io::Error::from_raw_os_error(libc::EPIPE).to_string()
}
