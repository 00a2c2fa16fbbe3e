//! The full CMF path (header → config, tensors in place from the mmap, every codec) against
//! transformers on the tiny fixtures. Each fixture is converted to a temporary CMF file by the
//! converter (`cmf_convert::hf::convert`, what `cmf convert --quant …` runs), opened with
//! `CmfModel::open` and loaded with `Model::load`. The converter writes q4 as q4_tiled; the
//! q4_block layout (same values) is written by the test helper `common::write_cmf`.
//!
//! Bounds (per-row max |Δ| / max |logit|, worst over 48 prompt positions and 24 decode steps,
//! all four fixtures). Measured worst values (2026-11-29, AVX-512 kernels) → bound set:
//! - f32: 1.3e-6 → 1e-4, and the 24 greedy ids identical (the README's tolerance).
//! - f16: 1.6e-3 → 4e-3; bf16: 1.0e-2 → 2.5e-2 (rounding of the weights: 2⁻¹¹ and 2⁻⁸ relative).
//! - q8_row: 8.4e-2 → 0.2; q8_2f: 6.8e-2 → 0.2.
//! - q4_block / q4_tiled (same values, different layout): 0.90 → 2.0.
//!
//! MoE fixtures (measured 2026-12-07): f32 9.7e-7, f16 1.5e-3 keep the dense bounds; bf16 0.17,
//! q8_row 0.27, q8_2f 0.21 → 0.4; q4 0.74 → 2.0. The wider lossy bounds are routing, not
//! arithmetic: the fixtures' routers have top-k margins down to 3e-4 (any margin ≥ 1e-4 keeps
//! f32 exact), and a weight codec's error moves some tokens across such a near-tie, which swaps
//! one of their experts. f32 still has to pick every expert transformers picks.
//!
//! These random tiny models (hidden 64, weights N(0, 1/in), no trained structure) magnify weight
//! error: with the same codecs applied to the weights only and the product computed in f32
//! (activations not quantized), q8_row gives 5.9e-2 and q4_block 0.90 — so nearly all of the
//! error is the weight codec's, not the kernels' int8 activations. Greedy agreement of the
//! lossy codecs is reported, not required (bf16 keeps 3 to 24 of 24 ids, q8 3 to 24, q4 0 to 2);
//! on a trained model see the SmolLM2 numbers in docs/llm.md. Identical greedy ids are required
//! for f32 only.

mod common;
use cmf_convert::{Options, Quant};
use cmf_format::{CmfModel, Dtype};
use cmf_llm::Model;
use common::*;

/// How a test file is made.
#[derive(Clone, Copy, Debug)]
enum Make {
    Convert(Quant),
    Helper(Dtype),
}

/// (file, logits bound, MoE logits bound, greedy ids that must agree before the first
/// difference).
const BOUNDS: [(Make, f32, f32, usize); 7] = [
    (Make::Convert(Quant::F32), 1e-4, 1e-4, 24),
    (Make::Convert(Quant::F16), 4e-3, 4e-3, 0),
    (Make::Convert(Quant::Bf16), 2.5e-2, 0.4, 0),
    (Make::Convert(Quant::Q8), 0.2, 0.4, 0),
    (Make::Convert(Quant::Q8_2f), 0.2, 0.4, 0),
    (Make::Convert(Quant::Q4), 2.0, 2.0, 0),
    (Make::Helper(Dtype::Q4Block), 2.0, 2.0, 0),
];

#[test]
fn every_codec_within_its_bound() {
    let tmp = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    for (make, dense_bound, moe_bound, agree) in BOUNDS {
        for name in FIXTURES.into_iter().chain(MOE_FIXTURES) {
            let bound = match MOE_FIXTURES.contains(&name) {
                true => moe_bound,
                false => dense_bound,
            };
            let path = tmp.path().join(format!("{name}-{make:?}.cmf"));
            match make {
                Make::Convert(q) => {
                    let opts = Options {
                        quant: Some(q),
                        ..Options::default()
                    };
                    cmf_convert::hf::convert(&fixture_dir(name), &path, &opts).unwrap();
                }
                Make::Helper(dtype) => write_cmf(name, dtype, &path),
            }
            let file = CmfModel::open(&path).unwrap();
            let model = Model::load(&file).unwrap();
            let c = compare(&model, name);
            let err = c.prompt_err.max(c.decode_err);
            let label = format!("{make:?}");
            println!(
                "{label:>20} {name:>13}: logits {err:.2e} (prompt {:.2e}, decode {:.2e}), greedy agrees for {}/24",
                c.prompt_err,
                c.decode_err,
                c.greedy_agree()
            );
            if err > bound || c.greedy_agree() < agree {
                failures.push(format!(
                    "{label} {name}: {err:.2e} > {bound:.0e} or greedy {} < {agree}",
                    c.greedy_agree()
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
