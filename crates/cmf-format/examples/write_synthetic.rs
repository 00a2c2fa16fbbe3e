//! Writes a synthetic CMF file with our writer: `n` weight matrices of `rows × cols` in a
//! chosen codec, streamed one tensor at a time (the payload is encoded once and reused, so the
//! tool stays fast and small in memory for multi-GB outputs). Used by `bench/info_large.sh`.
//!
//! `cargo run --release -p cmf-format --example write_synthetic -- OUT.cmf TOTAL_BYTES [DTYPE]`

use cmf_format::{codec, Arch, CmfWriter, Dtype, Header, LayerType, QuantType};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: write_synthetic OUT.cmf TOTAL_BYTES [DTYPE]");
        std::process::exit(2);
    }
    let total: u64 = args[2].parse()?;
    let dtype = Dtype::from_name(args.get(3).map(String::as_str).unwrap_or("q4_tiled"))
        .ok_or("unknown dtype")?;
    let (rows, cols) = (4096usize, 4096usize);
    let values: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 2654435761) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let bytes = codec::encode(dtype, &[rows, cols], &values)?;
    let n = total.div_ceil(bytes.len() as u64) as usize;
    let per_layer = 7;
    let layers = n.div_ceil(per_layer);
    let arch = Arch {
        arch_name: "llama".into(),
        hidden_size: cols,
        intermediate_size: rows,
        num_layers: layers,
        num_attention_heads: 32,
        num_kv_heads: 8,
        head_dim: 128,
        vocab_size: 32000,
        layer_types: vec![LayerType::FullAttention; layers],
        max_position_embeddings: 4096,
        ..Arch::default()
    };
    let mut w = CmfWriter::create(&args[1], Header::new(arch, QuantType::Q4Block))?;
    let names = [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ];
    for i in 0..n {
        let name = format!(
            "model.layers.{}.{}.weight",
            i / per_layer,
            names[i % per_layer]
        );
        w.add_tensor(&name, dtype, &[rows, cols], &bytes)?;
    }
    let path = w.finish()?;
    println!(
        "{} tensors of {} {rows}x{cols} -> {}",
        n,
        dtype,
        path.display()
    );
    Ok(())
}
