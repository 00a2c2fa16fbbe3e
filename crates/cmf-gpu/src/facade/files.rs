//! Files the GPU code keeps on disk (compiled kernels, prebuilt images): where they live and how
//! they are written so that a reader never sees half a file.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// `$XDG_CACHE_HOME/cmf` or `~/.cache/cmf` (None when neither is known).
pub fn cache_dir() -> Option<PathBuf> {
    cache_dir_from(std::env::var_os("XDG_CACHE_HOME"), std::env::var_os("HOME"))
}

/// [`cache_dir`] from the two variables' values (an empty value counts as unset).
fn cache_dir_from(xdg_cache_home: Option<OsString>, home: Option<OsString>) -> Option<PathBuf> {
    if let Some(x) = xdg_cache_home.filter(|v| !v.is_empty()) {
        return Some(PathBuf::from(x).join("cmf"));
    }
    home.filter(|v| !v.is_empty())
        .map(|h| PathBuf::from(h).join(".cache").join("cmf"))
}

/// Writes `bytes` to `path` through a temporary file in the same directory and a rename,
/// creating the directory if needed.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_dir_prefers_xdg_then_home() {
        let some = |s: &str| Some(OsString::from(s));
        assert_eq!(
            cache_dir_from(some("/x"), some("/h")),
            Some(PathBuf::from("/x/cmf"))
        );
        assert_eq!(
            cache_dir_from(some(""), some("/h")),
            Some(PathBuf::from("/h/.cache/cmf"))
        );
        assert_eq!(
            cache_dir_from(None, some("/h")),
            Some(PathBuf::from("/h/.cache/cmf"))
        );
        assert_eq!(cache_dir_from(None, some("")), None);
        assert_eq!(cache_dir_from(None, None), None);
    }

    #[test]
    fn write_atomic_creates_the_directory_and_replaces_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a").join("b").join("k.cubin");
        write_atomic(&file, b"first").unwrap();
        write_atomic(&file, b"second").unwrap();
        assert_eq!(std::fs::read(&file).unwrap(), b"second");
        // No temporary file is left beside it.
        let names: Vec<_> = std::fs::read_dir(file.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![OsString::from("k.cubin")]);
    }

    #[test]
    fn write_atomic_reports_a_path_it_cannot_write() {
        let dir = tempfile::tempdir().unwrap();
        // A regular file where the parent directory should be.
        let blocker = dir.path().join("blocker");
        std::fs::write(&blocker, b"x").unwrap();
        assert!(write_atomic(&blocker.join("k.cubin"), b"y").is_err());
        assert_eq!(std::fs::read(&blocker).unwrap(), b"x");
    }
}
