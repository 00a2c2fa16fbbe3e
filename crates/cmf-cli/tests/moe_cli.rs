//! Mixture-of-experts checkpoints through the CLI: `cmf convert` of the Qwen3-MoE and Qwen2-MoE
//! fixtures writes a header `moe` descriptor and per-expert tensors that the reference crate
//! `cortiq-core` 0.8.54 reads as it defines them (`MoeConfig`, sparse layers by router
//! presence), `cmf verify` accepts them, `cmf info` shows the experts, and `cmf run --gpu auto`
//! runs such a model like a dense one, without a note about its experts.

use std::path::{Path, PathBuf};
use std::process::Command;

fn cmf(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_cmf"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/llm")
        .join(name)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn converted_moe_files_read_in_the_reference_crate() {
    let dir = tempfile::tempdir().unwrap();
    // (fixture, codec, descriptor as cortiq-core serialises it, its MoE layers)
    let cases = [
        (
            "qwen3-moe-tiny",
            "q8",
            r#"{"num_experts":8,"top_k":2,"moe_intermediate_size":32,"norm_topk_prob":true}"#,
            vec![0, 2],
        ),
        (
            "qwen2-moe-tiny",
            "q4",
            r#"{"num_experts":8,"top_k":2,"moe_intermediate_size":32,"norm_topk_prob":false,"shared_expert_intermediate_size":48}"#,
            vec![1, 2],
        ),
    ];
    for (name, quant, descriptor, layers) in cases {
        let out = dir.path().join(format!("{name}.cmf"));
        let (code, o, e) = cmf(&[
            "convert",
            "--model",
            s(&fixture(name)),
            "--quant",
            quant,
            "-o",
            s(&out),
        ]);
        assert_eq!(code, 0, "{o}{e}");
        let (code, o, e) = cmf(&["verify", s(&out)]);
        assert_eq!(code, 0, "verify: {o}{e}");

        let oracle = cortiq_core::CmfModel::open(&out).unwrap();
        assert!(oracle.verify().is_empty(), "{:?}", oracle.verify());
        let moe = oracle.header.arch.moe.as_ref().expect("a moe descriptor");
        assert_eq!(serde_json::to_string(moe).unwrap(), descriptor, "{name}");
        assert_eq!(cortiq_core::moe_layers(&oracle.tensors), layers, "{name}");
        let experts = oracle
            .tensors
            .iter()
            .filter(|t| t.name.contains(".mlp.experts."))
            .count();
        assert_eq!(experts, layers.len() * 8 * 3, "{name}");

        let (code, info, e) = cmf(&["info", s(&out)]);
        assert_eq!(code, 0, "{e}");
        assert!(
            info.contains("moe: 8 experts, top 2, expert ffn 32"),
            "{info}"
        );
        let shared = name.starts_with("qwen2");
        assert_eq!(info.contains("shared expert ffn 48"), shared, "{info}");
    }

    // A MoE model runs wherever a dense one would (the device when one answers and it fits,
    // else the CPU), with no note about its experts.
    let model = dir.path().join("qwen3-moe-tiny.cmf");
    let (code, o, e) = cmf(&[
        "run",
        s(&model),
        "-p",
        "In the beginning",
        "-n",
        "4",
        "--gpu",
        "auto",
    ]);
    assert_eq!(code, 0, "{o}{e}");
    assert!(!o.is_empty(), "{e}");
    assert!(!e.contains("mixture-of-experts"), "{e}");
}
