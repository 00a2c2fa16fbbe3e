//! Dequantization of ggml tensor data to f32.
//!
//! The numerics match the `gguf` Python package's numpy dequantizers bit for bit
//! (`gguf/quants.py`, `<Type>.dequantize_blocks`, gguf 0.19), which mirror ggml's
//! `dequantize_row_*` (`ggml/src/ggml-quants.c`): every product and sum is one f32 operation in the
//! same order, and Rust does not contract `a * b - c` into an FMA, so results are identical.
//! `tests/gguf_dequant.rs` checks this on fixtures made by `scripts/make_gguf_fixtures.py`.
//!
//! Block layouts (bytes, in order; `d`, `m`, `dmin` are f16 unless noted):
//! - Q4_0 `[d][qs 16]`, Q4_1 `[d][m][qs 16]`: element j is the low nibble of qs[j], j+16 the high.
//! - Q5_0 `[d][qh u32][qs 16]`, Q5_1 `[d][m][qh u32][qs 16]`: bit j of qh is bit 4 of element j.
//! - Q8_0 `[d][i8 32]`.
//! - Q2_K `[scales 16][qs 64][d][dmin]`, Q3_K `[hmask 32][qs 64][scales 12][d]`,
//!   Q4_K `[d][dmin][scales 12][qs 128]`, Q5_K `[d][dmin][scales 12][qh 32][qs 128]`,
//!   Q6_K `[ql 128][qh 64][i8 scales 16][d]`, Q8_K `[f32 d][i8 256][i16 bsums 16]`.

use half::{bf16, f16};
use rayon::prelude::*;

use super::types::{GgmlType, QK_K};

/// Quantized blocks handed to one rayon task: large enough to amortise scheduling.
const BLOCKS_PER_TASK: usize = 1024;

