//! Codec and hash parity with the reference crate `cortiq-core` 0.8.54: decoders bit-exact on
//! random payloads, the q8_2f encoder byte-exact, hash64 equal.

mod common;

use cmf_format::codec::{self, q4tp};
use cmf_format::{hash64, Dtype};
use common::values;
use cortiq_core::quant as oracle;

fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 32) as u8
        })
        .collect()
}

/// Overwrites every f16 in `bytes[range]` with a finite, normal-ish scale so that decoded
/// values are ordinary numbers (the all-random case is tested separately).
fn tame_f16(bytes: &mut [u8], range: std::ops::Range<usize>, seed: u64) {
    let scales = values(range.len() / 2, seed, 0.05);
    for (k, s) in scales.iter().enumerate() {
        let h = codec::f32_to_f16(s.abs() + 1e-3).to_le_bytes();
        bytes[range.start + 2 * k] = h[0];
        bytes[range.start + 2 * k + 1] = h[1];
    }
}

/// Bit pattern of a decoded value, with every NaN mapped to one pattern: which operand's NaN
/// payload a product of two NaNs keeps depends on operand order, which the optimiser may change
/// (LLVM treats NaN payloads as unspecified). Every non-NaN value must still match bit for bit.
fn bits(v: f32) -> u32 {
    if v.is_nan() {
        f32::NAN.to_bits()
    } else {
        v.to_bits()
    }
}

fn ours(dtype: Dtype, shape: &[usize], bytes: &[u8]) -> Vec<u32> {
    codec::decode_vec(dtype, shape, bytes)
        .unwrap()
        .iter()
        .map(|&v| bits(v))
        .collect()
}

fn theirs(dtype: Dtype, shape: &[usize], bytes: &[u8]) -> Vec<u32> {
    let n: usize = shape.iter().product();
    let mut out = vec![0f32; n];
    let (r, c) = (shape[0], *shape.last().unwrap());
    match dtype {
        Dtype::Q8Row => oracle::dequant_q8_row(bytes, r, c, &mut out),
        Dtype::Q8_2f => oracle::dequant_q8_2f(bytes, r, c, &mut out),
        Dtype::Q4Block => oracle::dequant_q4_block(bytes, &mut out),
        Dtype::Q4Tiled => oracle::dequant_q4_tiled(bytes, &mut out),
        Dtype::Q4Tp => oracle::dequant_q4tp(bytes, r, c, &mut out),
        other => panic!("no oracle decoder for {other}"),
    }
    out.iter().map(|&v| bits(v)).collect()
}

/// The byte range of each codec's f16 scale fields.
#[allow(clippy::single_range_in_vec_init)]
fn scale_range(dtype: Dtype, shape: &[usize], len: usize) -> Vec<std::ops::Range<usize>> {
    let (r, c) = (shape[0], *shape.last().unwrap());
    match dtype {
        Dtype::Q8Row | Dtype::Q8_2f => vec![r * c..len],
        Dtype::Q4Block => vec![len - 2 * shape.iter().product::<usize>().div_ceil(32)..len],
        Dtype::Q4Tiled => (0..len / 18).map(|g| g * 18..g * 18 + 2).collect(),
        Dtype::Q4Tp => {
            // lo in [-12, 2], step in [0, 0.3]: a realistic ladder
            let (po, _, _) = q4tp::sections(r, c);
            vec![po..po + 4 * r]
        }
        _ => vec![],
    }
}

#[test]
fn quantized_decoders_are_bit_exact() {
    let cases: &[(Dtype, &[usize])] = &[
        (Dtype::Q8Row, &[7, 33]),
        (Dtype::Q8Row, &[64, 256]),
        (Dtype::Q8_2f, &[5, 17]),
        (Dtype::Q8_2f, &[300, 64]),
        (Dtype::Q4Block, &[101]),
        (Dtype::Q4Block, &[3, 5, 7]),
        (Dtype::Q4Block, &[64, 128]),
        (Dtype::Q4Tiled, &[9, 96]),
        (Dtype::Q4Tp, &[9, 96]),
        (Dtype::Q4Tp, &[33, 256]),
        (Dtype::Q4Tp, &[4, 32]),
    ];
    for (seed, &(dtype, shape)) in cases.iter().enumerate() {
        let shape64: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
        let len = dtype.expected_nbytes(&shape64).unwrap() as usize;
        // Fully random payload: NaN/inf scales included.
        let raw = random_bytes(len, seed as u64);
        assert_eq!(
            ours(dtype, shape, &raw),
            theirs(dtype, shape, &raw),
            "{dtype} {shape:?} random bytes"
        );
        // Realistic scales.
        let mut tame = raw.clone();
        for range in scale_range(dtype, shape, len) {
            if dtype == Dtype::Q4Tp {
                for r in 0..range.len() / 4 {
                    let lo = codec::f32_to_f16(-12.0 + 14.0 * (r % 7) as f32 / 7.0).to_le_bytes();
                    let st = codec::f32_to_f16(0.3 * (r % 5) as f32 / 5.0).to_le_bytes();
                    tame[range.start + 4 * r..range.start + 4 * r + 4]
                        .copy_from_slice(&[lo[0], lo[1], st[0], st[1]]);
                }
            } else {
                tame_f16(&mut tame, range, seed as u64);
            }
        }
        let got = ours(dtype, shape, &tame);
        assert!(
            got.iter().all(|&b| f32::from_bits(b).is_finite()),
            "{dtype}: tame payload decodes finite"
        );
        assert_eq!(
            got,
            theirs(dtype, shape, &tame),
            "{dtype} {shape:?} realistic scales"
        );
    }
}

