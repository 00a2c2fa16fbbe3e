//! What NVRTC compiles for a module, and the identity of that compile: the full source (the
//! common helpers, then the module's source), the compiler options for a target and defines,
//! and the hash the disk cache and the embedded images key on.

/// Helpers every module starts with ([`full_source`]).
pub const COMMON: &str = include_str!("kernels/common.cuh");

/// The source NVRTC sees: the common helpers, then the op family.
pub fn full_source(src: &str) -> String {
    format!("{COMMON}\n{src}")
}

/// NVRTC's options for a target and defines (also what the embedded images' keys cover).
pub(crate) fn options(arch: &str, defines: &[(&str, String)]) -> Vec<String> {
    let mut opts: Vec<String> = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        "-default-device".into(),
    ];
    opts.extend(defines.iter().map(|(k, v)| format!("-D{k}={v}")));
    opts
}

/// FNV-1a 64 over several byte strings (with separators, so ("ab","c") ≠ ("a","bc")).
pub(crate) fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in p.iter().chain([0xffu8].iter()) {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}
