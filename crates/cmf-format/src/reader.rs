//! Opening one `.cmf` file: map it, validate envelope, header and directory, hand out tensors
//! as borrowed views. Opening costs O(header + directory), never O(file): tensor bytes are
//! touched only when a caller reads them (or by [`CmfFile::verify`]).

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::codec::{self, CodecError};
use crate::directory::{self, Directory, Entry};
use crate::dtype::Dtype;
use crate::envelope::{features, Envelope, Section, ENVELOPE_LEN};
use crate::error::{Error, Fault, Result};
use crate::hash::hash64;
use crate::header::Header;
use crate::mapped;
use crate::shape::Shape;
use crate::verify::{self, VerifyReport};

/// A validated, memory-mapped CMF v2 file.
///
/// The map is read-only and shared with the page cache. As with any mmap, the file must not be
/// truncated or rewritten in place while it is open (our writer never does: it renames a new
/// file over the old one, which leaves this mapping intact).
pub struct CmfFile {
    path: PathBuf,
    /// Declared before `map` so that it is dropped first.
    _registration: Option<mapped::Registration>,
    map: Backing,
    envelope: Envelope,
    header: Header,
    dir: Directory,
}

/// The file's bytes: normally a read-only map, or a buffer for [`CmfFile::from_bytes`].
enum Backing {
    /// Shared so that a background page release ([`CmfFile::release_pages_in_background`])
    /// keeps the mapping alive until it is done.
    Map(Arc<Mmap>),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Backing {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Backing::Map(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// One tensor, borrowed from the mapped file.
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    pub name: &'a str,
    pub dtype: Dtype,
    /// `[rows = out, cols = in]` for weight matrices.
    pub shape: Shape,
    /// The stored payload, exactly `nbytes` long.
    pub data: &'a [u8],
    /// hash64 of `data` as recorded in the directory.
    pub hash: u64,
    /// Absolute byte offset of `data` in its file.
    pub file_offset: u64,
}

impl<'a> TensorView<'a> {
    pub fn numel(&self) -> usize {
        self.shape.numel()
    }

    /// `(rows, cols)` when the tensor is 2-D.
    pub fn rows_cols(&self) -> Option<(usize, usize)> {
        self.shape.rows_cols()
    }

    /// Whether the payload still hashes to the directory's value.
    pub fn hash_ok(&self) -> bool {
        hash64(self.data) == self.hash
    }

    /// Decodes the whole tensor to f32 (allocates `numel` floats).
    pub fn to_f32(&self) -> Result<Vec<f32>, CodecError> {
        codec::decode_vec(self.dtype, &self.shape, self.data)
    }

    /// Decodes elements `[start, start + out.len())` of the row-major tensor.
    pub fn decode_range(&self, start: usize, out: &mut [f32]) -> Result<(), CodecError> {
        codec::decode_range(self.dtype, &self.shape, self.data, start, out)
    }

    /// The payload as f32 values without copying, for f32 tensors.
    #[cfg(target_endian = "little")]
    pub fn as_f32(&self) -> Option<&'a [f32]> {
        (self.dtype == Dtype::F32)
            .then(|| bytemuck::try_cast_slice(self.data).ok())
            .flatten()
    }

    /// The payload as f16 values without copying, for f16 tensors.
    #[cfg(target_endian = "little")]
    pub fn as_f16(&self) -> Option<&'a [half::f16]> {
        (self.dtype == Dtype::F16)
            .then(|| bytemuck::try_cast_slice(self.data).ok())
            .flatten()
    }

    /// The payload as bf16 values without copying, for bf16 tensors.
    #[cfg(target_endian = "little")]
    pub fn as_bf16(&self) -> Option<&'a [half::bf16]> {
        (self.dtype == Dtype::Bf16)
            .then(|| bytemuck::try_cast_slice(self.data).ok())
            .flatten()
    }
}

impl CmfFile {
    /// Maps and validates `path`. Refuses, with the field, tensor and offset named: a short
    /// file, bad magic, version ≠ 2, unknown feature bits, sections outside the file or inside
    /// the envelope, an unaligned data section, task-mask / sparse-index sections (not
    /// implemented), a header that is not valid JSON of the expected shape, and every
    /// directory fault listed in [`directory::parse`]. Hashes are checked by [`verify`](Self::verify).
    pub fn open(path: impl AsRef<Path>) -> Result<CmfFile> {
        let path = path.as_ref().to_path_buf();
        let file = crate::regular::open(&path).map_err(|e| Error::io(&path, "open", e))?;
        let file_len = file
            .metadata()
            .map_err(|e| Error::io(&path, "stat", e))?
            .len();
        if file_len < ENVELOPE_LEN as u64 {
            // Too short to be anything; also avoids mapping an empty file.
            return Self::from_backing(path, Backing::Owned(Vec::new()));
        }
        // SAFETY: the mapping is read-only; the file must not be truncated while mapped (see the
        // type's documentation), which is the standard contract of mmap-based readers.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, "mmap", e))?;
        let registration = mapped::register(&map, Arc::new(file));
        let mut f = Self::from_backing(path, Backing::Map(Arc::new(map)))?;
        f._registration = Some(registration);
        Ok(f)
    }

