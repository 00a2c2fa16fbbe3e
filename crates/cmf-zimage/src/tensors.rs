//! Named tensors as the models load them: a small trait over "a file of tensors" (a CMF file, or an
//! in-memory map in tests) and a loader that checks shape and codec and says which tensor is wrong.
//!
//! Weight matrices are borrowed in their storage codec (`cmf_kernels::Weight`), never expanded;
//! vectors (norm weights, biases, pad tokens) are small and decoded to f32 once at load.

use crate::ZimageError;
use cmf_format::{CmfModel, Dtype, Shape, TensorView};
use cmf_kernels::Weight;
use half::{bf16, f16};
use std::collections::HashMap;

/// One stored tensor, borrowed: codec, shape as stored, payload bytes (cmf-format's view).
pub type TensorRef<'a> = TensorView<'a>;

/// Anything that can hand out tensors by name.
pub trait TensorSource: Sync {
    fn tensor(&self, name: &str) -> Option<TensorRef<'_>>;
    /// Where the tensors come from, for error messages (a file path).
    fn origin(&self) -> String;
}

/// Tensors held in memory (tests, small synthetic models).
#[derive(Default)]
pub struct MemTensors {
    map: HashMap<String, (Dtype, Shape, Vec<u8>)>,
    pub origin: String,
}

impl MemTensors {
    pub fn new(origin: impl Into<String>) -> Self {
        MemTensors {
            map: HashMap::new(),
            origin: origin.into(),
        }
    }

    pub fn insert(
        &mut self,
        name: impl Into<String>,
        dtype: Dtype,
        shape: Vec<usize>,
        data: Vec<u8>,
    ) {
        let shape = Shape::new(&shape).expect("at most 6 dims");
        self.map.insert(name.into(), (dtype, shape, data));
    }

    pub fn insert_f32(&mut self, name: impl Into<String>, shape: Vec<usize>, v: &[f32]) {
        self.insert(
            name,
            Dtype::F32,
            shape,
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        );
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.map.keys().map(|s| s.as_str())
    }
}

impl TensorSource for MemTensors {
    fn tensor(&self, name: &str) -> Option<TensorRef<'_>> {
        let (key, (dtype, shape, data)) = self.map.get_key_value(name)?;
        Some(TensorView {
            name: key,
            dtype: *dtype,
            shape: *shape,
            data,
            hash: 0,
            file_offset: 0,
        })
    }
    fn origin(&self) -> String {
        self.origin.clone()
    }
}

impl TensorSource for CmfModel {
    fn tensor(&self, name: &str) -> Option<TensorRef<'_>> {
        CmfModel::tensor(self, name)
    }
    fn origin(&self) -> String {
        self.path().display().to_string()
    }
}

/// Loads tensors under a name prefix (`dit.`, `te.`, `vae.`) with checks.
#[derive(Clone, Copy)]
pub struct Loader<'a> {
    src: &'a dyn TensorSource,
    prefix: &'a str,
}

impl<'a> Loader<'a> {
    pub fn new(src: &'a dyn TensorSource, prefix: &'a str) -> Self {
        Loader { src, prefix }
    }

    pub fn origin(&self) -> String {
        self.src.origin()
    }

    fn full(&self, name: &str) -> String {
        format!("{}{}", self.prefix, name)
    }

    fn bad(&self, name: &str, why: impl Into<String>) -> ZimageError {
        ZimageError::Tensor {
            origin: self.src.origin(),
            name: self.full(name),
            why: why.into(),
        }
    }

    pub fn has(&self, name: &str) -> bool {
        self.src.tensor(&self.full(name)).is_some()
    }

