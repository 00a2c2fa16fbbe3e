//! Streaming writer: tensors go to disk as they are added, so a model never has to fit in RAM.
//!
//! File layout it produces (sections are found only through the envelope, spec §1):
//!
//! ```text
//! [0]     envelope (written last, over a zeroed placeholder)
//! [4096]  data section: tensors, each 64-aligned, ≥ 16 KiB ones 4096-aligned
//!         vocab (tokenizer.json) | header JSON | tensor directory
//! ```
//!
//! Putting the header and directory *after* the data means nothing has to be reserved or
//! estimated before the first tensor arrives; the reference reader accepts this order (tested
//! in `tests/interop_ours_in_oracle.rs`). Output goes to a temp file beside the destination,
//! `<name>.<random>.tmp` (`<name>.part00002.<random>.tmp` per shard), created exclusively
//! (`O_EXCL`), so two writers to the same path never share one and a stale temp file of a killed
//! process is never reused. It is renamed into place (atomically) only by a successful
//! [`CmfWriter::finish`]; dropping an unfinished writer deletes its temp files, so a failure
//! never leaves a half-written `.cmf`. Of two concurrent writers the last rename wins, and
//! either way the destination is one complete file.
//!
//! Sharding: with [`CmfWriter::create_sharded`], a new shard starts when the next tensor would
//! push the current shard's data section past the limit. If everything fits in one shard the
//! result is the single file `path`; otherwise shards are named
//! `{base}-{no:05}-of-{count:05}.cmf` ([`shard_path`]), each a complete, valid file with
//! `"shard": {"no", "count"}` in its header; the tokenizer bundle and vocab live in shard 1 only.

use std::collections::HashSet;
use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::directory::{self, NewEntry};
use crate::dtype::Dtype;
use crate::envelope::{
    features, Envelope, Section, Span, DATA_ALIGN, LARGE_TENSOR_ALIGN, LARGE_TENSOR_MIN,
    TENSOR_ALIGN,
};
use crate::error::{Error, Result};
use crate::hash::{hash64, Hasher64};
use crate::header::{hash_hex, Header, SectionHashes, ShardInfo};
use crate::shape::{Shape, MAX_NDIM};

/// Path of shard `no` of `count` for an output named `path` (`dir/model.cmf` →
/// `dir/model-00002-of-00005.cmf`).
pub fn shard_path(path: &Path, no: usize, count: usize) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let stem = name.strip_suffix(".cmf").unwrap_or(&name);
    path.with_file_name(format!("{stem}-{no:05}-of-{count:05}.cmf"))
}

/// Creates a fresh temp file beside `path` (exclusive create with a random name).
fn create_temp(path: &Path, shard: Option<usize>) -> Result<(File, PathBuf)> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let prefix = match shard {
        None => format!("{name}."),
        Some(no) => format!("{name}.part{no:05}."),
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let mut builder = tempfile::Builder::new();
    builder.prefix(&prefix).suffix(".tmp").rand_bytes(8);
    // The mode `File::create` gives (0666 less the umask), not tempfile's private 0600: the
    // result is an ordinary output file.
    #[cfg(unix)]
    builder.permissions(std::os::unix::fs::PermissionsExt::from_mode(0o666));
    let tmp = builder
        .tempfile_in(dir)
        .map_err(|e| Error::io(dir.join(format!("{prefix}*.tmp")), "create", e))?;
    tmp.keep()
        .map_err(|e| Error::io(path, "create temp file", e.error))
}

/// One output file being written.
struct Part {
    tmp: PathBuf,
    file: Option<BufWriter<File>>,
    entries: Vec<NewEntry>,
    /// Bytes written to the data section so far (including alignment padding).
    data_len: u64,
}

/// A tensor being streamed in pieces (see [`CmfWriter::begin_tensor`]).
struct Pending {
    entry: NewEntry,
    hasher: Hasher64,
}

pub struct CmfWriter {
    path: PathBuf,
    header: Header,
    vocab: Option<Vec<u8>>,
    max_shard_bytes: Option<u64>,
    names: HashSet<String>,
    done_parts: Vec<Part>,
    part: Part,
    pending: Option<Pending>,
    /// Set after an I/O error mid-tensor: the temp file no longer matches the bookkeeping.
    poisoned: bool,
    finished: bool,
}

const ZEROS: [u8; 4096] = [0; 4096];

impl CmfWriter {
    /// Starts a single-file output at `path` (written to a temp file beside it until `finish`).
    pub fn create(path: impl AsRef<Path>, header: Header) -> Result<CmfWriter> {
        Self::new(path.as_ref(), header, None)
    }

