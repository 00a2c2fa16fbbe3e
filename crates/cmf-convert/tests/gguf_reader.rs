//! GGUF reader: fixtures written by the `gguf` Python package (scripts/make_gguf_fixtures.py),
//! dequantization bit-exact against `gguf.quants.dequantize`, and corrupted inputs.

use std::path::PathBuf;

use cmf_convert::gguf::{dequant, GgmlType, Gguf, Value, ValueType};

fn fixture(name: &str) -> Vec<u8> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/gguf")
        .join(name);
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn tensor_f32(bytes: &[u8], g: &Gguf, name: &str) -> Vec<f32> {
    let t = g.tensor(name).unwrap_or_else(|| panic!("no tensor {name}"));
    let start = (g.data_offset + t.offset) as usize;
    let mut out = vec![0f32; t.n_elements() as usize];
    dequant::dequantize(t.ty, &bytes[start..start + t.nbytes as usize], &mut out).unwrap();
    out
}

#[test]
fn dequantization_is_bit_exact_against_gguf_python() {
    let bytes = fixture("dequant.gguf");
    let g = Gguf::parse(&bytes).unwrap();
    let types = [
        "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
        "Q5_K", "Q6_K", "Q8_K",
    ];
    for ty in types {
        let q = g.tensor(&format!("{ty}.q")).unwrap();
        assert_eq!(q.ty.name(), ty);
        let expected = g.tensor(&format!("{ty}.expected")).unwrap();
        assert_eq!(expected.ty, GgmlType::F32);
        assert_eq!(q.dims, expected.dims, "{ty}");
        let got = tensor_f32(&bytes, &g, &q.name);
        let want = tensor_f32(&bytes, &g, &expected.name);
        assert!(want.iter().any(|v| *v != 0.0), "{ty}: fixture is all zeros");
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                a.to_bits(),
                b.to_bits(),
                "{ty} element {i}: got {a}, gguf-py {b}"
            );
        }
    }
}

#[test]
fn metadata_of_every_type_and_custom_alignment() {
    let bytes = fixture("metadata.gguf");
    let g = Gguf::parse(&bytes).unwrap();
    assert_eq!(g.version, 3);
    assert_eq!(g.alignment, 64);
    assert_eq!(g.data_offset % 64, 0);
    assert_eq!(g.architecture(), Some("fixture"));
    let v = |k: &str| g.get(k).unwrap_or_else(|| panic!("missing {k}")).clone();
    assert_eq!(v("t.u8"), Value::U8(200));
    assert_eq!(v("t.i8"), Value::I8(-100));
    assert_eq!(v("t.u16"), Value::U16(60000));
    assert_eq!(v("t.i16"), Value::I16(-30000));
    assert_eq!(v("t.u32"), Value::U32(4_000_000_000));
    assert_eq!(v("t.i32"), Value::I32(-2_000_000_000));
    assert_eq!(v("t.f32"), Value::F32(0.15625));
    assert_eq!(v("t.u64"), Value::U64((1 << 63) + 5));
    assert_eq!(v("t.i64"), Value::I64(-(1 << 62)));
    assert_eq!(v("t.f64"), Value::F64(-2.5e-300));
    assert_eq!(v("t.bool"), Value::Bool(true));
    assert_eq!(v("t.str").as_str(), Some("héllo ▁wörld"));
    let s = |x: &str| Value::String(x.into());
    assert_eq!(
        v("t.arr_str"),
        Value::Array(ValueType::String, vec![s("a"), s(""), s("Ġb")])
    );
    assert_eq!(
        v("t.arr_u16"),
        Value::Array(
            ValueType::U16,
            vec![Value::U16(1), Value::U16(2), Value::U16(65535)]
        )
    );
    assert_eq!(
        v("t.arr_f32"),
        Value::Array(ValueType::F32, vec![Value::F32(0.5), Value::F32(-1.0)])
    );
    let i = Value::I32;
    assert_eq!(
        v("t.arr_nested"),
        Value::Array(
            ValueType::Array,
            vec![
                Value::Array(ValueType::I32, vec![i(1), i(2)]),
                Value::Array(ValueType::I32, vec![i(3)])
            ]
        )
    );
    assert_eq!(v("t.u8").as_u64(), Some(200));
    assert_eq!(v("t.i8").as_u64(), None);
    assert_eq!(v("t.u32").as_f64(), Some(4e9));

    let a = g.tensor("a").unwrap();
    assert_eq!(
        (a.ty, a.dims.clone(), a.shape()),
        (GgmlType::F32, vec![3, 2], vec![2, 3])
    );
    assert_eq!(tensor_f32(&bytes, &g, "a"), vec![0., 1., 2., 3., 4., 5.]);
    let b = g.tensor("b").unwrap();
    assert_eq!(b.ty, GgmlType::F16);
    assert_eq!(b.offset % 64, 0);
    assert_eq!(tensor_f32(&bytes, &g, "b"), vec![1.5, -2.0]);
}

