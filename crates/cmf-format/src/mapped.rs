//! Which bytes of this process are a mapped CMF file, and where they lie in it.
//!
//! A tensor view is a slice of the file's map. A bulk reader that copies gigabytes out of it
//! (the GPU's staged uploads) pays a page fault for every 4 KiB page it touches first; reading
//! the same bytes with `pread` into its own buffer instead copies them straight out of the page
//! cache and leaves the map untouched. [`CmfFile::open`](crate::CmfFile::open) registers its
//! map here for as long as the file is open; [`file_range`] answers for a slice.

use std::fs::File;
use std::sync::{Arc, Mutex};

struct Mapping {
    base: usize,
    len: usize,
    file: Arc<File>,
}

static MAPPINGS: Mutex<Vec<Mapping>> = Mutex::new(Vec::new());

fn mappings() -> std::sync::MutexGuard<'static, Vec<Mapping>> {
    MAPPINGS.lock().unwrap_or_else(|p| p.into_inner())
}

/// Keeps a map registered; unregisters it on drop.
pub(crate) struct Registration {
    base: usize,
}

/// Registers `map` (the whole of `file`, mapped read-only from offset 0).
pub(crate) fn register(map: &[u8], file: Arc<File>) -> Registration {
    let base = map.as_ptr() as usize;
    mappings().push(Mapping {
        base,
        len: map.len(),
        file,
    });
    Registration { base }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut maps = mappings();
        if let Some(i) = maps.iter().position(|m| m.base == self.base) {
            maps.swap_remove(i);
        }
    }
}

/// The open file and offset that hold `bytes`, when they lie wholly inside the map of an open
/// [`CmfFile`](crate::CmfFile); `pread` at that offset returns the same bytes (the file is
/// never rewritten in place while mapped: see `CmfFile`).
pub fn file_range(bytes: &[u8]) -> Option<(Arc<File>, u64)> {
    let start = bytes.as_ptr() as usize;
    let end = start.checked_add(bytes.len())?;
    mappings()
        .iter()
        .find(|m| start >= m.base && end <= m.base + m.len)
        .map(|m| (m.file.clone(), (start - m.base) as u64))
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::FileExt;

    #[test]
    fn a_slice_of_an_open_file_reads_back_the_same_bytes() {
        let mut tmp = tempfile::NamedTempFile::new().unwrap();
        let bytes: Vec<u8> = (0..10_000u32).map(|i| (i * 13 % 251) as u8).collect();
        tmp.write_all(&bytes).unwrap();
        let file = Arc::new(File::open(tmp.path()).unwrap());
        // SAFETY: a test file nobody else writes.
        let map = unsafe { memmap2::Mmap::map(&*file) }.unwrap();
        let reg = register(&map, file);
        let slice = &map[1234..5678];
        let (f, off) = file_range(slice).expect("registered");
        assert_eq!(off, 1234);
        let mut back = vec![0u8; slice.len()];
        f.read_exact_at(&mut back, off).unwrap();
        assert_eq!(back, slice);
        assert!(file_range(&bytes[..10]).is_none(), "not a mapped file");
        drop(reg);
        assert!(file_range(slice).is_none(), "unregistered on drop");
    }
}