    /// Starts an output that is split into shards of at most about `max_shard_bytes` of tensor
    /// data each (a single tensor larger than the limit gets a shard of its own).
    pub fn create_sharded(
        path: impl AsRef<Path>,
        header: Header,
        max_shard_bytes: u64,
    ) -> Result<CmfWriter> {
        Self::new(path.as_ref(), header, Some(max_shard_bytes.max(1)))
    }

    fn new(path: &Path, header: Header, max_shard_bytes: Option<u64>) -> Result<CmfWriter> {
        if let Err((field, why)) = header.check_writable() {
            return Err(Error::bad_input(
                path,
                format!("header field {field} {why}"),
            ));
        }
        if header.shard.is_some() {
            return Err(Error::bad_input(
                path,
                "header.shard is set by the writer; leave it None",
            ));
        }
        let part = Self::open_part(path, max_shard_bytes.map(|_| 1))?;
        Ok(CmfWriter {
            path: path.to_path_buf(),
            header,
            vocab: None,
            max_shard_bytes,
            names: HashSet::new(),
            done_parts: Vec::new(),
            part,
            pending: None,
            poisoned: false,
            finished: false,
        })
    }

    fn open_part(path: &Path, shard: Option<usize>) -> Result<Part> {
        let (file, tmp) = create_temp(path, shard)?;
        let mut file = BufWriter::with_capacity(1 << 20, file);
        // Envelope placeholder and padding up to the page-aligned data section.
        file.write_all(&ZEROS[..DATA_ALIGN as usize])
            .map_err(|e| Error::io(&tmp, "write", e))?;
        Ok(Part {
            tmp,
            file: Some(file),
            entries: Vec::new(),
            data_len: 0,
        })
    }

    /// The header that will be written (edit provenance or the tokenizer bundle late).
    pub fn header_mut(&mut self) -> &mut Header {
        &mut self.header
    }

    /// Embeds a Hugging Face `tokenizer.json` (stored verbatim, in shard 1 when sharded).
    pub fn set_vocab(&mut self, tokenizer_json: impl Into<Vec<u8>>) {
        self.vocab = Some(tokenizer_json.into());
    }

    /// Number of tensors added so far.
    pub fn tensor_count(&self) -> usize {
        self.names.len()
    }

    /// Adds one tensor whose stored bytes are already encoded (`codec::encode`, or raw bytes for
    /// `u8`). `bytes.len()` must equal the codec's size for `shape`.
    pub fn add_tensor(
        &mut self,
        name: &str,
        dtype: Dtype,
        shape: &[usize],
        bytes: &[u8],
    ) -> Result<()> {
        let nbytes = self.check_new_tensor(name, dtype, shape)?;
        if nbytes != bytes.len() as u64 {
            return Err(self.bad(
                name,
                format!(
                    "{dtype} {shape:?} takes {nbytes} bytes; {} were supplied",
                    bytes.len()
                ),
            ));
        }
        self.begin_tensor(name, dtype, shape)?;
        self.write_chunk(bytes)?;
        self.end_tensor()
    }

    /// Encodes f32 `values` with `dtype`'s codec and adds the result.
    pub fn add_f32(
        &mut self,
        name: &str,
        dtype: Dtype,
        shape: &[usize],
        values: &[f32],
    ) -> Result<()> {
        let bytes = crate::codec::encode(dtype, shape, values)
            .map_err(|e| Error::bad_input(&self.path, format!("tensor '{name}': {e}")))?;
        self.add_tensor(name, dtype, shape, &bytes)
    }

    /// Starts a tensor whose bytes will arrive through [`write_chunk`](Self::write_chunk) calls,
    /// in order, followed by [`end_tensor`](Self::end_tensor).
    pub fn begin_tensor(&mut self, name: &str, dtype: Dtype, shape: &[usize]) -> Result<()> {
        let nbytes = self.check_new_tensor(name, dtype, shape)?;

        if let Some(limit) = self.max_shard_bytes {
            let would_end = align_up(self.part.data_len, tensor_align(nbytes)) + nbytes;
            if !self.part.entries.is_empty() && would_end > limit {
                self.rotate_part()?;
            }
        }
        let aligned = align_up(self.part.data_len, tensor_align(nbytes));
        let pad = aligned - self.part.data_len;
        self.write_part(|f| write_zeros(f, pad))?;
        self.part.data_len = aligned;
        self.pending = Some(Pending {
            entry: NewEntry {
                name: name.to_string(),
                dtype,
                shape: Shape::new(shape).expect("ndim checked"),
                offset: aligned,
                nbytes,
                hash: 0,
            },
            hasher: Hasher64::new(),
        });
        Ok(())
    }