/// Decodes `data` (whole blocks of `ty`) into `out`, which must hold exactly the tensor's elements.
pub fn dequantize(ty: GgmlType, data: &[u8], out: &mut [f32]) -> Result<(), String> {
    let (bs, ts) = ty.block_geometry();
    if !out.len().is_multiple_of(bs) {
        return Err(format!(
            "{} elements is not a whole number of {ty} blocks of {bs}",
            out.len()
        ));
    }
    let n_blocks = out.len() / bs;
    if data.len() != n_blocks * ts {
        return Err(format!(
            "{ty} data is {} bytes, {} elements need {}",
            data.len(),
            out.len(),
            n_blocks * ts
        ));
    }
    let block_fn: fn(&[u8], &mut [f32]) = match ty {
        GgmlType::F32 => f32_block,
        GgmlType::F16 => f16_block,
        GgmlType::BF16 => bf16_block,
        GgmlType::Q4_0 => q4_0,
        GgmlType::Q4_1 => q4_1,
        GgmlType::Q5_0 => q5_0,
        GgmlType::Q5_1 => q5_1,
        GgmlType::Q8_0 => q8_0,
        GgmlType::Q2_K => q2_k,
        GgmlType::Q3_K => q3_k,
        GgmlType::Q4_K => q4_k,
        GgmlType::Q5_K => q5_k,
        GgmlType::Q6_K => q6_k,
        GgmlType::Q8_K => q8_k,
        other => {
            return Err(format!(
                "dequantization of ggml type {other} is not supported"
            ))
        }
    };
    if bs == 1 {
        // Plain float types: the element fns take any length.
        let per_task = 64 * 1024;
        out.par_chunks_mut(per_task)
            .zip(data.par_chunks(per_task * ts))
            .for_each(|(y, x)| block_fn(x, y));
    } else {
        let per_task = BLOCKS_PER_TASK;
        out.par_chunks_mut(bs * per_task)
            .zip(data.par_chunks(ts * per_task))
            .for_each(|(y, x)| {
                for (yb, xb) in y.chunks_exact_mut(bs).zip(x.chunks_exact(ts)) {
                    block_fn(xb, yb);
                }
            });
    }
    Ok(())
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

fn f32_block(x: &[u8], y: &mut [f32]) {
    for (v, b) in y.iter_mut().zip(x.chunks_exact(4)) {
        *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}

fn f16_block(x: &[u8], y: &mut [f32]) {
    for (v, b) in y.iter_mut().zip(x.chunks_exact(2)) {
        *v = f16::from_le_bytes([b[0], b[1]]).to_f32();
    }
}

fn bf16_block(x: &[u8], y: &mut [f32]) {
    for (v, b) in y.iter_mut().zip(x.chunks_exact(2)) {
        *v = bf16::from_le_bytes([b[0], b[1]]).to_f32();
    }
}

fn q4_0(x: &[u8], y: &mut [f32]) {
    let d = f16_at(x, 0);
    let qs = &x[2..18];
    for j in 0..16 {
        y[j] = d * ((qs[j] & 0x0F) as i32 - 8) as f32;
        y[j + 16] = d * ((qs[j] >> 4) as i32 - 8) as f32;
    }
}

fn q4_1(x: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(x, 0), f16_at(x, 2));
    let qs = &x[4..20];
    for j in 0..16 {
        y[j] = d * (qs[j] & 0x0F) as f32 + m;
        y[j + 16] = d * (qs[j] >> 4) as f32 + m;
    }
}

/// The 5-bit values of a Q5 block: low nibbles from `qs`, bit 4 from `qh`.
fn q5_values(qh: u32, qs: &[u8]) -> [u8; 32] {
    let mut q = [0u8; 32];
    for j in 0..16 {
        q[j] = (qs[j] & 0x0F) | ((((qh >> j) & 1) as u8) << 4);
        q[j + 16] = (qs[j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
    }
    q
}

fn q5_0(x: &[u8], y: &mut [f32]) {
    let d = f16_at(x, 0);
    let qh = u32::from_le_bytes([x[2], x[3], x[4], x[5]]);
    for (v, q) in y.iter_mut().zip(q5_values(qh, &x[6..22])) {
        *v = d * (q as i32 - 16) as f32;
    }
}

fn q5_1(x: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(x, 0), f16_at(x, 2));
    let qh = u32::from_le_bytes([x[4], x[5], x[6], x[7]]);
    for (v, q) in y.iter_mut().zip(q5_values(qh, &x[8..24])) {
        *v = d * q as f32 + m;
    }
}

fn q8_0(x: &[u8], y: &mut [f32]) {
    let d = f16_at(x, 0);
    for (v, &q) in y.iter_mut().zip(&x[2..34]) {
        *v = (q as i8) as f32 * d;
    }
}

fn q2_k(x: &[u8], y: &mut [f32]) {
    let scales = &x[0..16];
    let qs = &x[16..80];
    let (d, dmin) = (f16_at(x, 80), f16_at(x, 82));
    for (e, v) in y.iter_mut().enumerate().take(QK_K) {
        let j = e / 16;
        let dl = d * (scales[j] & 0x0F) as f32;
        let ml = dmin * (scales[j] >> 4) as f32;
        let (half, shift, l) = (e / 128, (e % 128) / 32, e % 32);
        let q = (qs[half * 32 + l] >> (2 * shift)) & 3;
        *v = dl * q as f32 - ml;
    }
}

fn q3_k(x: &[u8], y: &mut [f32]) {
    let hmask = &x[0..32];
    let qs = &x[32..96];
    let sc = &x[96..108];
    let d = f16_at(x, 108);
    let mut dl = [0f32; 16];
    for (k, dlk) in dl.iter_mut().enumerate() {
        let lo = (sc[k % 8] >> (4 * (k / 8))) & 0x0F;
        let hi = (sc[8 + k % 4] >> (2 * (k / 4))) & 0x03;
        *dlk = d * ((lo | (hi << 4)) as i32 - 32) as f32;
    }
    for (e, v) in y.iter_mut().enumerate().take(QK_K) {
        let (half, shift, l) = (e / 128, (e % 128) / 32, e % 32);
        let low = ((qs[half * 32 + l] >> (2 * shift)) & 3) as i32;
        // ggml: the 4 is subtracted when the hmask bit is *clear*.
        let high_clear = (((hmask[l] >> (e / 32)) & 1) ^ 1) as i32;
        *v = dl[e / 16] * (low - (high_clear << 2)) as f32;
    }
}

/// The eight 6-bit (scale, min) pairs packed in 12 bytes (`get_scale_min_k4` in ggml-quants.c).
fn k4_scale_min(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut sc, mut mn) = ([0u8; 8], [0u8; 8]);
    for j in 0..4 {
        sc[j] = s[j] & 0x3F;
        mn[j] = s[j + 4] & 0x3F;
        sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 2) & 0x30);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
    }
    (sc, mn)
}

