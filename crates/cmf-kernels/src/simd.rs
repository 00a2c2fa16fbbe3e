//! Compiling one plain-Rust body once per instruction set.
//!
//! Row ops and the attention inner loops are written as ordinary Rust loops over slices with
//! independent accumulators; compiled inside a `#[target_feature]` function, LLVM vectorizes them
//! with that ISA's registers (512-bit under AVX-512). `multiversion!` generates, from one
//! `#[inline(always)]` body, a dispatching `pub fn name_with(isa, …)` and `pub fn name(…)`
//! (which uses [`crate::cpu::active`]).
//!
//! Bodies are generic over [`Fma`]: `f32::mul_add` is one instruction where FMA exists but a libm
//! call per element where it does not (x86-64 baseline), so the portable instance uses `a*b + c`.

/// How a body spells a·b + c, and what else the instance may assume.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) trait Fma {
    /// The instance is compiled for x86-64 AVX2 or AVX-512 (so F16C and FMA exist).
    const X86_SIMD: bool = false;
    /// The instance is compiled for AVX-512.
    const AVX512: bool = false;
    fn fma(a: f32, b: f32, c: f32) -> f32;
}

/// One fused multiply-add (aarch64's portable path).
#[allow(dead_code)]
pub(crate) struct Fused;
impl Fma for Fused {
    #[inline(always)]
    fn fma(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
}

/// One fused multiply-add, inside an AVX2 instance.
#[allow(dead_code)]
pub(crate) struct FusedAvx2;
impl Fma for FusedAvx2 {
    const X86_SIMD: bool = true;
    #[inline(always)]
    fn fma(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
}

/// One fused multiply-add, inside an AVX-512 instance.
#[allow(dead_code)]
pub(crate) struct FusedAvx512;
impl Fma for FusedAvx512 {
    const X86_SIMD: bool = true;
    const AVX512: bool = true;
    #[inline(always)]
    fn fma(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
}

/// A multiply then an add (the x86-64 portable path, which cannot assume FMA).
#[allow(dead_code)]
pub(crate) struct Unfused;
impl Fma for Unfused {
    #[inline(always)]
    fn fma(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
}

#[cfg(target_arch = "aarch64")]
pub(crate) type PortableFma = Fused;
#[cfg(not(target_arch = "aarch64"))]
pub(crate) type PortableFma = Unfused;

/// `multiversion!(/// docs
///     pub fn name / name_with = body(a: &[f32], b: usize) -> f32);`
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident / $with:ident = $body:ident ; ($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)?) => {
        $(#[$meta])*
        #[allow(clippy::too_many_arguments, dead_code)]
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            $with($crate::cpu::active(), $($arg),*)
        }

        #[doc(hidden)]
        #[allow(clippy::too_many_arguments)]
        /// The same on a given path (tests and benchmarks); `isa` must be supported by this CPU.
        $vis fn $with(isa: $crate::cpu::Isa, $($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx2")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn v512($($arg: $ty),*) $(-> $ret)? { $body::<$crate::simd::FusedAvx512>($($arg),*) }
                #[target_feature(enable = "avx2,fma,f16c")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn v256($($arg: $ty),*) $(-> $ret)? { $body::<$crate::simd::FusedAvx2>($($arg),*) }
                assert!(isa.supported(), "{isa} is not supported by this CPU");
                match isa {
                    // SAFETY: the CPU supports the features (asserted above).
                    $crate::cpu::Isa::Avx512 => return unsafe { v512($($arg),*) },
                    $crate::cpu::Isa::Avx2 => return unsafe { v256($($arg),*) },
                    $crate::cpu::Isa::Portable => {}
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            let _ = isa;
            $body::<$crate::simd::PortableFma>($($arg),*)
        }
    };
}

pub(crate) use multiversion;
