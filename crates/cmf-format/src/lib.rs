//! CMF v2 container format: envelope, tensor directory, hash64, header JSON, memory-mapped
//! reader, streaming writer, shard sets and weight codecs. No engine code: this crate only
//! reads, writes, checks and (de)quantizes bytes. See `docs/format.md`.
//!
//! ```no_run
//! use cmf_format::{codec, Arch, CmfModel, CmfWriter, Dtype, Header, LayerType, QuantType};
//! # fn main() -> cmf_format::Result<()> {
//! let arch = Arch { arch_name: "llama".into(), num_layers: 1, layer_types: vec![LayerType::FullAttention], ..Arch::default() };
//! let mut w = CmfWriter::create("model.cmf", Header::new(arch, QuantType::Q8Row))?;
//! w.add_f32("lm_head.weight", Dtype::Q8Row, &[2, 4], &[0.5; 8])?;
//! let path = w.finish()?;
//! let model = CmfModel::open(&path)?;
//! let t = model.get("lm_head.weight")?;
//! let values = t.to_f32()?;
//! # Ok(()) }
//! ```

pub mod codec;
pub mod directory;
pub mod dtype;
pub mod envelope;
pub mod error;
pub mod hash;
pub mod header;
pub mod limits;
pub mod mapped;
pub mod model;
pub mod reader;
pub mod regular;
pub mod shape;
pub mod verify;
pub mod writer;

pub use codec::CodecError;
pub use dtype::Dtype;
pub use envelope::Section;
pub use error::{Error, Fault, FaultKind, Result};
pub use hash::{hash64, Hasher64};
pub use header::{
    Arch, Header, LayerType, Moe, NormStyle, QuantType, SectionHashes, ShardInfo, TokenizerConfig,
    Yarn,
};
pub use model::CmfModel;
pub use reader::{CmfFile, TensorView};
pub use shape::Shape;
pub use verify::{Problem, VerifyReport};
pub use writer::{shard_path, CmfWriter};
