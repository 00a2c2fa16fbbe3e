//! Deterministic corruption: truncation at every section boundary and at pseudo-random points,
//! single-bit flips in envelope, header, directory, vocab and tensor data, targeted directory
//! faults, and every saved fuzz input. The reader must refuse the file with an `Invalid` error
//! or `verify` must report the damage, naming the tensor when the damage is in tensor data;
//! it must never panic.

mod common;

use cmf_format::envelope::{Section, ENVELOPE_LEN};
use cmf_format::{CmfFile, CmfWriter, Dtype, Error, FaultKind, Problem};
use common::*;

/// A small file with every codec, a vocab and a tokenizer bundle, written by our writer.
fn ours() -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.cmf");
    let mut w = CmfWriter::create(&path, header()).unwrap();
    for (i, (name, dtype, shape)) in tensor_set().into_iter().enumerate() {
        w.add_f32(
            &name,
            dtype,
            &shape,
            &values(shape.iter().product(), i as u64, 1.0),
        )
        .unwrap();
    }
    w.set_vocab(TOKENIZER_JSON);
    w.finish().unwrap();
    std::fs::read(&path).unwrap()
}

/// The same content in the reference writer's layout (header and directory first).
fn theirs() -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("o.cmf");
    let specs: Vec<cortiq_core::TensorSpec> = tensor_set()
        .into_iter()
        .enumerate()
        .map(|(i, (name, dtype, shape))| cortiq_core::TensorSpec {
            data: cmf_format::codec::encode(
                dtype,
                &shape,
                &values(shape.iter().product(), i as u64, 1.0),
            )
            .unwrap(),
            name,
            dtype: cortiq_core::TensorDtype::from_id(dtype.id()).unwrap(),
            shape,
        })
        .collect();
    let h: cortiq_core::CmfHeader =
        serde_json::from_value(serde_json::to_value(header()).unwrap()).unwrap();
    cortiq_core::CmfModel::write(&path, &h, &specs, None, Some(TOKENIZER_JSON)).unwrap();
    std::fs::read(&path).unwrap()
}

#[derive(Debug)]
enum Outcome {
    Refused(String),
    /// Opened, and verify reported these problems.
    Detected(Vec<Problem>),
    Undetected,
}

/// Opens, verifies and decodes everything; any panic fails the test.
fn examine(bytes: Vec<u8>) -> Outcome {
    match CmfFile::from_bytes("corrupt.cmf", bytes) {
        Err(e @ Error::Invalid { .. }) => Outcome::Refused(e.to_string()),
        Err(other) => panic!("a corrupt file must give Error::Invalid, got {other}"),
        Ok(f) => {
            for t in f.tensors() {
                if t.dtype != Dtype::U8 {
                    t.to_f32().expect("validated tensors decode");
                }
            }
            let _ = (f.header_json(), f.vocab());
            let r = f.verify();
            if r.is_ok() {
                Outcome::Undetected
            } else {
                Outcome::Detected(r.problems)
            }
        }
    }
}

fn sections(bytes: &[u8]) -> Vec<(Section, usize, usize)> {
    let f = CmfFile::from_bytes("x", bytes.to_vec()).unwrap();
    Section::ALL
        .into_iter()
        .map(|s| (s, f.envelope().section(s)))
        .filter(|(_, span)| span.is_present())
        .map(|(s, span)| (s, span.off as usize, span.end() as usize))
        .collect()
}

/// Pseudo-random numbers for picking positions, reproducible.
fn picks(n: usize, below: usize, seed: u64) -> Vec<usize> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % below as u64) as usize
        })
        .collect()
}

#[test]
fn every_truncation_is_refused() {
    for file in [ours(), theirs()] {
        let mut cuts: Vec<usize> = vec![
            0,
            1,
            4,
            64,
            ENVELOPE_LEN - 1,
            ENVELOPE_LEN,
            ENVELOPE_LEN + 1,
        ];
        for (_, start, end) in sections(&file) {
            for c in [start, end] {
                cuts.extend([c.saturating_sub(1), c, c + 1]);
            }
        }
        cuts.extend(picks(300, file.len(), 42));
        for cut in cuts.into_iter().filter(|&c| c < file.len()) {
            match examine(file[..cut].to_vec()) {
                Outcome::Refused(msg) => assert!(msg.starts_with("corrupt.cmf: "), "{msg}"),
                other => panic!("truncation to {cut} of {} bytes: {other:?}", file.len()),
            }
        }
    }
}

#[test]
fn every_bit_flip_in_metadata_is_refused_or_detected() {
    for file in [ours(), theirs()] {
        let mut positions: Vec<usize> = (0..ENVELOPE_LEN)
            // Not covered by design (spec §8.1: the envelope is not hashed): the reserved flags
            // word, and the offsets of the absent masks/index sections (length 0 = absent).
            .filter(|p| {
                !(0x08..0x0C).contains(p) && !(0x40..0x48).contains(p) && !(0x60..0x68).contains(p)
            })
            .collect();
        for (s, start, end) in sections(&file) {
            if s != Section::Data {
                positions.extend(start..end);
            }
        }
        for (k, pos) in positions.into_iter().enumerate() {
            let mut bytes = file.clone();
            bytes[pos] ^= 1 << (k % 8);
            if let Outcome::Undetected = examine(bytes) {
                panic!("flipping bit {} of byte {pos:#x} went unnoticed", k % 8);
            }
        }
    }
}