#[test]
fn float_conversions_are_bit_exact() {
    for bits in 0..=u16::MAX {
        assert_eq!(
            codec::f16_to_f32(bits).to_bits(),
            oracle::f16_to_f32(bits).to_bits(),
            "f16 {bits:#06x}"
        );
        assert_eq!(
            codec::bf16_to_f32(bits).to_bits(),
            oracle::bf16_to_f32(bits).to_bits(),
            "bf16 {bits:#06x}"
        );
    }
}

/// f32 → f16 agrees with the reference converter everywhere except exact ties between two
/// f16 subnormals, which the reference rounds up and IEEE (and we) round to even.
#[test]
fn f16_encoding_matches_reference_except_subnormal_ties() {
    let mut x = 0x1234_5678u32;
    let mut mismatches = 0;
    for i in 0..2_000_000u32 {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        // cover every exponent, and every f16-exact tie pattern through the low bits
        let v = f32::from_bits(if i % 4 == 0 {
            x & 0xFFFF_E000 | 0x1000
        } else {
            x
        });
        if v.is_nan() {
            continue;
        }
        let (a, b) = (codec::f32_to_f16(v), oracle::f32_to_f16(v));
        if a != b {
            let tiny = v.abs() < 6.103_515_6e-5;
            assert!(
                tiny && a.abs_diff(b) == 1,
                "{v:e}: ours {a:#06x} reference {b:#06x}"
            );
            mismatches += 1;
        }
    }
    assert!(mismatches < 2_000_000 / 100);
}

#[test]
fn q8_2f_encoder_is_byte_exact() {
    for (seed, (rows, cols)) in [(1, 1), (3, 5), (257, 33), (600, 64), (16, 2048)]
        .into_iter()
        .enumerate()
    {
        let mut vals = values(rows * cols, seed as u64, 2.0);
        if rows > 2 {
            vals[cols..2 * cols].iter_mut().for_each(|v| *v = 0.0); // a zero row
            for r in 0..rows {
                vals[r * cols] *= 100.0; // an outlier column
            }
        }
        let ours = codec::encode(Dtype::Q8_2f, &[rows, cols], &vals).unwrap();
        assert_eq!(
            ours,
            oracle::encode_q8_2f(&vals, rows, cols),
            "{rows}x{cols}"
        );
    }
}

#[test]
fn hash64_matches() {
    for len in [0, 1, 7, 8, 9, 63, 64, 1000, 4099] {
        let b = random_bytes(len, len as u64);
        assert_eq!(hash64(&b), cortiq_core::hash64(&b), "len {len}");
    }
}

#[test]
fn expected_nbytes_agrees_where_both_define_it() {
    use cortiq_core::TensorDtype as T;
    let pairs = [
        (Dtype::F32, T::F32),
        (Dtype::F16, T::F16),
        (Dtype::Bf16, T::Bf16),
        (Dtype::U8, T::U8),
        (Dtype::Q8Row, T::Q8Row),
        (Dtype::Q4Block, T::Q4Block),
        (Dtype::Q8_2f, T::Q8_2f),
        (Dtype::Q4Tiled, T::Q4Tiled),
        (Dtype::Q4Tp, T::Q4TiledP),
    ];
    let shapes: &[&[usize]] = &[
        &[],
        &[5],
        &[64],
        &[3, 7],
        &[4, 64],
        &[2, 3, 32],
        &[0, 32],
        &[96, 4096],
    ];
    for (ours, theirs) in pairs {
        assert_eq!(ours.id(), theirs.id());
        assert_eq!(ours.name(), theirs.name());
        for shape in shapes {
            let s64: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
            if let Some(n) = ours.expected_nbytes(&s64) {
                assert_eq!(
                    Some(n as usize),
                    oracle::expected_nbytes(theirs, shape),
                    "{ours} {shape:?}"
                );
            }
        }
    }
}
