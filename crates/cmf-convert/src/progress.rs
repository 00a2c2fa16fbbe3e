//! Progress reporting from the importers to whoever drives them (the CLI draws a bar).

/// Called from the writing thread only. Units are source parameters (elements).
pub trait Progress {
    fn start(&self, _total_elements: u64) {}
    /// One tensor of `elements` elements has been written.
    fn tensor_done(&self, _name: &str, _elements: u64) {}
    fn finish(&self) {}
}

/// No output.
pub struct Silent;

impl Progress for Silent {}
