//! Bodies of the fuzz targets in `fuzz/` (cargo-fuzz, nightly) as plain functions, so that the
//! committed corpus also runs under `cargo test` on stable (`tests/fuzz_corpus.rs`). Each takes
//! arbitrary bytes; any panic, abort, hang or runaway allocation is a bug. Errors are expected.

use cmf_format::{CmfFile, CmfModel, TokenizerConfig};

use crate::chat::{Message, TextAssets};

/// For the fuzz targets: libfuzzer-sys turns every panic into an abort (a crash), but a panic
/// inside the tokenizer guard is caught and becomes an error by design; this hook lets those
/// through silently and passes every other panic to the hook that was installed before.
/// Idempotent: the targets call it on every input.
pub fn abort_on_unguarded_panics() {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let abort_hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !crate::chat::tokenizer::inside_guard() {
                abort_hook(info);
            }
        }));
    });
}

/// `text_assets`: a `tokenizer.json`, a NUL byte, then a chat template (no NUL: no template).
/// Loaded as `cmf run` loads them; what loads is then used: a conversation rendered, the result
/// encoded and decoded.
pub fn text_assets(data: &[u8]) {
    let (tokenizer, template) = match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], Some(String::from_utf8_lossy(&data[i + 1..]))),
        None => (data, None),
    };
    let cfg = TokenizerConfig {
        chat_template: template.map(|t| t.into_owned()),
        ..Default::default()
    };
    let Ok(assets) = TextAssets::from_parts("fuzz", tokenizer, &cfg) else {
        return;
    };
    use_assets(&assets);
}

/// `model_loader`: the bytes as a CMF file, then everything `cmf run` does before generating:
/// the model bound to its tensors, the tokenizer and template loaded and used.
pub fn model_loader(data: &[u8]) {
    let Ok(file) = CmfFile::from_bytes("fuzz.cmf", data.to_vec()) else {
        return;
    };
    let model = CmfModel::from_single(file);
    let _ = crate::Model::load(&model);
    if let Ok(assets) = TextAssets::from_cmf(&model) {
        use_assets(&assets);
    }
}

fn use_assets(assets: &TextAssets) {
    let msgs = [
        Message::new("system", "Be brief."),
        Message::new("user", "Hello, world! café 東京"),
    ];
    if let Ok(text) = assets.template.render(&msgs, true) {
        if let Ok(ids) = assets.tokenizer.encode(&text, true) {
            let _ = assets.tokenizer.decode(&ids, false);
            let mut dec = assets.tokenizer.text_decoder(&[], false);
            for &id in ids.iter().take(64) {
                let _ = dec.push(id);
            }
            let _ = dec.flush();
        }
    }
}