fn q4_k(x: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(x, 0), f16_at(x, 2));
    let (sc, mn) = k4_scale_min(&x[4..16]);
    let qs = &x[16..144];
    for (e, v) in y.iter_mut().enumerate().take(QK_K) {
        let j = e / 32;
        let q = (qs[(j / 2) * 32 + e % 32] >> (4 * (j % 2))) & 0x0F;
        *v = (d * sc[j] as f32) * q as f32 - dmin * mn[j] as f32;
    }
}

fn q5_k(x: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(x, 0), f16_at(x, 2));
    let (sc, mn) = k4_scale_min(&x[4..16]);
    let qh = &x[16..48];
    let qs = &x[48..176];
    for (e, v) in y.iter_mut().enumerate().take(QK_K) {
        let (j, l) = (e / 32, e % 32);
        let low = (qs[(j / 2) * 32 + l] >> (4 * (j % 2))) & 0x0F;
        let q = low | (((qh[l] >> j) & 1) << 4);
        *v = (d * sc[j] as f32) * q as f32 - dmin * mn[j] as f32;
    }
}

fn q6_k(x: &[u8], y: &mut [f32]) {
    let ql = &x[0..128];
    let qh = &x[128..192];
    let scales = &x[192..208];
    let d = f16_at(x, 208);
    for (e, v) in y.iter_mut().enumerate().take(QK_K) {
        let half = e / 128;
        let low = (ql[half * 64 + e % 64] >> (4 * ((e % 128) / 64))) & 0x0F;
        let high = (qh[half * 32 + e % 32] >> (2 * ((e % 128) / 32))) & 0x03;
        let q = (low | (high << 4)) as i32 - 32;
        *v = (d * (scales[e / 16] as i8) as f32) * q as f32;
    }
}

fn q8_k(x: &[u8], y: &mut [f32]) {
    let d = f32::from_le_bytes([x[0], x[1], x[2], x[3]]);
    for (v, &q) in y.iter_mut().zip(&x[4..4 + QK_K]) {
        *v = d * (q as i8) as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_wrong_sizes_and_types() {
        let mut out = vec![0f32; 32];
        assert!(dequantize(GgmlType::Q8_0, &[0u8; 33], &mut out).is_err());
        assert!(dequantize(GgmlType::Q8_0, &[0u8; 34], &mut out[..31]).is_err());
        let e = dequantize(GgmlType::IQ2_XXS, &[0u8; 66], &mut vec![0f32; 256]).unwrap_err();
        assert!(e.contains("IQ2_XXS"), "{e}");
    }

    #[test]
    fn q8_0_hand_block() {
        // d = 0.5 (f16 0x3800), q = -3, 0, 127, …
        let mut b = vec![0x00, 0x38];
        b.extend((0..32).map(|i| [(-3i8) as u8, 0, 127][i % 3]));
        let mut y = vec![0f32; 32];
        dequantize(GgmlType::Q8_0, &b, &mut y).unwrap();
        assert_eq!(&y[..3], &[-1.5, 0.0, 63.5]);
    }

    #[test]
    fn f32_tail_shorter_than_a_task() {
        let vals: Vec<f32> = (0..70_000).map(|i| i as f32 * 0.25).collect();
        let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut y = vec![0f32; 70_000];
        dequantize(GgmlType::F32, &bytes, &mut y).unwrap();
        assert_eq!(y, vals);
    }
}
