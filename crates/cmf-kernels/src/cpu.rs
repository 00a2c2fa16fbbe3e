//! Run-time instruction-set selection.
//!
//! Three code paths exist for every fast kernel:
//! - `Avx512`: AVX-512 F/BW/VL/DQ + VNNI (`vpdpbusd`) + F16C/FMA. AVX512-BF16 is reported separately
//!   (`has_avx512_bf16`) because only the optional bf16-dot kernels need it.
//! - `Avx2`: AVX2 + FMA + F16C (Haswell and later, Zen 1 and later).
//! - `Portable`: plain Rust, correct on every target (and what aarch64 runs today).
//!
//! The best path the CPU supports is chosen once. `CMF_CPU_ISA=portable|avx2|avx512` forces a lower
//! path for diagnostics and A/B timing; a request above what the CPU supports is clamped down (with a
//! one-line warning on stderr) because executing unsupported instructions would crash the process.
//! Tests and benchmarks reach every path through the `*_with(isa, …)` entry points instead.

use std::sync::OnceLock;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    Portable,
    Avx2,
    Avx512,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    pub fn from_name(s: &str) -> Option<Isa> {
        match s.trim().to_ascii_lowercase().as_str() {
            "portable" | "scalar" => Some(Isa::Portable),
            "avx2" => Some(Isa::Avx2),
            "avx512" | "avx-512" => Some(Isa::Avx512),
            _ => None,
        }
    }

    /// Whether this CPU can execute the path.
    pub fn supported(self) -> bool {
        self <= best_supported()
    }

    /// Every path this CPU can execute, lowest first (what the parity tests iterate over).
    pub fn all_supported() -> Vec<Isa> {
        [Isa::Portable, Isa::Avx2, Isa::Avx512]
            .into_iter()
            .filter(|i| i.supported())
            .collect()
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The best path this CPU supports, ignoring `CMF_CPU_ISA`.
pub fn best_supported() -> Isa {
    static BEST: OnceLock<Isa> = OnceLock::new();
    *BEST.get_or_init(detect)
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Isa {
    use std::arch::is_x86_feature_detected as has;
    let avx2 = has!("avx2") && has!("fma") && has!("f16c");
    let avx512 = avx2
        && has!("avx512f")
        && has!("avx512bw")
        && has!("avx512vl")
        && has!("avx512dq")
        && has!("avx512vnni");
    if avx512 {
        Isa::Avx512
    } else if avx2 {
        Isa::Avx2
    } else {
        Isa::Portable
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> Isa {
    Isa::Portable
}

/// Whether the optional AVX512-BF16 instructions (`vdpbf16ps`) are present.
pub fn has_avx512_bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        best_supported() == Isa::Avx512 && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The path the public kernels use: the best supported one, lowered by `CMF_CPU_ISA` if set.
pub fn active() -> Isa {
    static ACTIVE: OnceLock<Isa> = OnceLock::new();
    *ACTIVE.get_or_init(|| {
        let best = best_supported();
        match std::env::var("CMF_CPU_ISA") {
            Err(_) => best,
            Ok(v) => match Isa::from_name(&v) {
                Some(want) if want <= best => want,
                Some(want) => {
                    eprintln!("cmf: CMF_CPU_ISA={want} is not supported by this CPU; using {best}");
                    best
                }
                None => {
                    eprintln!(
                        "cmf: CMF_CPU_ISA={v:?} is not one of portable, avx2, avx512; using {best}"
                    );
                    best
                }
            },
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_order() {
        for i in [Isa::Portable, Isa::Avx2, Isa::Avx512] {
            assert_eq!(Isa::from_name(i.name()), Some(i));
        }
        assert!(Isa::Portable < Isa::Avx2 && Isa::Avx2 < Isa::Avx512);
        assert!(Isa::Portable.supported());
        assert!(active() <= best_supported());
    }
}
