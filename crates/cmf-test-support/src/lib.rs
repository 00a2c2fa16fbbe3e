//! Helpers the test suites of several crates share (a dev-dependency only): a seeded generator
//! for test data ([`rng`]), where the committed fixtures are ([`fixtures`]), scratch directories
//! a test binary shares through a static ([`scratch`]), how GPU tests skip ([`gpu`]), and the
//! runner of the committed fuzz corpora ([`fuzz`]). Nothing here depends on a crate of the
//! workspace.

pub mod fixtures;
pub mod fuzz;
pub mod gpu;
pub mod rng;
pub mod scratch;

pub use rng::Rng;
