//! Errors of the format crate. Every error names the file and, where it applies, the field,
//! tensor and byte offset at fault, so a user can see what is wrong without a hex dump.

use std::fmt;
use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The operating system refused a read, write, rename or map.
    /// (The cause is part of the message, not a separate `source()`, so that printing the
    /// error chain does not repeat it.)
    #[error("{}: {op}: {cause}", path.display())]
    Io {
        path: PathBuf,
        op: &'static str,
        cause: std::io::Error,
    },
    /// The file is not a valid CMF v2 file, or uses something this reader does not implement.
    #[error("{}: {fault}", path.display())]
    Invalid { path: PathBuf, fault: Fault },
    /// A tensor that was asked for is not in the file (or shard set).
    #[error("{}: no tensor named '{name}'", path.display())]
    MissingTensor { path: PathBuf, name: String },
    /// The writer was asked to store something the format cannot hold (bad shape, wrong byte
    /// count, duplicate name, header the reference reader would refuse, ...).
    #[error("{}: {message}", path.display())]
    BadInput { path: PathBuf, message: String },
    /// A codec could not encode or decode the values it was given.
    #[error(transparent)]
    Codec(#[from] crate::codec::CodecError),
}

impl Error {
    /// The structural fault, when the file itself is invalid.
    pub fn fault(&self) -> Option<&Fault> {
        match self {
            Error::Invalid { fault, .. } => Some(fault),
            _ => None,
        }
    }

    pub(crate) fn io(path: impl Into<PathBuf>, op: &'static str, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            op,
            cause: source,
        }
    }

    pub(crate) fn bad_input(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Error::BadInput {
            path: path.into(),
            message: message.into(),
        }
    }
}

/// Whether a refused file is broken or merely beyond this reader.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// Inconsistent or out-of-bounds bytes: the file is corrupt or was written wrongly.
    Malformed,
    /// Well-formed, but needs a version, feature bit or codec this reader does not implement.
    Unsupported,
}

/// What exactly is wrong with a file: the field, the tensor it belongs to (if any) and the
/// absolute byte offset of the field in the file (if known).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    pub kind: FaultKind,
    /// Field name as the spec spells it: `magic`, `version`, `required_features`,
    /// `header_off`, `dir.count`, `name`, `dtype`, `ndim`, `shape`, `offset`, `nbytes`, ...
    pub field: &'static str,
    /// Tensor name, or `#index` when the name itself is unreadable.
    pub tensor: Option<String>,
    /// Absolute file offset of the offending field.
    pub offset: Option<u64>,
    pub message: String,
}

impl Fault {
    pub(crate) fn malformed(field: &'static str, message: impl Into<String>) -> Self {
        Fault {
            kind: FaultKind::Malformed,
            field,
            tensor: None,
            offset: None,
            message: message.into(),
        }
    }

    pub(crate) fn unsupported(field: &'static str, message: impl Into<String>) -> Self {
        Fault {
            kind: FaultKind::Unsupported,
            field,
            tensor: None,
            offset: None,
            message: message.into(),
        }
    }

    pub(crate) fn at(mut self, offset: u64) -> Self {
        self.offset = Some(offset);
        self
    }

    pub(crate) fn tensor(mut self, tensor: impl Into<String>) -> Self {
        self.tensor = Some(tensor.into());
        self
    }

    pub(crate) fn in_file(self, path: impl Into<PathBuf>) -> Error {
        Error::Invalid {
            path: path.into(),
            fault: self,
        }
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(t) = &self.tensor {
            write!(f, "tensor '{t}': ")?;
        }
        write!(f, "{}", self.field)?;
        if let Some(o) = self.offset {
            write!(f, " (at byte {o:#x})")?;
        }
        write!(f, ": {}", self.message)
    }
}
