//! File-level interop with the reference crate `cortiq-core` 0.8.54, both directions:
//! (a) files it writes (one-shot and streaming writer) open, verify and decode identically here;
//! (b) files we write (single and sharded) open and verify there, with identical dequantized
//! values and the tokenizer bundle intact.

mod common;

use cmf_format::{codec, CmfFile, CmfModel, CmfWriter, Dtype, Header};
use common::*;
use cortiq_core::format::CmfStreamWriter;
use cortiq_core::{CmfHeader, CmfModel as OracleModel, TensorDtype, TensorSpec};

fn oracle_dtype(d: Dtype) -> TensorDtype {
    TensorDtype::from_id(d.id()).unwrap()
}

fn to_oracle_header(h: &Header) -> CmfHeader {
    serde_json::from_value(serde_json::to_value(h).unwrap()).unwrap()
}

/// Encoded payloads for the shared tensor set; q8_2f bytes come from the reference encoder.
fn payloads() -> Vec<(String, Dtype, Vec<usize>, Vec<u8>)> {
    tensor_set()
        .into_iter()
        .enumerate()
        .map(|(i, (name, dtype, shape))| {
            let vals = values(shape.iter().product(), 100 + i as u64, 0.7);
            let bytes = if dtype == Dtype::Q8_2f {
                cortiq_core::quant::encode_q8_2f(&vals, shape[0], shape[1])
            } else {
                codec::encode(dtype, &shape, &vals).unwrap()
            };
            (name, dtype, shape, bytes)
        })
        .chain(std::iter::once((
            "model.config_json".to_string(),
            Dtype::U8,
            vec![11],
            b"{\"k\": true}".to_vec(),
        )))
        .collect()
}

fn oracle_decode(m: &OracleModel, name: &str) -> Vec<u32> {
    let e = m.tensor(name).unwrap();
    let mut out = vec![0f32; e.n_elems()];
    cortiq_core::quant::dequant_tensor(e, m.tensor_bytes(name).unwrap(), &mut out).unwrap();
    out.iter().map(|v| v.to_bits()).collect()
}

fn bits(v: Vec<f32>) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn check_ours_reads_oracle_file(
    path: &std::path::Path,
    tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)],
) {
    let f = CmfFile::open(path).unwrap();
    let report = f.verify();
    assert!(report.is_ok(), "{:?}", report.problems);
    assert_eq!(report.sections_checked, ["header", "dir", "vocab"]);
    assert_eq!(f.vocab(), Some(TOKENIZER_JSON));
    let tc = f.header().tokenizer_config.as_ref().unwrap();
    assert_eq!(tc.chat_template.as_deref(), Some(CHAT_TEMPLATE));
    assert_eq!(
        (tc.eos_token_ids.as_slice(), tc.bos_token_id),
        (&[2, 7][..], Some(1))
    );
    assert_eq!(f.header().arch.arch_name, "llama");
    assert_eq!(f.header().arch.layer_types, arch().layer_types);
    let oracle = OracleModel::open(path).unwrap();
    for (name, dtype, shape, bytes) in tensors {
        let t = f.get(name).unwrap();
        assert_eq!(
            (t.dtype, t.shape.as_slice(), t.data),
            (*dtype, &shape[..], &bytes[..]),
            "{name}"
        );
        if *dtype != Dtype::U8 {
            assert_eq!(
                bits(t.to_f32().unwrap()),
                oracle_decode(&oracle, name),
                "{name}"
            );
        }
    }
}

/// Writes `tensors` (with the test header and tokenizer) as a CMF file through the oracle.
fn write_with_oracle(path: &std::path::Path, tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)]) {
    let specs: Vec<TensorSpec> = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| TensorSpec {
            name: name.clone(),
            dtype: oracle_dtype(*dtype),
            shape: shape.clone(),
            data: bytes.clone(),
        })
        .collect();
    OracleModel::write(
        path,
        &to_oracle_header(&header()),
        &specs,
        None,
        Some(TOKENIZER_JSON),
    )
    .unwrap();
}

#[test]
fn oracle_written_file_reads_here() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("oracle.cmf");
    let tensors = payloads();
    write_with_oracle(&path, &tensors);
    check_ours_reads_oracle_file(&path, &tensors);
    // Our unknown-field passthrough: the reference serialized its own defaults (hidden_act, …).
    let f = CmfFile::open(&path).unwrap();
    assert!(f.header_json().contains("\"chat_template\""));
}

