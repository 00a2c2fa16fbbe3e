//! Writes small valid CMF files to seed the fuzzer's corpus (see fuzz/README.md):
//! one tensor per codec with tiny shapes, a vocab and a tokenizer bundle; and an empty model.
//!
//! `cargo run -p cmf-format --example fuzz_seeds -- OUT_DIR`

use cmf_format::{Arch, CmfWriter, Dtype, Header, LayerType, QuantType, TokenizerConfig};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::path::PathBuf::from(std::env::args().nth(1).ok_or("usage: fuzz_seeds OUT_DIR")?);
    std::fs::create_dir_all(&out)?;
    let arch = Arch {
        arch_name: "llama".into(),
        num_layers: 1,
        layer_types: vec![LayerType::FullAttention],
        ..Arch::default()
    };
    let mut header = Header::new(arch, QuantType::Q8Row);
    header.tokenizer_config = Some(TokenizerConfig {
        chat_template: Some("{{ m }}".into()),
        eos_token_ids: vec![2],
        ..Default::default()
    });
    let mut w = CmfWriter::create(out.join("codecs.cmf"), header.clone())?;
    let tensors: [(&str, Dtype, &[usize]); 8] = [
        ("a", Dtype::F32, &[3]),
        ("b", Dtype::F16, &[2, 2]),
        ("c", Dtype::Bf16, &[]),
        ("d", Dtype::Q8Row, &[2, 3]),
        ("e", Dtype::Q8_2f, &[2, 3]),
        ("f", Dtype::Q4Block, &[5]),
        ("g", Dtype::Q4Tiled, &[1, 32]),
        ("h", Dtype::Q4Tp, &[2, 64]),
    ];
    for (name, dtype, shape) in tensors {
        let n: usize = shape.iter().product();
        let vals: Vec<f32> = (0..n).map(|i| i as f32 * 0.25 - 1.0).collect();
        w.add_f32(name, dtype, shape, &vals)?;
    }
    w.add_tensor("blob", Dtype::U8, &[2], b"{}")?;
    w.set_vocab(br#"{"model":{}}"#.to_vec());
    w.finish()?;
    CmfWriter::create(out.join("empty.cmf"), header)?.finish()?;
    Ok(())
}
