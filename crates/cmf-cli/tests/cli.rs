//! `cmf info` / `cmf verify` end to end: run the built binary on files written by our writer
//! and by the reference crate, check output and exit codes (0 ok, 1 runtime or malformed, 2 usage,
//! 3 a hash does not hold).

mod common;
use common::{cmf, text};
use std::path::{Path, PathBuf};

use cmf_format::{
    codec, Arch, CmfFile, CmfWriter, Dtype, Header, LayerType, QuantType, TokenizerConfig,
};

const TEMPLATE: &str = "{% for m in messages %}{{ m.content }}{% endfor %}";
const TOKENIZER: &[u8] = br#"{"version":"1.0","model":{"type":"BPE","vocab":{},"merges":[]}}"#;

fn header() -> Header {
    let arch = Arch {
        arch_name: "qwen3".into(),
        hidden_size: 64,
        intermediate_size: 128,
        num_layers: 2,
        num_attention_heads: 4,
        num_kv_heads: 2,
        head_dim: 16,
        vocab_size: 32,
        layer_types: vec![LayerType::FullAttention; 2],
        max_position_embeddings: 1024,
        ..Arch::default()
    };
    let mut h = Header::new(arch, QuantType::Q8Row);
    h.tokenizer_config = Some(TokenizerConfig {
        chat_template: Some(TEMPLATE.into()),
        eos_token_ids: vec![3],
        ..Default::default()
    });
    h
}

const TENSORS: [(&str, Dtype, [usize; 2]); 4] = [
    ("model.embed_tokens.weight", Dtype::F16, [32, 64]),
    (
        "model.layers.0.mlp.up_proj.weight",
        Dtype::Q4Tiled,
        [128, 64],
    ),
    (
        "model.layers.0.mlp.down_proj.weight",
        Dtype::Q8Row,
        [64, 128],
    ),
    (
        "model.layers.1.mlp.up_proj.weight",
        Dtype::Q4Tiled,
        [128, 64],
    ),
];

fn payload(dtype: Dtype, shape: &[usize]) -> Vec<u8> {
    let vals: Vec<f32> = (0..shape.iter().product::<usize>())
        .map(|i| ((i * 37) % 101) as f32 / 101.0 - 0.5)
        .collect();
    codec::encode(dtype, shape, &vals).unwrap()
}

fn write_ours(dir: &Path) -> PathBuf {
    let path = dir.join("m.cmf");
    let mut w = CmfWriter::create(&path, header()).unwrap();
    for (name, dtype, shape) in TENSORS {
        w.add_tensor(name, dtype, &shape, &payload(dtype, &shape))
            .unwrap();
    }
    w.set_vocab(TOKENIZER);
    w.finish().unwrap()
}

fn write_oracle(dir: &Path) -> PathBuf {
    let path = dir.join("oracle.cmf");
    let specs: Vec<cortiq_core::TensorSpec> = TENSORS
        .iter()
        .map(|&(name, dtype, shape)| cortiq_core::TensorSpec {
            name: name.into(),
            dtype: cortiq_core::TensorDtype::from_id(dtype.id()).unwrap(),
            shape: shape.to_vec(),
            data: payload(dtype, &shape),
        })
        .collect();
    let h: cortiq_core::CmfHeader =
        serde_json::from_value(serde_json::to_value(header()).unwrap()).unwrap();
    cortiq_core::CmfModel::write(&path, &h, &specs, None, Some(TOKENIZER)).unwrap();
    path
}

#[test]
fn info_text() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_ours(dir.path());
    let o = cmf(&["info", path.to_str().unwrap()]);
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    for needle in [
        "qwen3",
        "FullAttention ×2",
        "chat template: yes",
        "tokenizer.json embedded",
        "tensors     4",
        "q4_tiled",
        "     2",
    ] {
        assert!(out.contains(needle), "missing {needle:?} in:\n{out}");
    }
    assert!(!out.contains("up_proj"), "no listing without --tensors");

    let o = cmf(&[
        "info",
        path.to_str().unwrap(),
        "--tensors",
        "model.layers.0.",
    ]);
    let out = text(&o);
    assert!(
        out.contains("model.layers.0.mlp.up_proj.weight") && out.contains("[128, 64]"),
        "{out}"
    );
    assert!(
        !out.contains("model.layers.1.") && !out.contains("embed_tokens.weight  "),
        "{out}"
    );
}

