//! Initial latents: a seeded Gaussian generator, or latents read from a file (for parity with Python).
//!
//! Generator (documented so other tools can reproduce it): SplitMix64 seeded with `seed`
//! (`state += 0x9E3779B97F4A7C15`, then the two xor-shift-multiply rounds with 0xBF58476D1CE4E5B9
//! and 0x94D049BB133111EB and a final `z ^ (z >> 31)`); uniforms `u = (next >> 11) / 2⁵³` (f64);
//! Box–Muller on pairs `(u₁, u₂)`: `r = sqrt(−2·ln(max(u₁, 1e−300)))`, values `r·cos(2πu₂)` then
//! `r·sin(2πu₂)`, rounded to f32, filling the latent `[16, H/8, W/8]` in row-major order.
//! This is the generator of the reference CLI (`cortiq imagine --seed`), so one seed gives the
//! same starting noise in both programs. It is not torch's generator: parity with diffusers goes
//! through `--latents FILE`.

use crate::ZimageError;
use std::path::Path;

/// SplitMix64 (Steele, Lea, Flood 2014).
#[derive(Clone, Debug)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1) with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// `n` standard-normal f32 values from `seed` (see the module docs for the exact recipe).
pub fn gaussian(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let u1 = rng.next_f64().max(1e-300);
        let u2 = rng.next_f64();
        let r = (-2.0 * u1.ln()).sqrt();
        let angle = 2.0 * std::f64::consts::PI * u2;
        out.push((r * angle.cos()) as f32);
        if out.len() < n {
            out.push((r * angle.sin()) as f32);
        }
    }
    out
}

/// Reads initial latents of `n` f32 values from `path`:
/// - `.npy`: a little-endian f32 array (`<f4`, C order) of `n` elements, any shape
///   (e.g. `[1, 16, H/8, W/8]` as numpy saves `latents.numpy()`);
/// - `.safetensors`: the tensor named `latents`, or the only tensor, F32 with `n` elements;
/// - anything else: raw little-endian f32 (the reference CLI's `CMF_INIT_LATENT` format).
pub fn read_latents(path: &Path, n: usize) -> Result<Vec<f32>, ZimageError> {
    let bad = |why: String| ZimageError::Latents {
        path: path.to_path_buf(),
        why,
    };
    let bytes = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .unwrap_or("")
        .to_ascii_lowercase();
    let payload: &[u8] = match ext.as_str() {
        "npy" => npy_payload(&bytes).map_err(bad)?,
        "safetensors" => {
            let st =
                safetensors::SafeTensors::deserialize(&bytes).map_err(|e| bad(e.to_string()))?;
            let names = st.names();
            let name = if names.contains(&"latents") {
                "latents".to_string()
            } else if names.len() == 1 {
                names[0].to_string()
            } else {
                return Err(bad(format!(
                    "{} tensors and none named `latents`",
                    names.len()
                )));
            };
            let t = st.tensor(&name).map_err(|e| bad(e.to_string()))?;
            if t.dtype() != safetensors::Dtype::F32 {
                return Err(bad(format!(
                    "tensor `{name}` is {:?}, expected F32",
                    t.dtype()
                )));
            }
            // The slice borrows `st`, which borrows `bytes`: copy out below.
            return to_f32(t.data(), n).map_err(bad);
        }
        _ => &bytes,
    };
    to_f32(payload, n).map_err(bad)
}

fn to_f32(b: &[u8], n: usize) -> Result<Vec<f32>, String> {
    if b.len() != n * 4 {
        return Err(format!(
            "{} f32 values, the latents need {n} (16 × H/8 × W/8)",
            b.len() / 4
        ));
    }
    let v: Vec<f32> = b
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    if let Some(i) = v.iter().position(|x| !x.is_finite()) {
        return Err(format!("value {i} is not finite"));
    }
    Ok(v)
}

/// The data of a version 1–3 `.npy` file holding little-endian f32 in C order.
fn npy_payload(b: &[u8]) -> Result<&[u8], String> {
    if b.len() < 10 || &b[..6] != b"\x93NUMPY" {
        return Err("not a .npy file (bad magic)".into());
    }
    let (hlen, hstart) = match b[6] {
        1 => (u16::from_le_bytes([b[8], b[9]]) as usize, 10),
        2 | 3 if b.len() >= 12 => (u32::from_le_bytes([b[8], b[9], b[10], b[11]]) as usize, 12),
        v => return Err(format!(".npy version {v} is not supported")),
    };
    let header = b
        .get(hstart..hstart + hlen)
        .ok_or(".npy header runs past the end of the file")?;
    let header = std::str::from_utf8(header).map_err(|_| ".npy header is not text")?;
    let compact: String = header.chars().filter(|c| !c.is_whitespace()).collect();
    if !compact.contains("'descr':'<f4'") {
        return Err(format!(
            ".npy dtype must be '<f4' (little-endian f32); header: {}",
            header.trim()
        ));
    }
    if compact.contains("'fortran_order':True") {
        return Err(".npy array must be in C order".into());
    }
    Ok(&b[hstart + hlen..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_reference_values() {
        // First outputs of SplitMix64 seeded with 0 (as in the published reference implementation).
        let mut r = SplitMix64::new(0);
        assert_eq!(r.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(r.next_u64(), 0x6E78_9E6A_A1B9_65F4);
    }

    #[test]
    fn gaussian_moments_and_determinism() {
        let a = gaussian(100_001, 42);
        assert_eq!(a, gaussian(100_001, 42));
        assert_ne!(a[..8], gaussian(8, 43)[..]);
        let mean = a.iter().map(|&x| x as f64).sum::<f64>() / a.len() as f64;
        let var = a.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / a.len() as f64;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.02, "var {var}");
    }

    #[test]
    fn npy_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("l.npy");
        let vals = [1.5f32, -2.0, 0.25, 3.0];
        let mut header = "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 4), }".to_string();
        while !(10 + header.len() + 1).is_multiple_of(64) {
            header.push(' ');
        }
        header.push('\n');
        let mut b = b"\x93NUMPY\x01\x00".to_vec();
        b.extend_from_slice(&(header.len() as u16).to_le_bytes());
        b.extend_from_slice(header.as_bytes());
        vals.iter()
            .for_each(|v| b.extend_from_slice(&v.to_le_bytes()));
        std::fs::write(&p, &b).unwrap();
        assert_eq!(read_latents(&p, 4).unwrap(), vals);
        let err = read_latents(&p, 5).unwrap_err().to_string();
        assert!(err.contains("need 5"), "{err}");
    }
}
