//! Integrity check of a whole file: the hash chain of spec §8.1 (envelope → header and
//! directory → section hashes in the header) plus every tensor's hash64.

use std::fmt;
use std::path::PathBuf;

use crate::envelope::Section;
use crate::hash::hash64;
use crate::reader::CmfFile;

/// One integrity failure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Problem {
    /// A section's bytes do not hash to the recorded value.
    Section {
        file: PathBuf,
        section: &'static str,
        stored: u64,
        actual: u64,
    },
    /// `section_hashes` holds something that is not a hex u64.
    BadSectionHash {
        file: PathBuf,
        section: &'static str,
        value: String,
    },
    /// The header records a hash for a section the envelope does not have (the section was
    /// dropped from the file).
    MissingSection {
        file: PathBuf,
        section: &'static str,
    },
    /// A tensor's bytes do not hash to its directory value.
    Tensor {
        file: PathBuf,
        name: String,
        stored: u64,
        actual: u64,
    },
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::Section {
                file,
                section,
                stored,
                actual,
            } => write!(
                f,
                "{}: {section} section hash mismatch (stored {stored:016x}, actual {actual:016x})",
                file.display()
            ),
            Problem::BadSectionHash {
                file,
                section,
                value,
            } => {
                write!(
                    f,
                    "{}: section_hashes.{section} is not a hex hash: {value:?}",
                    file.display()
                )
            }
            Problem::MissingSection { file, section } => write!(
                f,
                "{}: the header records a hash for the {section} section, which the file does not have",
                file.display()
            ),
            Problem::Tensor {
                file,
                name,
                stored,
                actual,
            } => write!(
                f,
                "{}: tensor '{name}' hash mismatch (stored {stored:016x}, actual {actual:016x})",
                file.display()
            ),
        }
    }
}

/// What `verify` checked and what failed.
#[derive(Debug, Clone, Default)]
pub struct VerifyReport {
    pub tensors_checked: usize,
    pub bytes_hashed: u64,
    /// Sections whose hash was checked (`header`, `dir`, `vocab`).
    pub sections_checked: Vec<&'static str>,
    /// Present sections without a recorded hash (older writers): not checked, not failures.
    pub sections_unrecorded: Vec<&'static str>,
    pub problems: Vec<Problem>,
}

impl VerifyReport {
    pub fn is_ok(&self) -> bool {
        self.problems.is_empty()
    }

    /// Folds another file's report into this one (shard sets).
    pub fn merge(&mut self, other: VerifyReport) {
        self.tensors_checked += other.tensors_checked;
        self.bytes_hashed += other.bytes_hashed;
        self.sections_checked.extend(other.sections_checked);
        self.sections_unrecorded.extend(other.sections_unrecorded);
        self.problems.extend(other.problems);
    }
}

pub(crate) fn verify_file(file: &CmfFile, progress: &mut dyn FnMut(u64, u64)) -> VerifyReport {
    let mut report = VerifyReport::default();
    let env = file.envelope();
    let path = file.path().to_path_buf();
    let check = |report: &mut VerifyReport, section: Section, stored: Option<u64>| {
        let bytes = file.section_bytes(section);
        if bytes.is_empty() {
            return;
        }
        let Some(stored) = stored.filter(|&h| h != 0) else {
            report.sections_unrecorded.push(section.name());
            return;
        };
        report.sections_checked.push(section.name());
        report.bytes_hashed += bytes.len() as u64;
        let actual = hash64(bytes);
        if actual != stored {
            report.problems.push(Problem::Section {
                file: path.clone(),
                section: section.name(),
                stored,
                actual,
            });
        }
    };
    check(&mut report, Section::Header, Some(env.header_hash));
    check(&mut report, Section::Directory, Some(env.dir_hash));
    let recorded = file.header().section_hashes.clone().unwrap_or_default();
    for (section, hex) in [
        (Section::Masks, recorded.masks),
        (Section::Vocab, recorded.vocab),
        (Section::Index, recorded.index),
    ] {
        match hex {
            Some(_) if file.section_bytes(section).is_empty() => {
                report.problems.push(Problem::MissingSection {
                    file: path.clone(),
                    section: section.name(),
                })
            }
            Some(hex) => match u64::from_str_radix(&hex, 16) {
                Ok(h) => check(&mut report, section, Some(h)),
                Err(_) => report.problems.push(Problem::BadSectionHash {
                    file: path.clone(),
                    section: section.name(),
                    value: hex,
                }),
            },
            None => check(&mut report, section, None),
        }
    }

    let total: u64 = file.tensors().map(|t| t.data.len() as u64).sum();
    let mut done = 0u64;
    for t in file.tensors() {
        let actual = hash64(t.data);
        if actual != t.hash {
            report.problems.push(Problem::Tensor {
                file: path.clone(),
                name: t.name.to_string(),
                stored: t.hash,
                actual,
            });
        }
        report.tensors_checked += 1;
        done += t.data.len() as u64;
        progress(done, total);
    }
    report.bytes_hashed += total;
    report
}