    /// Validates a tensor about to be added and returns its payload size.
    fn check_new_tensor(&self, name: &str, dtype: Dtype, shape: &[usize]) -> Result<u64> {
        self.usable()?;
        if self.pending.is_some() {
            return Err(self.bad(
                name,
                "begin_tensor called while another tensor is still open",
            ));
        }
        if name.is_empty() || name.len() > u16::MAX as usize {
            return Err(self.bad(name, "tensor names must be 1..=65535 bytes"));
        }
        if self.names.contains(name) {
            return Err(self.bad(name, "duplicate tensor name"));
        }
        if shape.len() > MAX_NDIM || shape.iter().any(|&d| d > u32::MAX as usize) {
            return Err(self.bad(
                name,
                format!("shape {shape:?}: at most 6 dims of at most 2^32 − 1"),
            ));
        }
        let shape64: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
        dtype.expected_nbytes(&shape64).ok_or_else(|| {
            self.bad(
                name,
                dtype
                    .shape_problem(&shape64)
                    .unwrap_or_else(|| "invalid shape".into()),
            )
        })
    }

    /// Appends bytes to the tensor opened by [`begin_tensor`](Self::begin_tensor).
    pub fn write_chunk(&mut self, bytes: &[u8]) -> Result<()> {
        self.usable()?;
        let Some(p) = self.pending.as_mut() else {
            return Err(Error::bad_input(
                &self.path,
                "write_chunk called without begin_tensor",
            ));
        };
        if p.hasher.len() + bytes.len() as u64 > p.entry.nbytes {
            let msg = format!(
                "{} {:?} takes {} bytes; {} were supplied",
                p.entry.dtype,
                p.entry.shape,
                p.entry.nbytes,
                p.hasher.len() + bytes.len() as u64
            );
            let name = p.entry.name.clone();
            return Err(self.bad(&name, msg));
        }
        p.hasher.update(bytes);
        self.write_part(|f| f.write_all(bytes))?;
        self.part.data_len += bytes.len() as u64;
        Ok(())
    }

    /// Closes the streamed tensor; its byte count must be exactly the codec's size.
    pub fn end_tensor(&mut self) -> Result<()> {
        self.usable()?;
        let Some(p) = self.pending.take() else {
            return Err(Error::bad_input(
                &self.path,
                "end_tensor called without begin_tensor",
            ));
        };
        if p.hasher.len() != p.entry.nbytes {
            let msg = format!(
                "{} {:?} takes {} bytes; only {} were supplied",
                p.entry.dtype,
                p.entry.shape,
                p.entry.nbytes,
                p.hasher.len()
            );
            self.poisoned = true;
            return Err(self.bad(&p.entry.name, msg));
        }
        let mut entry = p.entry;
        entry.hash = p.hasher.finish();
        self.names.insert(entry.name.clone());
        self.part.entries.push(entry);
        Ok(())
    }

    fn usable(&self) -> Result<()> {
        if self.poisoned {
            return Err(Error::bad_input(
                &self.path,
                "writer is unusable after an earlier error",
            ));
        }
        Ok(())
    }

    fn bad(&self, tensor: &str, msg: impl std::fmt::Display) -> Error {
        Error::bad_input(&self.path, format!("tensor '{tensor}': {msg}"))
    }

    fn write_part(
        &mut self,
        op: impl FnOnce(&mut BufWriter<File>) -> std::io::Result<()>,
    ) -> Result<()> {
        let file = self.part.file.as_mut().expect("open part has a file");
        op(file).map_err(|e| {
            self.poisoned = true;
            Error::io(&self.part.tmp, "write", e)
        })
    }

    fn rotate_part(&mut self) -> Result<()> {
        let next = self.done_parts.len() + 2;
        let new = Self::open_part(&self.path, Some(next))?;
        let old = std::mem::replace(&mut self.part, new);
        self.done_parts.push(old);
        Ok(())
    }

    /// Writes vocab, header and directory after each file's data, the envelope in front, syncs,
    /// and renames the temp files into place. Returns the path to open: `path` itself, or
    /// shard 1 when the output was split.
    pub fn finish(mut self) -> Result<PathBuf> {
        self.usable()?;
        if let Some(p) = &self.pending {
            return Err(self.bad(
                &p.entry.name,
                "finish called while the tensor is still open",
            ));
        }
        if let Err((field, why)) = self.header.check_writable() {
            return Err(Error::bad_input(
                &self.path,
                format!("header field {field} {why}"),
            ));
        }
        let mut parts = std::mem::take(&mut self.done_parts);
        let last = std::mem::replace(
            &mut self.part,
            Part {
                tmp: PathBuf::new(),
                file: None,
                entries: Vec::new(),
                data_len: 0,
            },
        );
        if last.entries.is_empty() && !parts.is_empty() {
            // A shard with no tensors: the limit was hit exactly by the previous tensor.
            let _ = std::fs::remove_file(&last.tmp);
        } else {
            parts.push(last);
        }
        let count = parts.len();
        let finals: Vec<PathBuf> = if self.max_shard_bytes.is_none() || count == 1 {
            vec![self.path.clone()]
        } else {
            (1..=count)
                .map(|no| shard_path(&self.path, no, count))
                .collect()
        };
        // From here on the parts are ours to clean up on failure.
        let result = self.finish_parts(&mut parts, &finals);
        if result.is_err() {
            for p in &parts {
                let _ = std::fs::remove_file(&p.tmp);
            }
        }
        self.finished = true;
        result?;
        sync_dir(&self.path);
        Ok(finals[0].clone())
    }