    /// Validates a file held in memory (`name` is used in error messages). Same checks as
    /// [`open`](Self::open); used by the fuzz target and for small embedded models.
    pub fn from_bytes(name: impl Into<PathBuf>, bytes: Vec<u8>) -> Result<CmfFile> {
        Self::from_backing(name.into(), Backing::Owned(bytes))
    }

    fn from_backing(path: PathBuf, map: Backing) -> Result<CmfFile> {
        let bytes: &[u8] = &map;
        let file_len = bytes.len() as u64;
        let envelope = Envelope::parse(bytes, file_len).map_err(|f| f.in_file(&path))?;
        for s in [Section::Masks, Section::Index] {
            if envelope.section(s).is_present() {
                let field = if s == Section::Masks {
                    "masks_len"
                } else {
                    "index_len"
                };
                let msg = format!(
                    "file has a {} section (task masks / sparse index), which this reader does not implement",
                    s.name()
                );
                return Err(Fault::unsupported(field, msg)
                    .at(s.envelope_offset() + 8)
                    .in_file(&path));
            }
        }
        let header =
            parse_header(bytes, envelope.section(Section::Header)).map_err(|f| f.in_file(&path))?;
        let dir_span = envelope.section(Section::Directory);
        let dir = directory::parse(
            &bytes[dir_span.range()],
            dir_span.off,
            envelope.section(Section::Data).len,
        )
        .map_err(|f| f.in_file(&path))?;
        // q8_2f needs the QUANT_2F bit, so that readers without the codec refuse the file.
        if envelope.required_features & features::QUANT_2F == 0 {
            if let Some(e) = dir.entries.iter().find(|e| e.dtype == Dtype::Q8_2f) {
                return Err(Fault::malformed(
                    "required_features",
                    format!(
                        "bit 2 (QUANT_2F) is clear but tensor '{}' is q8_2f",
                        dir.name(e)
                    ),
                )
                .at(12)
                .in_file(&path));
            }
        }
        Ok(CmfFile {
            path,
            _registration: None,
            map,
            envelope,
            header,
            dir,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The header JSON exactly as stored.
    pub fn header_json(&self) -> &str {
        // Validated as UTF-8 at open.
        std::str::from_utf8(&self.map[self.envelope.section(Section::Header).range()])
            .unwrap_or_default()
    }

    pub fn envelope(&self) -> &Envelope {
        &self.envelope
    }

    /// Size of the file in bytes.
    pub fn file_len(&self) -> u64 {
        self.map.len() as u64
    }

    /// Raw bytes of a section (empty when absent).
    pub fn section_bytes(&self, s: Section) -> &[u8] {
        &self.map[self.envelope.section(s).range()]
    }

    /// The embedded Hugging Face `tokenizer.json`, if the file has one.
    pub fn vocab(&self) -> Option<&[u8]> {
        let span = self.envelope.section(Section::Vocab);
        span.is_present().then(|| &self.map[span.range()])
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.dir.len()
    }

    pub fn is_empty(&self) -> bool {
        self.dir.is_empty()
    }

    /// Looks a tensor up by its exact name (binary search over the directory).
    pub fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        self.dir.find(name).map(|i| self.view(&self.dir.entries[i]))
    }

    /// Like [`tensor`](Self::tensor), but a missing tensor is an error naming the file.
    pub fn get(&self, name: &str) -> Result<TensorView<'_>> {
        self.tensor(name).ok_or_else(|| Error::MissingTensor {
            path: self.path.clone(),
            name: name.into(),
        })
    }

    /// Drops the resident pages of the tensors whose names start with `prefix` from this
    /// process (`madvise(MADV_DONTNEED)` on the read-only mapping): a model that runs in stages
    /// (Z-Image: text encoder, then DiT, then VAE) keeps only the current stage resident. The
    /// mapping stays valid; a later read faults the pages in again from the file. Best effort:
    /// a no-op for in-memory files and on platforms without `madvise`.
    pub fn release_pages(&self, prefix: &str) {
        #[cfg(unix)]
        if let Backing::Map(map) = &self.map {
            advise_dont_need(map, &self.page_ranges(prefix));
        }
    }

    /// [`release_pages`](Self::release_pages) on a thread of its own, returning at once. Dropping
    /// the pages of gigabytes of touched weights takes 0.1–0.2 s (page tables and TLB
    /// shootdowns), which sat between the last DiT step and the VAE decode of a first image. The
    /// thread holds the mapping, so it stays valid until the thread is done; a read of those
    /// pages meanwhile is correct either way (clean pages, faulted in again from the file).
    pub fn release_pages_in_background(&self, prefix: &str) {
        #[cfg(unix)]
        if let Backing::Map(map) = &self.map {
            let (map, ranges) = (map.clone(), self.page_ranges(prefix));
            if ranges.is_empty() {
                return;
            }
            let spawned = std::thread::Builder::new()
                .name("cmf-release-pages".into())
                .spawn(move || advise_dont_need(&map, &ranges));
            if spawned.is_err() {
                // No thread to be had: release here instead, as release_pages does.
                self.release_pages(prefix);
            }
        }
    }

    /// The whole pages inside each tensor under `prefix` (file offsets): a neighbour's bytes
    /// stay resident.
    #[cfg(unix)]
    fn page_ranges(&self, prefix: &str) -> Vec<Range<usize>> {
        const PAGE: u64 = 4096;
        self.tensors()
            .filter(|t| t.name.starts_with(prefix))
            .filter_map(|t| {
                let start = t.file_offset.div_ceil(PAGE) * PAGE;
                let end = (t.file_offset + t.data.len() as u64) / PAGE * PAGE;
                (end > start).then_some(start as usize..end as usize)
            })
            .collect()
    }

    /// All tensors in directory order.
    pub fn tensors(&self) -> impl ExactSizeIterator<Item = TensorView<'_>> + '_ {
        self.dir.entries.iter().map(|e| self.view(e))
    }

    fn view(&self, e: &Entry) -> TensorView<'_> {
        let start = self.envelope.section(Section::Data).off + e.offset;
        let range: Range<usize> = start as usize..(start + e.nbytes) as usize;
        TensorView {
            name: self.dir.name(e),
            dtype: e.dtype,
            shape: e.shape,
            data: &self.map[range],
            hash: e.hash,
            file_offset: start,
        }
    }

