//! A prompt piped on stdin, read no further than a context could hold: a token covers at most a
//! few dozen bytes of text in the vocabularies we run, so more than [`BYTES_PER_TOKEN`] bytes per
//! context position can never fit, and reading (then tokenizing) all of a 50 MB stream only to
//! report "context full" would cost gigabytes.

use std::io::Read;

use anyhow::Context;

/// Bytes of prompt text allowed per context position (far above any real text's average).
pub const BYTES_PER_TOKEN: usize = 128;

/// Reads stdin as UTF-8 text; an error when it is longer than `ctx` positions could hold.
pub fn read(ctx: usize) -> anyhow::Result<String> {
    let limit = ctx.saturating_mul(BYTES_PER_TOKEN);
    let mut buf = Vec::new();
    std::io::stdin()
        .lock()
        .take(limit as u64 + 1)
        .read_to_end(&mut buf)
        .context("reading the prompt from stdin")?;
    if buf.len() > limit {
        anyhow::bail!(
            "the prompt on stdin is longer than {limit} bytes, more than a context of {ctx} \
             tokens can hold (raise --ctx, or shorten the prompt)"
        );
    }
    String::from_utf8(buf).context("the prompt on stdin is not UTF-8 text")
}
