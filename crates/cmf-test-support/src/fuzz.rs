//! Runs a fuzz target's committed corpus (`fuzz/corpus/<target>/`: seeds and regression
//! reproducers) through the target's body under `cargo test`, for the crates whose functions the
//! targets call.

use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The corpus directory of `target`.
pub fn corpus(target: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target)
}

/// Every file of `target`'s corpus through `body`: none may panic, each done within 10 s, and
/// the corpus holds at least `min_files`.
pub fn run_corpus(target: &str, min_files: usize, body: fn(&[u8])) {
    let dir = corpus(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(
        files.len() >= min_files,
        "{}: {} files",
        dir.display(),
        files.len()
    );
    for f in files {
        let bytes = std::fs::read(&f).unwrap();
        let start = Instant::now();
        body(&bytes);
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{}: {:?}",
            f.display(),
            start.elapsed()
        );
    }
}
