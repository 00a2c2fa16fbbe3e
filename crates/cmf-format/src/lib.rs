//! CMF v2 container format: envelope, tensor directory, hash64, reader, writer and codecs.
//! No engine dependencies: this crate only reads, writes and (de)quantizes bytes.

pub mod dtype;

pub use dtype::Dtype;