#[test]
fn info_json() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_ours(dir.path());
    let o = cmf(&["info", path.to_str().unwrap(), "--json", "--tensors"]);
    assert!(o.status.success(), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["tensor_count"], 4);
    assert_eq!(v["by_dtype"]["q4_tiled"]["count"], 2);
    assert_eq!(v["by_dtype"]["f16"]["bytes"], 32 * 64 * 2);
    assert_eq!(v["arch"]["arch_name"], "qwen3");
    assert_eq!(v["tokenizer"]["chat_template"], true);
    assert_eq!(v["tokenizer"]["eos_token_ids"], serde_json::json!([3]));
    assert_eq!(
        v["tensors"].as_array().unwrap().len(),
        4,
        "--tensors without a prefix lists all"
    );
    assert_eq!(v["tensors"][1]["shape"], serde_json::json!([128, 64]));
}

#[test]
fn verify_passes_on_good_files_from_both_writers() {
    let dir = tempfile::tempdir().unwrap();
    for path in [write_ours(dir.path()), write_oracle(dir.path())] {
        let o = cmf(&["verify", path.to_str().unwrap()]);
        assert_eq!(o.status.code(), Some(0), "{}", text(&o));
        assert!(text(&o).contains("OK      4 tensors"), "{}", text(&o));
    }
}

/// Any single flipped byte inside a tensor's data fails verification naming that tensor,
/// for files written by us and by the reference crate.
#[test]
fn verify_names_the_corrupted_tensor() {
    let dir = tempfile::tempdir().unwrap();
    for path in [write_ours(dir.path()), write_oracle(dir.path())] {
        let original = std::fs::read(&path).unwrap();
        let spans: Vec<(String, usize, usize)> = CmfFile::open(&path)
            .unwrap()
            .tensors()
            .map(|t| (t.name.to_string(), t.file_offset as usize, t.data.len()))
            .collect();
        for (name, off, len) in spans {
            for pick in [0, len / 3, len - 1] {
                let mut bytes = original.clone();
                bytes[off + pick] ^= 0x01;
                std::fs::write(&path, &bytes).unwrap();
                let o = cmf(&["verify", path.to_str().unwrap()]);
                let out = text(&o);
                assert_eq!(o.status.code(), Some(3), "{out}");
                assert!(
                    out.contains(&format!("tensor '{name}' hash mismatch")),
                    "{name}+{pick}: {out}"
                );
            }
        }
        std::fs::write(&path, &original).unwrap();
    }
}

#[test]
fn verify_fails_on_metadata_corruption_and_truncation() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_ours(dir.path());
    let original = std::fs::read(&path).unwrap();
    let f = CmfFile::open(&path).unwrap();
    let header = f.envelope().section(cmf_format::Section::Header);
    let vocab = f.envelope().section(cmf_format::Section::Vocab);
    drop(f);

    // A header byte inside a JSON string: still parses, the header hash catches it.
    let json = std::str::from_utf8(&original[header.range()]).unwrap();
    let at = header.off as usize + json.find("qwen3").unwrap();
    let mut bytes = original.clone();
    bytes[at] = b'Q';
    std::fs::write(&path, &bytes).unwrap();
    let o = cmf(&["verify", path.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(3));
    assert!(
        text(&o).contains("header section hash mismatch"),
        "{}",
        text(&o)
    );

    let mut bytes = original.clone();
    bytes[vocab.off as usize + 3] ^= 0x20;
    std::fs::write(&path, &bytes).unwrap();
    let o = cmf(&["verify", path.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(3));
    assert!(
        text(&o).contains("vocab section hash mismatch"),
        "{}",
        text(&o)
    );

    // Truncated: malformed, not corrupted-but-readable, so exit 1 as for every command.
    std::fs::write(&path, &original[..original.len() - 10]).unwrap();
    let o = cmf(&["verify", path.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o).contains("runs past the end of the file"),
        "{}",
        text(&o)
    );
    let o = cmf(&["info", path.to_str().unwrap()]);
    assert_eq!(
        o.status.code(),
        Some(1),
        "info on an invalid file is a runtime error"
    );
}

#[test]
fn exit_codes_for_usage_and_io_errors() {
    assert_eq!(cmf(&[]).status.code(), Some(2));
    assert_eq!(cmf(&["info"]).status.code(), Some(2));
    assert_eq!(cmf(&["verify", "a.cmf", "--bogus"]).status.code(), Some(2));
    assert_eq!(cmf(&["--help"]).status.code(), Some(0));
    let o = cmf(&["verify", "/nonexistent/model.cmf"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o).contains("/nonexistent/model.cmf"), "{}", text(&o));
    let o = cmf(&["info", "/nonexistent/model.cmf"]);
    assert_eq!(o.status.code(), Some(1));
}