    fn finish_parts(&self, parts: &mut [Part], finals: &[PathBuf]) -> Result<()> {
        let count = parts.len();
        for (i, part) in parts.iter_mut().enumerate() {
            let mut header = self.header.clone();
            let vocab = if i == 0 { self.vocab.as_deref() } else { None };
            if count > 1 {
                header.shard = Some(ShardInfo { no: i + 1, count });
            }
            if i > 0 {
                header.tokenizer_config = None;
            }
            header.section_hashes = vocab.map(|v| SectionHashes {
                vocab: Some(hash_hex(hash64(v))),
                ..Default::default()
            });
            write_tail(part, &header, vocab)?;
        }
        for (part, dest) in parts.iter().zip(finals) {
            std::fs::rename(&part.tmp, dest)
                .map_err(|e| Error::io(dest, "rename temp file into place", e))?;
        }
        Ok(())
    }
}

impl Drop for CmfWriter {
    fn drop(&mut self) {
        if !self.finished {
            for p in self.done_parts.iter().chain(std::iter::once(&self.part)) {
                if !p.tmp.as_os_str().is_empty() {
                    let _ = std::fs::remove_file(&p.tmp);
                }
            }
        }
    }
}

/// Appends vocab, header JSON and directory to a part whose data is complete, then writes the
/// envelope at offset 0 and syncs the file.
fn write_tail(part: &mut Part, header: &Header, vocab: Option<&[u8]>) -> Result<()> {
    let tmp = part.tmp.clone();
    let tmp = &tmp;
    let io = |op: &'static str| move |e: std::io::Error| Error::io(tmp, op, e);
    let header_json = serde_json::to_vec(header)
        .map_err(|e| Error::bad_input(&part.tmp, format!("header: {e}")))?;
    let pool_len: usize = part.entries.iter().map(|e| e.name.len()).sum();
    if pool_len > u32::MAX as usize {
        return Err(Error::bad_input(
            &part.tmp,
            "tensor names exceed the 4 GiB name pool",
        ));
    }
    let dir = directory::encode(&part.entries);

    let mut env = Envelope {
        required_features: features::TENSOR_DIR,
        ..Default::default()
    };
    if part.entries.iter().any(|e| e.dtype == Dtype::Q8_2f) {
        env.required_features |= features::QUANT_2F;
    }
    let data_off = DATA_ALIGN;
    env.set_section(Section::Data, Span::new(data_off, part.data_len));
    let mut cursor = data_off + part.data_len;
    let mut place = |s: Section, len: usize| {
        env.set_section(s, Span::new(cursor, len as u64));
        cursor += len as u64;
    };
    if let Some(v) = vocab {
        place(Section::Vocab, v.len());
    }
    place(Section::Header, header_json.len());
    place(Section::Directory, dir.len());
    env.header_hash = hash64(&header_json);
    env.dir_hash = hash64(&dir);

    let mut file = part.file.take().expect("part is open");
    if let Some(v) = vocab {
        file.write_all(v).map_err(io("write"))?;
    }
    file.write_all(&header_json).map_err(io("write"))?;
    file.write_all(&dir).map_err(io("write"))?;
    let mut file = file
        .into_inner()
        .map_err(|e| Error::io(&part.tmp, "write", e.into_error()))?;
    file.seek(SeekFrom::Start(0)).map_err(io("seek"))?;
    file.write_all(&env.encode()).map_err(io("write"))?;
    file.sync_all().map_err(io("sync"))?;
    Ok(())
}

fn tensor_align(nbytes: u64) -> u64 {
    if nbytes >= LARGE_TENSOR_MIN {
        LARGE_TENSOR_ALIGN
    } else {
        TENSOR_ALIGN
    }
}

fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

fn write_zeros(f: &mut impl Write, mut n: u64) -> std::io::Result<()> {
    while n > 0 {
        let k = n.min(ZEROS.len() as u64) as usize;
        f.write_all(&ZEROS[..k])?;
        n -= k as u64;
    }
    Ok(())
}

/// Makes the renames durable (best effort: not every platform can sync a directory).
fn sync_dir(path: &Path) {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}
