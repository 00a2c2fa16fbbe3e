//! Opening input files that must be regular files. `open(2)` on a FIFO blocks until a writer
//! appears, and a device can stream for ever, so the path's metadata is checked first (`stat`
//! does not block) and anything but a regular file is refused with an error naming it.

use std::fs::File;
use std::io;
use std::path::Path;

/// `path` (symlinks followed) when it is a regular file; an `InvalidInput` error otherwise.
pub fn check(path: &Path) -> io::Result<()> {
    let ty = std::fs::metadata(path)?.file_type();
    if ty.is_file() {
        return Ok(());
    }
    let what = if ty.is_dir() {
        "a directory"
    } else if ty.is_symlink() {
        "a symbolic link"
    } else {
        "a FIFO, socket or device"
    };
    Err(io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("not a regular file ({what})"),
    ))
}

/// [`File::open`] for regular files only.
pub fn open(path: impl AsRef<Path>) -> io::Result<File> {
    check(path.as_ref())?;
    File::open(path)
}

/// [`std::fs::read`] for regular files only.
pub fn read(path: impl AsRef<Path>) -> io::Result<Vec<u8>> {
    check(path.as_ref())?;
    std::fs::read(path)
}

/// [`std::fs::read_to_string`] for regular files only.
pub fn read_to_string(path: impl AsRef<Path>) -> io::Result<String> {
    check(path.as_ref())?;
    std::fs::read_to_string(path)
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    #[test]
    fn fifos_and_directories_are_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo with a valid NUL-terminated path.
        assert_eq!(unsafe { libc_mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = read(&fifo).unwrap_err();
        assert!(e.to_string().contains("FIFO"), "{e}");
        assert!(open(dir.path())
            .unwrap_err()
            .to_string()
            .contains("directory"));
        let f = dir.path().join("f");
        std::fs::write(&f, b"x").unwrap();
        assert_eq!(read(&f).unwrap(), b"x");
    }

    extern "C" {
        #[link_name = "mkfifo"]
        fn libc_mkfifo(path: *const std::ffi::c_char, mode: u32) -> i32;
    }
}
