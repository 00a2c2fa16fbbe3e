//! Every kernel module the backend compiles, by name, wherever its source lives (the runtime's
//! shared sources and each model's own): what the embedded images (`runtime/prebuilt.rs`,
//! `cmf-prebuild-kernels`) and the compile check look sources up in.

use super::dit::kernels::{ATTENTION_WG, DIT, WS_KEYS};
use super::llm::gdn::GDN;
use super::llm::kernels::{ATTENTION_DECODE, ATTENTION_PAGED, GEMM_Q8, SAMPLE};
use super::llm::moe::MOE;
use super::runtime::kernels::{ATTENTION, FP8, INT8, ROWOPS};
use super::runtime::matvec::{MatvecConfig, MATVEC};
use super::vae::kernels::VAE;

/// A module's source by its name (the names `Job`s and `Module::load` use).
pub fn source_of(name: &str) -> Option<&'static str> {
    Some(match name {
        "matvec" => MATVEC,
        "rowops" => ROWOPS,
        "attention" => ATTENTION,
        "attention_decode" => ATTENTION_DECODE,
        "attention_paged" => ATTENTION_PAGED,
        "gemm_q8" => GEMM_Q8,
        "attention_wg" => ATTENTION_WG,
        "sample" => SAMPLE,
        "dit" => DIT,
        "vae" => VAE,
        "fp8" => FP8,
        "int8" => INT8,
        "moe" => MOE,
        "gdn" => GDN,
        _ => return None,
    })
}

/// Every source with the defines it is compiled with, for the compile check that needs no GPU.
/// (name, source, defines)
pub type SourceSet = Vec<(&'static str, &'static str, Vec<(&'static str, String)>)>;

pub fn all_sources() -> SourceSet {
    let model = |hd: usize, g: usize, f32kv: bool| {
        vec![
            ("HD", hd.to_string()),
            ("GQA", g.to_string()),
            ("KV_F32", (f32kv as u8).to_string()),
        ]
    };
    // `defs` and one more define.
    let plus = |mut defs: Vec<(&'static str, String)>, name: &'static str| {
        defs.push((name, "1".to_string()));
        defs
    };
    vec![
        ("matvec", MATVEC, MatvecConfig::DEFAULT.defines()),
        ("matvec", MATVEC, MatvecConfig::SMALL.defines()),
        ("sample", SAMPLE, vec![]),
        ("rowops", ROWOPS, model(128, 4, false)),
        ("rowops", ROWOPS, model(64, 2, true)),
        ("attention", ATTENTION, model(128, 4, false)),
        ("attention_decode", ATTENTION_DECODE, model(128, 4, false)),
        (
            "attention_decode",
            ATTENTION_DECODE,
            plus(model(128, 2, false), "DEC_EARLY_WAIT"),
        ),
        ("attention", ATTENTION, model(128, 2, true)),
        ("attention_decode", ATTENTION_DECODE, model(128, 2, true)),
        ("attention", ATTENTION, model(64, 1, false)),
        ("attention_decode", ATTENTION_DECODE, model(64, 1, false)),
        ("attention", ATTENTION, model(256, 8, false)),
        ("attention_decode", ATTENTION_DECODE, model(256, 8, false)),
        ("attention", ATTENTION, model(16, 2, true)),
        ("attention_decode", ATTENTION_DECODE, model(16, 2, true)),
        ("attention", ATTENTION, model(16, 2, false)),
        ("attention_decode", ATTENTION_DECODE, model(16, 2, false)),
        ("rowops", ROWOPS, model(16, 2, true)),
        ("attention_paged", ATTENTION_PAGED, model(128, 4, false)),
        ("attention_paged", ATTENTION_PAGED, model(64, 2, true)),
        ("attention_paged", ATTENTION_PAGED, model(16, 2, true)),
        ("attention_paged", ATTENTION_PAGED, model(256, 8, false)),
        ("gemm_q8", GEMM_Q8, vec![]),
        ("dit", DIT, model(128, 1, false)),
        ("dit", DIT, model(32, 1, false)),
        ("dit", DIT, plus(model(128, 1, false), "X_BF16")),
        (
            "dit",
            DIT,
            plus(plus(model(128, 1, false), "X_BF16"), "ROW8_S8"),
        ),
        (
            "attention",
            ATTENTION,
            plus(model(32, 1, false), "DIT_FULL"),
        ),
        (
            "attention",
            ATTENTION,
            plus(model(128, 1, false), "DIT_FULL"),
        ),
        ("rowops", ROWOPS, vec![]),
        ("vae", VAE, vec![]),
        ("fp8", FP8, vec![]),
        ("int8", INT8, vec![]),
        ("moe", MOE, MatvecConfig::DEFAULT.defines()),
        ("gdn", GDN, vec![]),
    ]
}

/// Sources built only for Hopper's arch-specific target (`sm_90a`: wgmma), same shape as
/// [`all_sources`]. attention_wg is built with the K/V tile size the engine runs ([`WS_KEYS`]).
pub fn hopper_sources() -> SourceSet {
    let wg = |keys: usize| {
        (
            "attention_wg",
            ATTENTION_WG,
            vec![
                ("HD", "128".to_string()),
                ("GQA", "1".to_string()),
                ("KV_F32", "0".to_string()),
                ("WS_KEYS", keys.to_string()),
            ],
        )
    };
    vec![wg(WS_KEYS)]
}

#[cfg(test)]
mod tests {
    use cmf_test_support::gpu as gpu_skip;

    /// Compiles every kernel source for sm_90 with NVRTC. Needs libnvrtc, not a GPU.
    #[test]
    fn nvrtc_compiles_every_kernel() {
        if !crate::cuda::runtime::nvrtc::available() {
            gpu_skip::skip_no_device("libnvrtc not found");
            return;
        }
        let portable = super::all_sources().into_iter().map(|s| (s, "sm_90"));
        let hopper = super::hopper_sources().into_iter().map(|s| (s, "sm_90a"));
        for ((name, src, defs), arch) in portable.chain(hopper) {
            let full = crate::cuda::runtime::kernels::full_source(src);
            let c = crate::cuda::runtime::nvrtc::compile(name, &full, arch, &defs)
                .unwrap_or_else(|e| panic!("{e}"));
            assert!(!c.cubin.is_empty());
            if !c.log.is_empty() {
                eprintln!("{name} {defs:?} ({arch}):\n{}", c.log);
            }
        }
    }
}