#[test]
fn version_2_has_the_same_layout() {
    let mut bytes = fixture("metadata.gguf");
    bytes[4..8].copy_from_slice(&2u32.to_le_bytes());
    let g = Gguf::parse(&bytes).unwrap();
    assert_eq!(g.version, 2);
    assert_eq!(g.tensors.len(), 2);
}

fn parse_err(bytes: &[u8]) -> String {
    match Gguf::parse(bytes) {
        Ok(_) => panic!("corrupted input parsed"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn every_truncation_is_an_error() {
    for name in ["metadata.gguf", "dequant.gguf"] {
        let bytes = fixture(name);
        let g = Gguf::parse(&bytes).unwrap();
        // The writer pads after the last tensor; cutting that padding loses nothing.
        let end = g
            .tensors
            .iter()
            .map(|t| g.data_offset + t.offset + t.nbytes)
            .max()
            .unwrap() as usize;
        assert!(end <= bytes.len() && end + 64 > bytes.len());
        let step = if end > 4096 { 7 } else { 1 };
        for len in (0..end).step_by(step) {
            let e = parse_err(&bytes[..len]);
            assert!(e.contains("truncated"), "{name} cut at {len}: {e}");
        }
    }
}

#[test]
fn header_errors_name_the_problem() {
    let good = fixture("metadata.gguf");
    let patch = |at: usize, b: &[u8]| {
        let mut v = good.clone();
        v[at..at + b.len()].copy_from_slice(b);
        v
    };
    assert!(parse_err(&patch(0, b"GGUG")).contains("not a GGUF file"));
    assert!(parse_err(&patch(4, &1u32.to_le_bytes())).contains("version 1"));
    assert!(parse_err(&patch(4, &3u32.to_be_bytes())).contains("big-endian"));
    assert!(parse_err(&patch(4, &7u32.to_le_bytes())).contains("unsupported GGUF version 7"));
    // tensor count, kv count
    assert!(parse_err(&patch(8, &u64::MAX.to_le_bytes())).contains("tensor count"));
    assert!(parse_err(&patch(16, &(1u64 << 40).to_le_bytes())).contains("metadata key/value count"));
    // first key's length: a huge string length is refused before any allocation
    let e = parse_err(&patch(24, &(1u64 << 60).to_le_bytes()));
    assert!(e.contains("key length") && e.contains("offset 24"), "{e}");
    // first key's value type (key "general.architecture" is 20 bytes)
    let e = parse_err(&patch(24 + 8 + 20, &99u32.to_le_bytes()));
    assert!(
        e.contains("general.architecture") && e.contains("unknown value type id 99"),
        "{e}"
    );
}

/// A tiny GGUF writer for hand-made corruptions (layout as in `gguf/gguf_writer.py`).
struct Builder {
    kv: Vec<u8>,
    n_kv: u64,
    tensors: Vec<(String, Vec<u64>, u32, u64)>,
    data: Vec<u8>,
    alignment: u64,
}

impl Builder {
    fn new() -> Builder {
        Builder {
            kv: vec![],
            n_kv: 0,
            tensors: vec![],
            data: vec![],
            alignment: 32,
        }
    }
    fn str(buf: &mut Vec<u8>, s: &str) {
        buf.extend((s.len() as u64).to_le_bytes());
        buf.extend(s.as_bytes());
    }
    fn kv_raw(mut self, key: &str, ty: u32, value: &[u8]) -> Builder {
        Self::str(&mut self.kv, key);
        self.kv.extend(ty.to_le_bytes());
        self.kv.extend(value);
        self.n_kv += 1;
        self
    }
    fn tensor(mut self, name: &str, dims: &[u64], ty: u32, data: &[u8]) -> Builder {
        let off = self.data.len() as u64;
        self.tensors.push((name.into(), dims.to_vec(), ty, off));
        self.data.extend(data);
        while !(self.data.len() as u64).is_multiple_of(self.alignment) {
            self.data.push(0);
        }
        self
    }
    fn with_offset(mut self, i: usize, off: u64) -> Builder {
        self.tensors[i].3 = off;
        self
    }
    fn build(&self) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend((self.tensors.len() as u64).to_le_bytes());
        b.extend(self.n_kv.to_le_bytes());
        b.extend(&self.kv);
        for (name, dims, ty, off) in &self.tensors {
            Self::str(&mut b, name);
            b.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                b.extend(d.to_le_bytes());
            }
            b.extend(ty.to_le_bytes());
            b.extend(off.to_le_bytes());
        }
        while !(b.len() as u64).is_multiple_of(self.alignment) {
            b.push(0);
        }
        b.extend(&self.data);
        b
    }
}

#[test]
fn builder_output_parses() {
    let b = Builder::new()
        .kv_raw("k", 4, &7u32.to_le_bytes())
        .tensor("t", &[4], 0, &[0u8; 16])
        .build();
    let g = Gguf::parse(&b).unwrap();
    assert_eq!(g.get("k"), Some(&Value::U32(7)));
    assert_eq!(g.tensor("t").unwrap().nbytes, 16);
}

#[test]
fn tensor_errors_name_the_tensor() {
    let t16 = [0u8; 16];
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (
            Builder::new().tensor("w", &[4], 77, &t16).build(),
            "tensor 'w'",
        ),
        (
            Builder::new().tensor("w", &[4], 77, &t16).build(),
            "unknown ggml tensor type id 77",
        ),
        (
            Builder::new().tensor("w", &[16], 2, &t16).build(),
            "not a multiple of the Q4_0 block size 32",
        ),
        (
            Builder::new()
                .tensor("w", &[1, 2, 3, 4, 5], 0, &t16)
                .build(),
            "dimension count 5",
        ),
        (
            Builder::new()
                .tensor("w", &[1 << 40, 1 << 40], 0, &t16)
                .build(),
            "overflows",
        ),
        (
            Builder::new().tensor("w", &[16], 0, &t16).build(),
            "runs past the end",
        ),
        (
            Builder::new()
                .tensor("w", &[4], 0, &t16)
                .with_offset(0, 8)
                .build(),
            "not a multiple of the alignment",
        ),
        (
            Builder::new()
                .tensor("a", &[8], 0, &[0u8; 32])
                .tensor("b", &[4], 0, &t16)
                .with_offset(1, 0)
                .build(),
            "overlaps",
        ),
        (
            Builder::new()
                .tensor("w", &[4], 0, &t16)
                .tensor("w", &[4], 0, &t16)
                .build(),
            "duplicate tensor name",
        ),
        (
            Builder::new()
                .kv_raw("general.alignment", 4, &48u32.to_le_bytes())
                .build(),
            "general.alignment",
        ),
        (
            Builder::new().kv_raw("k", 7, &[2]).build(),
            "bool value must be 0 or 1",
        ),
        (
            Builder::new()
                .kv_raw("k", 8, &[1, 0, 0, 0, 0, 0, 0, 0, 0xff])
                .build(),
            "not valid UTF-8",
        ),
        (
            Builder::new()
                .kv_raw("k", 4, &[0; 4])
                .kv_raw("k", 4, &[0; 4])
                .build(),
            "duplicate key",
        ),
        (
            // array of 2^40 uint32 in a tiny file
            Builder::new()
                .kv_raw(
                    "k",
                    9,
                    &[&4u32.to_le_bytes()[..], &(1u64 << 40).to_le_bytes()].concat(),
                )
                .build(),
            "array length",
        ),
        (
            // arrays nested four deep
            Builder::new()
                .kv_raw(
                    "k",
                    9,
                    &[9u32, 1, 0, 9, 1, 0, 9, 1, 0, 4, 1, 0]
                        .chunks(3)
                        .flat_map(|c| {
                            [&c[0].to_le_bytes()[..], &(c[1] as u64).to_le_bytes()[..]].concat()
                        })
                        .collect::<Vec<u8>>(),
                )
                .build(),
            "nested deeper",
        ),
    ];
    for (bytes, want) in cases {
        let e = match Gguf::parse(&bytes) {
            Ok(_) => panic!("case {want:?} parsed"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains(want), "expected {want:?} in: {e}");
    }
}

/// Deterministic mutation fuzzing: random byte edits in the header region must give an error or
/// a structure whose every tensor can be read and dequantized, never a panic.
#[test]
fn random_corruptions_never_panic() {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for name in ["metadata.gguf", "dequant.gguf"] {
        let good = fixture(name);
        let header_len = Gguf::parse(&good).unwrap().data_offset as usize;
        let mut parsed_ok = 0;
        for _ in 0..3000 {
            let mut b = good.clone();
            for _ in 0..1 + next() % 4 {
                let at = (next() % header_len as u64) as usize;
                b[at] = match next() % 4 {
                    0 => 0,
                    1 => 0xff,
                    _ => next() as u8,
                };
            }
            if let Ok(g) = Gguf::parse(&b) {
                parsed_ok += 1;
                for t in &g.tensors {
                    let start = (g.data_offset + t.offset) as usize;
                    let data = &b[start..start + t.nbytes as usize];
                    if t.ty.can_dequantize() && t.n_elements() < 1 << 20 {
                        let mut out = vec![0f32; t.n_elements() as usize];
                        dequant::dequantize(t.ty, data, &mut out).unwrap();
                    }
                }
            }
        }
        // Some edits land in values (e.g. string bytes) and are harmless: make sure the loop is
        // exercising both outcomes rather than only one.
        assert!(
            parsed_ok > 0 && parsed_ok < 3000,
            "{name}: {parsed_ok} of 3000 parsed"
        );
    }
}

#[test]
fn huge_metadata_arrays_and_tokens_are_refused() {
    // A uint8 array longer than the per-array limit: refused before it is expanded.
    let n = cmf_convert::gguf::MAX_ARRAY_LEN + 1;
    let mut arr = 0u32.to_le_bytes().to_vec(); // element type uint8
    arr.extend((n as u64).to_le_bytes());
    arr.extend(vec![0u8; n]);
    let b = Builder::new().kv_raw("big", 9, &arr).build();
    let e = Gguf::parse(&b).unwrap_err().to_string();
    assert!(e.contains("big") && e.contains("above the limit"), "{e}");

    // A SentencePiece vocabulary with one 300 000-byte token: refused at once (deriving its
    // merges is quadratic in its length).
    let string_array = |items: &[String]| {
        let mut v = 8u32.to_le_bytes().to_vec();
        v.extend((items.len() as u64).to_le_bytes());
        for s in items {
            v.extend((s.len() as u64).to_le_bytes());
            v.extend(s.as_bytes());
        }
        v
    };
    let tokens = vec!["a".to_string(), "b".repeat(300_000)];
    let mut scores = 6u32.to_le_bytes().to_vec();
    scores.extend(2u64.to_le_bytes());
    scores.extend([0f32.to_le_bytes(), 0f32.to_le_bytes()].concat());
    let mut model = 5u64.to_le_bytes().to_vec();
    model.extend(b"llama");
    let b = Builder::new()
        .kv_raw("tokenizer.ggml.model", 8, &model)
        .kv_raw("tokenizer.ggml.tokens", 9, &string_array(&tokens))
        .kv_raw("tokenizer.ggml.scores", 9, &scores)
        .build();
    let g = Gguf::parse(&b).unwrap();
    let start = std::time::Instant::now();
    let e = match cmf_convert::import_gguf::tokenizer::rebuild(&g) {
        Ok(_) => panic!("a 300 000-byte token was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(start.elapsed().as_millis() < 1000);
    assert!(
        e.contains("tokenizer.ggml.tokens") && e.contains("token #1"),
        "{e}"
    );
}