#[test]
fn oracle_stream_written_file_reads_here() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("stream.cmf");
    let tensors = payloads();
    let mut w =
        CmfStreamWriter::new(&path, CmfStreamWriter::head_reserve_for(tensors.len(), 40)).unwrap();
    for (name, dtype, shape, bytes) in &tensors {
        w.push(name, oracle_dtype(*dtype), shape, bytes).unwrap();
    }
    w.finish(&to_oracle_header(&header()), None, Some(TOKENIZER_JSON))
        .unwrap();
    check_ours_reads_oracle_file(&path, &tensors);
}

#[test]
fn our_file_reads_in_oracle() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ours.cmf");
    let tensors = payloads();
    let mut w = CmfWriter::create(&path, header()).unwrap();
    for (name, dtype, shape, bytes) in &tensors {
        w.add_tensor(name, *dtype, shape, bytes).unwrap();
    }
    w.set_vocab(TOKENIZER_JSON);
    w.finish().unwrap();

    let m = OracleModel::open(&path).unwrap();
    assert_eq!(m.verify(), Vec::<String>::new());
    assert_eq!(m.tensors.len(), tensors.len());
    assert_eq!(m.vocab.as_deref(), Some(TOKENIZER_JSON));
    let tc = m.header.tokenizer_config.as_ref().unwrap();
    assert_eq!(tc.chat_template.as_deref(), Some(CHAT_TEMPLATE));
    assert_eq!(
        (
            tc.eos_token_ids.as_slice(),
            tc.bos_token_id,
            tc.pad_token_id
        ),
        (&[2, 7][..], Some(1), None)
    );
    assert_eq!(m.header.arch.rope_theta, 500_000.0);
    assert_eq!(m.header.arch.sliding_window, Some(128));
    let ours = CmfFile::open(&path).unwrap();
    for (name, dtype, shape, bytes) in &tensors {
        assert_eq!(m.tensor_bytes(name).unwrap(), &bytes[..], "{name}");
        assert_eq!(m.tensor(name).unwrap().shape, *shape);
        if *dtype != Dtype::U8 {
            assert_eq!(
                oracle_decode(&m, name),
                bits(ours.get(name).unwrap().to_f32().unwrap()),
                "{name}"
            );
        }
    }
    // The q8_2f tensor makes QUANT_2F required; the reference derives the same bits.
    assert_eq!(m.required_features, 0b101);
}

#[test]
fn our_shard_set_reads_in_oracle() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sharded.cmf");
    let tensors = payloads();
    let mut w = CmfWriter::create_sharded(&path, header(), 8 * 1024).unwrap();
    for (name, dtype, shape, bytes) in &tensors {
        w.add_tensor(name, *dtype, shape, bytes).unwrap();
    }
    w.set_vocab(TOKENIZER_JSON);
    let first = w.finish().unwrap();
    let m = OracleModel::open_sharded(&first).unwrap();
    assert!(m.header.shard.as_ref().unwrap().count > 2);
    assert_eq!(m.tensors.len(), tensors.len());
    assert_eq!(m.verify(), Vec::<String>::new());
    assert_eq!(m.vocab.as_deref(), Some(TOKENIZER_JSON));
    assert!(m.header.tokenizer_config.is_some());
    let ours = CmfModel::open(&first).unwrap();
    for (name, dtype, _, bytes) in &tensors {
        assert_eq!(m.tensor_bytes(name).unwrap(), &bytes[..], "{name}");
        if *dtype != Dtype::U8 {
            assert_eq!(
                oracle_decode(&m, name),
                bits(ours.get(name).unwrap().to_f32().unwrap()),
                "{name}"
            );
        }
    }
}

#[test]
fn a_flipped_data_byte_in_an_oracle_file_names_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("o.cmf");
    write_with_oracle(&path, &payloads());
    let original = std::fs::read(&path).unwrap();
    let f = CmfFile::open(&path).unwrap();
    let spans: Vec<(String, u64, usize)> = f
        .tensors()
        .map(|t| (t.name.to_string(), t.file_offset, t.data.len()))
        .collect();
    drop(f);
    for (name, off, len) in spans {
        for pick in [0, len / 2, len - 1] {
            let mut bytes = original.clone();
            bytes[off as usize + pick] ^= 0x10;
            std::fs::write(&path, &bytes).unwrap();
            let report = CmfFile::open(&path).unwrap().verify();
            assert_eq!(report.problems.len(), 1, "{name}+{pick}");
            assert!(report.problems[0]
                .to_string()
                .contains(&format!("tensor '{name}'")));
        }
    }
}
