//! Measures the requantization error of importing a GGUF with each codec choice:
//! relative RMS (‖decoded − dequantized GGUF‖ / ‖dequantized GGUF‖) over all matrices and the
//! worst tensor. usage: cargo run --release -p cmf-convert --example requant_error -- FILE.gguf
use cmf_convert::{import_gguf, Options, Quant};

fn main() {
    let path = std::path::PathBuf::from(
        std::env::args()
            .nth(1)
            .expect("usage: requant_error FILE.gguf"),
    );
    let dir = tempfile::tempdir().unwrap();
    for q in [
        None,
        Some(Quant::Q8),
        Some(Quant::Q8_2f),
        Some(Quant::Q4),
        Some(Quant::F16),
        Some(Quant::Bf16),
    ] {
        let out = dir.path().join("m.cmf");
        let r = import_gguf::import(
            &path,
            &out,
            &Options {
                quant: q,
                measure_error: true,
                ..Default::default()
            },
        )
        .unwrap();
        let mats: Vec<_> = r
            .tensors
            .iter()
            .filter(|(_, d, _)| *d != cmf_format::Dtype::F32)
            .collect();
        let mut total = cmf_convert::TensorStats::default();
        mats.iter().for_each(|(_, _, s)| total.add(*s));
        let worst = mats
            .iter()
            .max_by(|a, b| a.2.relative_rms().total_cmp(&b.2.relative_rms()))
            .unwrap();
        println!(
            "{:<8} file {:>6.1} MB  matrices rel-RMS {:.5}  worst {:.5} ({})",
            q.map(|q| q.name()).unwrap_or("default"),
            std::fs::metadata(&out).unwrap().len() as f64 / 1e6,
            total.relative_rms(),
            worst.2.relative_rms(),
            worst.0
        );
    }
}
