//! Shared by the test suites of several crates (included with `#[path]`, since test helpers
//! cannot be a dependency without a crate of their own).

use std::path::PathBuf;

/// A scratch directory for files a test binary makes once and shares through a static (statics
/// are never dropped, so a `TempDir` held there leaked one directory per run): `name` under
/// cargo's per-target tmp dir, emptied at first use, or under the system temp dir where that
/// cannot be made (test binaries copied to another machine).
pub fn scratch_dir(name: &str) -> PathBuf {
    let bases = [
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")),
        std::env::temp_dir().join("cmf-tests"),
    ];
    for base in bases {
        let dir = base.join(name);
        let _ = std::fs::remove_dir_all(&dir);
        if std::fs::create_dir_all(&dir).is_ok() {
            return dir;
        }
    }
    panic!("no scratch directory for {name}")
}