    pub fn get(&self, name: &str) -> Result<TensorRef<'a>, ZimageError> {
        self.src
            .tensor(&self.full(name))
            .ok_or_else(|| self.bad(name, "missing"))
    }

    /// The stored shape of `name`.
    pub fn shape(&self, name: &str) -> Result<Vec<usize>, ZimageError> {
        Ok(self.get(name)?.shape.to_vec())
    }

    /// A float tensor of `len` elements decoded to f32 (any shape whose product is `len`).
    pub fn vec_f32(&self, name: &str, len: usize) -> Result<Vec<f32>, ZimageError> {
        let t = self.get(name)?;
        let n: usize = t.shape.iter().product();
        if n != len {
            return Err(self.bad(
                name,
                format!("has {n} elements ({:?}), expected {len}", t.shape),
            ));
        }
        decode_f32(t).map_err(|why| self.bad(name, why))
    }

    /// A matrix `[rows, cols]` borrowed in its codec. Trailing unit dims (a 1×1 conv) and a 4-D conv
    /// kernel `[out, in, kh, kw]` are read as `[out, in·kh·kw]`.
    pub fn weight(&self, name: &str, rows: usize, cols: usize) -> Result<Weight<'a>, ZimageError> {
        let t = self.get(name)?;
        let (r, c) = match t.shape.as_slice() {
            [r, rest @ ..] if !rest.is_empty() => (*r, rest.iter().product::<usize>()),
            _ => return Err(self.bad(name, format!("shape {:?} is not a matrix", t.shape))),
        };
        if (r, c) != (rows, cols) {
            return Err(self.bad(
                name,
                format!("shape {:?}, expected [{rows}, {cols}]", t.shape),
            ));
        }
        if !matches!(
            t.dtype,
            Dtype::F32
                | Dtype::F16
                | Dtype::Bf16
                | Dtype::Q8Row
                | Dtype::Q8_2f
                | Dtype::Q4Block
                | Dtype::Q4Tiled
        ) {
            return Err(self.bad(
                name,
                format!("codec {} is not supported for a weight matrix", t.dtype),
            ));
        }
        let expect = t.dtype.expected_nbytes(&[rows as u64, cols as u64]);
        if expect != Some(t.data.len() as u64) {
            return Err(self.bad(
                name,
                format!(
                    "{} bytes, codec {} needs {:?}",
                    t.data.len(),
                    t.dtype,
                    expect
                ),
            ));
        }
        Ok(Weight {
            dtype: t.dtype,
            rows,
            cols,
            data: t.data,
        })
    }

    /// `name.weight` `[out, in]` and, when `bias`, `name.bias` `[out]`.
    pub fn linear(
        &self,
        name: &str,
        out: usize,
        inp: usize,
        bias: bool,
    ) -> Result<Linear<'a>, ZimageError> {
        let w = self.weight(&format!("{name}.weight"), out, inp)?;
        let b = if bias {
            Some(self.vec_f32(&format!("{name}.bias"), out)?)
        } else {
            None
        };
        Ok(Linear { w, b })
    }

    /// A UTF-8 JSON blob stored as a u8 tensor (`dit.config_json`, …).
    pub fn json(&self, name: &str) -> Result<serde_json::Value, ZimageError> {
        let t = self.get(name)?;
        if t.dtype != Dtype::U8 {
            return Err(self.bad(
                name,
                format!("codec {} where a u8 JSON blob was expected", t.dtype),
            ));
        }
        serde_json::from_slice(t.data).map_err(|e| self.bad(name, format!("invalid JSON: {e}")))
    }
}

/// Decodes a float tensor (f32/f16/bf16) to f32.
pub fn decode_f32(t: TensorRef) -> Result<Vec<f32>, String> {
    let n: usize = t.shape.iter().product();
    let want = t
        .dtype
        .expected_nbytes(&t.shape.iter().map(|&d| d as u64).collect::<Vec<_>>());
    if want != Some(t.data.len() as u64) {
        return Err(format!(
            "{} bytes for {:?} in {}",
            t.data.len(),
            t.shape,
            t.dtype
        ));
    }
    let d = t.data;
    Ok(match t.dtype {
        Dtype::F32 => d
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::F16 => d
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::Bf16 => d
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        other => {
            return Err(format!(
                "codec {other} where f32/f16/bf16 was expected ({n} elements)"
            ))
        }
    })
}

/// A linear layer: `y[n, out] = x[n, in] · Wᵀ (+ b)`.
pub struct Linear<'a> {
    pub w: Weight<'a>,
    pub b: Option<Vec<f32>>,
}

impl Linear<'_> {
    pub fn out_dim(&self) -> usize {
        self.w.rows
    }
    pub fn in_dim(&self) -> usize {
        self.w.cols
    }

    /// `x` is `[n, in]`; returns `[n, out]`.
    pub fn forward(&self, x: &[f32], n: usize) -> Vec<f32> {
        let mut y = vec![0f32; n * self.w.rows];
        self.forward_into(x, n, &mut y);
        y
    }

    pub fn forward_into(&self, x: &[f32], n: usize, y: &mut [f32]) {
        debug_assert_eq!(x.len(), n * self.w.cols);
        crate::ops::matmul(&self.w, x, n, y);
        if let Some(b) = &self.b {
            crate::ops::add_bias(y, b);
        }
    }
}
