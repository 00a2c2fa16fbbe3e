//! A model as the user names it: one `.cmf` file or any file of a shard set (spec §10).
//!
//! Shards are named `{base}-{no:05}-of-{count:05}.cmf` and carry `"shard": {"no", "count"}`
//! in their headers. Opening any of them opens them all, checks that each is the shard its
//! name says and that all share shard 1's `arch`, and refuses a tensor name that appears in two
//! shards. The header, tokenizer bundle and vocab come from shard 1.

use std::path::{Path, PathBuf};

use crate::error::{Error, Fault, Result};
use crate::header::Header;
use crate::reader::{CmfFile, TensorView};
use crate::verify::VerifyReport;
use crate::writer::shard_path;

pub struct CmfModel {
    /// Shard 1 first; a single file is a set of one.
    files: Vec<CmfFile>,
}

/// `(base path with .cmf, no, count)` when `path`'s name ends in `-NNNNN-of-NNNNN.cmf`.
fn parse_shard_name(path: &Path) -> Option<(PathBuf, usize, usize)> {
    let name = path.file_name()?.to_str()?;
    let stem = name.strip_suffix(".cmf")?;
    let (rest, count) = stem.rsplit_once("-of-")?;
    let (base, no) = rest.rsplit_once('-')?;
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(no) || !digits(count) || base.is_empty() {
        return None;
    }
    Some((
        path.with_file_name(format!("{base}.cmf")),
        no.parse().ok()?,
        count.parse().ok()?,
    ))
}

impl CmfModel {
    /// A model of one file already opened (or read with [`CmfFile::from_bytes`]); a shard of a
    /// set stays alone (its siblings are not looked for).
    pub fn from_single(file: CmfFile) -> CmfModel {
        CmfModel { files: vec![file] }
    }

    /// Opens a single file, or the whole shard set that `path` belongs to.
    pub fn open(path: impl AsRef<Path>) -> Result<CmfModel> {
        let path = path.as_ref();
        let first = CmfFile::open(path)?;
        let Some(info) = first.header().shard else {
            return Ok(CmfModel { files: vec![first] });
        };
        let shard_fault = |msg: String| Fault::malformed("shard", msg).in_file(path);
        if info.no == 0 || info.no > info.count {
            return Err(shard_fault(format!(
                "shard number {} is outside 1..={}",
                info.no, info.count
            )));
        }
        let (base, name_no, name_count) = parse_shard_name(path).ok_or_else(|| {
            shard_fault(format!(
                "header says shard {} of {}, but the file name does not end in -{:05}-of-{:05}.cmf, \
                 so the other shards cannot be found",
                info.no, info.count, info.no, info.count
            ))
        })?;
        if (name_no, name_count) != (info.no, info.count) {
            return Err(shard_fault(format!(
                "file name says shard {name_no} of {name_count}, header says {} of {}",
                info.no, info.count
            )));
        }
        let mut files = Vec::with_capacity(info.count);
        let mut given = Some(first);
        for no in 1..=info.count {
            let f = if no == info.no {
                given.take().expect("taken once")
            } else {
                let p = shard_path(&base, no, info.count);
                CmfFile::open(&p).map_err(|e| match e {
                    Error::Io { path, cause, .. } => Error::Io {
                        path,
                        op: "open sibling shard",
                        cause,
                    },
                    other => other,
                })?
            };
            match f.header().shard {
                Some(s) if s.no == no && s.count == info.count => {}
                other => {
                    return Err(Fault::malformed(
                        "shard",
                        format!(
                            "expected shard {no} of {}, header says {other:?}",
                            info.count
                        ),
                    )
                    .in_file(f.path()))
                }
            }
            files.push(f);
        }
        let arch0 = &files[0].header().arch;
        for f in &files[1..] {
            if &f.header().arch != arch0 {
                return Err(
                    Fault::malformed("arch", "differs from shard 1's arch").in_file(f.path())
                );
            }
        }
        // A name in two shards would make lookups depend on search order.
        let mut names: Vec<(&str, usize)> = files
            .iter()
            .enumerate()
            .flat_map(|(i, f)| f.tensors().map(move |t| (t.name, i)))
            .collect();
        names.sort_unstable();
        for w in names.windows(2) {
            if w[0].0 == w[1].0 {
                return Err(Fault::malformed(
                    "name",
                    format!("also in {}", files[w[0].1].path().display()),
                )
                .tensor(w[0].0)
                .in_file(files[w[1].1].path()));
            }
        }
        drop(names);
        Ok(CmfModel { files })
    }

    /// Path of the single file, or of shard 1.
    pub fn path(&self) -> &Path {
        self.files[0].path()
    }

    /// The files of the set, shard 1 first.
    pub fn files(&self) -> &[CmfFile] {
        &self.files
    }

    /// Shard 1's header (the one with the tokenizer bundle).
    pub fn header(&self) -> &Header {
        self.files[0].header()
    }

    pub fn vocab(&self) -> Option<&[u8]> {
        self.files[0].vocab()
    }

    /// Total tensor count over all shards.
    pub fn len(&self) -> usize {
        self.files.iter().map(CmfFile::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        self.files.iter().find_map(|f| f.tensor(name))
    }

    /// Like [`tensor`](Self::tensor), but a missing tensor is an error naming the model.
    pub fn get(&self, name: &str) -> Result<TensorView<'_>> {
        self.tensor(name).ok_or_else(|| Error::MissingTensor {
            path: self.path().to_path_buf(),
            name: name.into(),
        })
    }

    /// [`CmfFile::release_pages`] over every shard.
    pub fn release_pages(&self, prefix: &str) {
        self.files.iter().for_each(|f| f.release_pages(prefix));
    }

    /// [`CmfFile::release_pages_in_background`] over every shard.
    pub fn release_pages_in_background(&self, prefix: &str) {
        self.files
            .iter()
            .for_each(|f| f.release_pages_in_background(prefix));
    }

    /// Every tensor of every shard, shard 1 first, directory order within a shard.
    pub fn tensors(&self) -> impl Iterator<Item = TensorView<'_>> + '_ {
        self.files.iter().flat_map(CmfFile::tensors)
    }

    /// Verifies every file of the set.
    pub fn verify_with_progress(&self, progress: &mut dyn FnMut(u64, u64)) -> VerifyReport {
        let total: u64 = self.tensors().map(|t| t.data.len() as u64).sum();
        let mut done_before = 0u64;
        let mut report = VerifyReport::default();
        for f in &self.files {
            let r = f.verify_with_progress(&mut |done, _| progress(done_before + done, total));
            done_before += f.tensors().map(|t| t.data.len() as u64).sum::<u64>();
            report.merge(r);
        }
        report
    }

    pub fn verify(&self) -> VerifyReport {
        self.verify_with_progress(&mut |_, _| {})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_names() {
        let p = Path::new("/m/qwen-00002-of-00005.cmf");
        assert_eq!(
            parse_shard_name(p),
            Some((PathBuf::from("/m/qwen.cmf"), 2, 5))
        );
        assert_eq!(shard_path(Path::new("/m/qwen.cmf"), 2, 5), p);
        assert_eq!(parse_shard_name(Path::new("/m/qwen.cmf")), None);
        assert_eq!(parse_shard_name(Path::new("/m/q-2-of-5.cmf")), None);
    }
}
