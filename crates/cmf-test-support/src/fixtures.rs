//! Where the committed fixtures are (`fixtures/` at the repository's root).

use std::path::PathBuf;

/// `rel` under the fixtures directory: `$CMF_FIXTURES` (test binaries run away from the source
/// tree), else `./fixtures` where that exists (a staged copy of the repository), else the
/// source tree's.
pub fn path(rel: &str) -> PathBuf {
    let root = match std::env::var_os("CMF_FIXTURES") {
        Some(d) => PathBuf::from(d),
        None if PathBuf::from("fixtures").is_dir() => PathBuf::from("fixtures"),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures"),
    };
    root.join(rel)
}
