//! Scratch directories a test binary makes once and shares.

use std::path::PathBuf;

/// A scratch directory for files a test binary makes once and shares through a static (statics
/// are never dropped, so a `TempDir` held there leaked one directory per run): `name` under
/// `target_tmp`, emptied at first use, or under the system temp dir where that cannot be made
/// (test binaries copied to another machine). `target_tmp` is cargo's per-target tmp dir, which
/// only the test binary itself sees: `env!("CARGO_TARGET_TMPDIR")` there.
pub fn scratch_dir(target_tmp: &str, name: &str) -> PathBuf {
    let bases = [
        PathBuf::from(target_tmp),
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
