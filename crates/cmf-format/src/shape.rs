//! Tensor shapes as the directory stores them: up to 6 dims, no heap allocation.

use std::fmt;
use std::ops::Deref;

pub const MAX_NDIM: usize = 6;

/// A tensor shape of at most [`MAX_NDIM`] dims, `Copy`, dereferences to `&[usize]`.
/// Weight matrices are `[rows = out, cols = in]`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Shape {
    dims: [usize; MAX_NDIM],
    ndim: u8,
}

impl Shape {
    /// `None` when `dims` has more than 6 entries.
    pub fn new(dims: &[usize]) -> Option<Shape> {
        if dims.len() > MAX_NDIM {
            return None;
        }
        let mut s = Shape {
            dims: [0; MAX_NDIM],
            ndim: dims.len() as u8,
        };
        s.dims[..dims.len()].copy_from_slice(dims);
        Some(s)
    }

    pub fn as_slice(&self) -> &[usize] {
        &self.dims[..self.ndim as usize]
    }

    pub fn ndim(&self) -> usize {
        self.ndim as usize
    }

    /// Element count (the empty shape is a scalar: 1). Shapes read from a file are checked
    /// at open, so this cannot overflow for them.
    pub fn numel(&self) -> usize {
        self.as_slice().iter().product()
    }

    /// `(rows, cols)` of a 2-D shape.
    pub fn rows_cols(&self) -> Option<(usize, usize)> {
        match self.as_slice() {
            &[r, c] => Some((r, c)),
            _ => None,
        }
    }

    pub(crate) fn as_u64(&self) -> [u64; MAX_NDIM] {
        self.dims.map(|d| d as u64)
    }
}

impl Deref for Shape {
    type Target = [usize];
    fn deref(&self) -> &[usize] {
        self.as_slice()
    }
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.as_slice())
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.as_slice())
    }
}
