//! Row ops the models need. Each has a scalar f64 reference in [`crate::reference`] and a parity
//! test (`tests/ops_parity.rs`); each `op` has an `op_with(isa, …)` twin for tests.
//!
//! Conventions: activations are f32, row-major; "rows of d" means the slice is split into
//! consecutive rows of length d (d must divide the length).

pub(crate) mod math;

mod activation;
mod elementwise;
mod norm;
mod rope;

pub use activation::*;
pub use elementwise::*;
pub use norm::*;
pub use rope::*;

/// Splits `len` elements into chunks of about `min_chunk` (a multiple of 64) and runs
/// `f(start, end)` on the pool; serially for small work.
pub(crate) fn par_ranges(len: usize, min_chunk: usize, f: impl Fn(usize, usize) + Sync + Send) {
    let chunk = min_chunk
        .max(len.div_ceil(crate::pool::num_threads() * 4))
        .div_ceil(64)
        * 64;
    let tasks = len.div_ceil(chunk.max(1));
    crate::pool::for_each_task(tasks, |i| f(i * chunk, ((i + 1) * chunk).min(len)));
}

/// `f` on disjoint chunks of `x` (about `min_chunk` long), on the pool for large slices.
pub(crate) fn par_chunks(x: &mut [f32], min_chunk: usize, f: impl Fn(&mut [f32]) + Sync + Send) {
    let xp = crate::pool::SendPtr(x.as_mut_ptr());
    par_ranges(x.len(), min_chunk, |s, e| {
        // SAFETY: par_ranges hands out disjoint ranges of x.
        f(unsafe { xp.slice(s, e - s) })
    });
}
