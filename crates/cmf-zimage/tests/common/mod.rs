//! Shared helpers of the parity tests: the fixture paths, the expected-output files, comparisons.
#![allow(dead_code)]

use cmf_format::Dtype;
use cmf_zimage::tensors::MemTensors;
use std::collections::HashMap;
use std::path::PathBuf;

/// The Z-Image fixtures (`fixtures/zimage`, found as `cmf_test_support::fixtures` says).
pub fn fixtures() -> PathBuf {
    cmf_test_support::fixtures::path("zimage")
}

pub fn tree() -> PathBuf {
    fixtures().join("tiny")
}

/// An expected-output file as name → (shape, f32 values | raw bytes).
pub struct Expected {
    pub map: HashMap<String, (Vec<usize>, safetensors::Dtype, Vec<u8>)>,
}

impl Expected {
    pub fn load(file: &str) -> Expected {
        let path = fixtures().join("expected").join(file);
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let map = st
            .tensors()
            .into_iter()
            .map(|(n, t)| (n, (t.shape().to_vec(), t.dtype(), t.data().to_vec())))
            .collect();
        Expected { map }
    }

    pub fn f32(&self, name: &str) -> Vec<f32> {
        let (_, dt, b) = self
            .map
            .get(name)
            .unwrap_or_else(|| panic!("expected tensor {name} missing"));
        assert_eq!(*dt, safetensors::Dtype::F32, "{name}");
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    pub fn i32(&self, name: &str) -> Vec<i32> {
        let (_, dt, b) = self
            .map
            .get(name)
            .unwrap_or_else(|| panic!("expected tensor {name} missing"));
        assert_eq!(*dt, safetensors::Dtype::I32, "{name}");
        b.chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    pub fn u8(&self, name: &str) -> Vec<u8> {
        self.map
            .get(name)
            .unwrap_or_else(|| panic!("expected tensor {name} missing"))
            .2
            .clone()
    }

    pub fn shape(&self, name: &str) -> Vec<usize> {
        self.map[name].0.clone()
    }
}

/// `max|a − b| / max|b|`: the error relative to the reference's scale.
pub fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "length mismatch");
    let scale = want
        .iter()
        .fold(0f32, |m, v| m.max(v.abs()))
        .max(f32::MIN_POSITIVE);
    let err = got
        .iter()
        .zip(want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    err / scale
}

/// Loads one diffusers component's safetensors files into memory under `prefix`, renaming
/// `model.x` → `x` (the pack's naming). Test-only: the product reads packs through cmf-format.
pub fn load_component(sub: &str, prefix: &str, into: &mut MemTensors) {
    let dir = tree().join(sub);
    for entry in std::fs::read_dir(&dir).unwrap() {
        let p = entry.unwrap().path();
        if p.extension().and_then(|e| e.to_str()) != Some("safetensors") {
            continue;
        }
        let bytes = std::fs::read(&p).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (name, t) in st.tensors() {
            assert_eq!(t.dtype(), safetensors::Dtype::F32, "{name}");
            let n = name.strip_prefix("model.").unwrap_or(&name);
            into.insert(
                format!("{prefix}{n}"),
                Dtype::F32,
                t.shape().to_vec(),
                t.data().to_vec(),
            );
        }
    }
}

pub fn config(sub: &str, file: &str) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(tree().join(sub).join(file)).unwrap()).unwrap()
}

/// The fixture tree packed by our converter into `dir/file`, with these DiT and text-encoder
/// codecs (the VAE stays f32).
pub fn convert_tiny(
    dir: &std::path::Path,
    file: &str,
    dit: cmf_convert::zimage::Codec,
    te: cmf_convert::zimage::Codec,
) -> PathBuf {
    let out = dir.join(file);
    let opts = cmf_convert::zimage::ZimageOptions {
        dit,
        te,
        ..Default::default()
    };
    cmf_convert::zimage::convert_zimage(&tree(), &out, &opts, &mut |_| {}).unwrap();
    out
}

/// A scratch directory `name` this test binary makes once and shares (see
/// `cmf_test_support::scratch`).
pub fn scratch_dir(name: &str) -> PathBuf {
    cmf_test_support::scratch::scratch_dir(env!("CARGO_TARGET_TMPDIR"), name)
}

#[allow(unused_imports)] // not every test binary needs a device
pub use cmf_test_support::gpu as gpu_skip;