    /// Checks the header and directory hashes in the envelope, the vocab hash in the header, and
    /// every tensor's hash. Reads the whole file.
    pub fn verify(&self) -> VerifyReport {
        self.verify_with_progress(&mut |_, _| {})
    }

    /// [`verify`](Self::verify), calling `progress(bytes_done, bytes_total)` as tensors are hashed.
    pub fn verify_with_progress(&self, progress: &mut dyn FnMut(u64, u64)) -> VerifyReport {
        verify::verify_file(self, progress)
    }
}

fn parse_header(map: &[u8], span: crate::envelope::Span) -> std::result::Result<Header, Fault> {
    let at = Section::Header.envelope_offset();
    let bytes = &map[span.range()];
    let text = std::str::from_utf8(bytes).map_err(|e| {
        Fault::malformed("header", format!("header JSON is not UTF-8 ({e})"))
            .at(span.off + e.valid_up_to() as u64)
    })?;
    serde_json::from_str::<Header>(text).map_err(|e| {
        let offset = line_col_offset(text, e.line(), e.column())
            .map(|o| span.off + o as u64)
            .unwrap_or(at);
        Fault::malformed("header", format!("header JSON: {e}")).at(offset)
    })
}

/// Byte offset of a serde_json (line, column) position, both 1-based.
fn line_col_offset(text: &str, line: usize, column: usize) -> Option<usize> {
    if line == 0 {
        return None;
    }
    let line_start = if line == 1 {
        0
    } else {
        text.match_indices('\n').nth(line - 2)?.0 + 1
    };
    Some((line_start + column.saturating_sub(1)).min(text.len()))
}

/// `madvise(MADV_DONTNEED)` over `ranges` of a read-only, file-backed private mapping.
#[cfg(unix)]
fn advise_dont_need(map: &Mmap, ranges: &[Range<usize>]) {
    for r in ranges {
        // SAFETY: MADV_DONTNEED on a read-only, file-backed private mapping only drops clean
        // pages; their contents are re-read from the file on access.
        let _ = unsafe {
            map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, r.start, r.len())
        };
    }
}