#[test]
fn a_flip_in_tensor_data_is_reported_with_the_tensor_name() {
    for file in [ours(), theirs()] {
        let f = CmfFile::from_bytes("x", file.clone()).unwrap();
        let tensors: Vec<(String, usize, usize)> = f
            .tensors()
            .map(|t| (t.name.to_string(), t.file_offset as usize, t.data.len()))
            .collect();
        for (i, (name, off, len)) in tensors.into_iter().enumerate() {
            let mut at = vec![0, len - 1];
            at.extend(picks(20, len, i as u64 + 1));
            for (k, p) in at.into_iter().enumerate() {
                let mut bytes = file.clone();
                bytes[off + p] ^= 1 << (k % 8);
                match examine(bytes) {
                    Outcome::Detected(problems) => {
                        assert_eq!(problems.len(), 1);
                        assert!(
                            matches!(&problems[0], Problem::Tensor { name: n, .. } if *n == name),
                            "{problems:?}"
                        );
                    }
                    other => panic!("{name}+{p}: {other:?}"),
                }
            }
        }
    }
}

/// Hand-made directory faults: each is refused at open with the field, tensor and offset named.
#[test]
fn directory_faults_name_field_tensor_and_offset() {
    let file = ours();
    let f = CmfFile::from_bytes("x", file.clone()).unwrap();
    let dir = f.envelope().section(Section::Directory).off as usize;
    let rec = |i: usize| dir + 16 + 56 * i;
    let name1 = f.tensors().nth(1).unwrap().name.to_string();
    drop(f);
    let refuse = |edit: &dyn Fn(&mut Vec<u8>)| -> cmf_format::Fault {
        let mut b = file.clone();
        edit(&mut b);
        match CmfFile::from_bytes("x", b) {
            Err(e) => e.fault().expect("Invalid").clone(),
            Ok(_) => panic!("edit was accepted"),
        }
    };
    let put = |b: &mut Vec<u8>, at: usize, v: &[u8]| b[at..at + v.len()].copy_from_slice(v);

    let f = refuse(&|b| b[rec(1) + 6] = 21); // mxfp4
    assert_eq!(
        (f.kind, f.field, f.tensor.as_deref(), f.offset),
        (
            FaultKind::Unsupported,
            "dtype",
            Some(&*name1),
            Some((rec(1) + 6) as u64)
        )
    );
    assert!(f.to_string().contains("mxfp4"));
    let f = refuse(&|b| b[rec(1) + 6] = 99);
    assert!(f.message.contains("unknown dtype id 99"));
    assert_eq!(refuse(&|b| b[rec(1) + 7] = 7).field, "ndim");
    let f = refuse(&|b| put(b, rec(1) + 8, &1000u32.to_le_bytes()));
    assert_eq!((f.field, f.tensor.as_deref()), ("nbytes", Some(&*name1)));
    assert_eq!(refuse(&|b| b[rec(1) + 32] |= 8).field, "offset");
    assert_eq!(
        refuse(&|b| put(b, rec(1) + 32, &(1u64 << 40).to_le_bytes())).field,
        "nbytes"
    );
    let f = refuse(&|b| {
        let first = b[rec(0) + 32..rec(0) + 40].to_vec();
        put(b, rec(1) + 32, &first);
    });
    assert_eq!(f.field, "offset");
    assert!(f.message.contains("overlaps"), "{f}");
    let f = refuse(&|b| {
        let first = b[rec(0)..rec(0) + 6].to_vec();
        put(b, rec(1), &first);
    });
    assert!(f.message.contains("duplicate"), "{f}");
    let f = refuse(&|b| put(b, rec(1), &u32::MAX.to_le_bytes()));
    assert_eq!((f.field, f.tensor.as_deref()), ("name_off", Some("#1")));
    let f = refuse(&|b| put(b, dir, &u64::MAX.to_le_bytes()));
    assert_eq!((f.field, f.offset), ("dir.count", Some(dir as u64)));
}

/// Every input the fuzzer ever crashed on (or that we keep as a known hard case).
#[test]
fn regression_inputs_do_not_panic() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/regressions");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            continue;
        }
        let _ = examine_lenient(std::fs::read(&path).unwrap());
        n += 1;
    }
    assert!(n > 0, "no regression inputs in {}", dir.display());
}

/// Like `examine`, but any outcome (including a non-Invalid error) is fine: only panics fail.
fn examine_lenient(bytes: Vec<u8>) -> Option<()> {
    let f = CmfFile::from_bytes("fuzz.cmf", bytes).ok()?;
    for t in f.tensors() {
        let _ = t.to_f32();
    }
    let _ = f.verify();
    Some(())
}

#[test]
fn a_section_dropped_from_the_envelope_but_recorded_in_the_header_is_reported() {
    let bytes = ours();
    let f = CmfFile::from_bytes("x", bytes.clone()).unwrap();
    let mut env = *f.envelope();
    drop(f);
    env.set_section(Section::Vocab, cmf_format::envelope::Span::new(0, 0));
    let mut cut = bytes;
    cut[..cmf_format::envelope::ENVELOPE_LEN].copy_from_slice(&env.encode());
    let f = CmfFile::from_bytes("cut.cmf", cut).expect("still a well-formed file");
    assert!(f.vocab().is_none());
    let r = f.verify();
    assert!(!r.is_ok());
    let msg = r.problems[0].to_string();
    assert!(msg.contains("cut.cmf") && msg.contains("vocab"), "{msg}");
}
