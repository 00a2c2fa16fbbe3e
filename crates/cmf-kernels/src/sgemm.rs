//! f32 register-tiled product C[m × n] (+)= A[m × k] · B[k × n], all row-major, n a multiple of
//! 32 (callers pad B and C). The float-weight matmul (B = a packed Wᵀ panel) and both products of
//! the flash attention (Q·Kᵀ and P·V) run on it.
//!
//! Micro-kernels: AVX-512 8 rows × 32 columns (16 accumulators; per k two B loads, eight A
//! broadcasts, sixteen FMAs), AVX2 6 × 16, portable 4 × 32 in plain Rust.

use crate::cpu::Isa;

/// Columns per micro-tile; n must be a multiple of this.
pub(crate) const NR: usize = 32;

/// # Safety
/// a: m rows of ≥ k floats at stride lda; b: k rows of ≥ n floats at stride ldb; c: m rows of
/// ≥ n floats at stride ldc; n % 32 == 0; `isa` supported by the CPU.
#[allow(clippy::too_many_arguments)]
#[inline]
pub(crate) unsafe fn sgemm(
    isa: Isa,
    m: usize,
    n: usize,
    k: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    debug_assert!(n.is_multiple_of(NR));
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => avx512::sgemm(m, n, k, a, lda, b, ldb, c, ldc, accumulate),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => avx2::sgemm(m, n, k, a, lda, b, ldb, c, ldc, accumulate),
        _ => portable::sgemm(m, n, k, a, lda, b, ldb, c, ldc, accumulate),
    }
}

/// Dispatches row blocks of `MR` (and a smaller tail) to a micro-kernel `$mk::<MR>`.
macro_rules! row_blocks {
    ($mk:ident, $mr:expr, $m:expr, $n:expr, $k:expr, $a:expr, $lda:expr, $b:expr, $ldb:expr, $c:expr, $ldc:expr, $acc:expr) => {{
        let mut i = 0;
        while i < $m {
            let rows = ($m - i).min($mr);
            for j in (0..$n).step_by(32) {
                let (a, b, c) = ($a.add(i * $lda), $b.add(j), $c.add(i * $ldc + j));
                match rows {
                    r if r == $mr => $mk::<{ $mr }>($k, a, $lda, b, $ldb, c, $ldc, $acc),
                    1 => $mk::<1>($k, a, $lda, b, $ldb, c, $ldc, $acc),
                    2 => $mk::<2>($k, a, $lda, b, $ldb, c, $ldc, $acc),
                    3 => $mk::<3>($k, a, $lda, b, $ldb, c, $ldc, $acc),
                    4 => $mk::<4>($k, a, $lda, b, $ldb, c, $ldc, $acc),
                    5 => $mk::<5>($k, a, $lda, b, $ldb, c, $ldc, $acc),
                    6 => $mk::<6>($k, a, $lda, b, $ldb, c, $ldc, $acc),
                    _ => $mk::<7>($k, a, $lda, b, $ldb, c, $ldc, $acc),
                }
            }
            i += rows;
        }
    }};
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn mk<const MR: usize>(
        k: usize,
        a: *const f32,
        lda: usize,
        b: *const f32,
        ldb: usize,
        c: *mut f32,
        ldc: usize,
        acc: bool,
    ) {
        let mut c0 = [_mm512_setzero_ps(); MR];
        let mut c1 = [_mm512_setzero_ps(); MR];
        if acc {
            for r in 0..MR {
                c0[r] = _mm512_loadu_ps(c.add(r * ldc));
                c1[r] = _mm512_loadu_ps(c.add(r * ldc + 16));
            }
        }
        for kk in 0..k {
            let b0 = _mm512_loadu_ps(b.add(kk * ldb));
            let b1 = _mm512_loadu_ps(b.add(kk * ldb + 16));
            for r in 0..MR {
                let av = _mm512_set1_ps(*a.add(r * lda + kk));
                c0[r] = _mm512_fmadd_ps(av, b0, c0[r]);
                c1[r] = _mm512_fmadd_ps(av, b1, c1[r]);
            }
        }
        for r in 0..MR {
            _mm512_storeu_ps(c.add(r * ldc), c0[r]);
            _mm512_storeu_ps(c.add(r * ldc + 16), c1[r]);
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx2")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn sgemm(
        m: usize,
        n: usize,
        k: usize,
        a: *const f32,
        lda: usize,
        b: *const f32,
        ldb: usize,
        c: *mut f32,
        ldc: usize,
        acc: bool,
    ) {
        row_blocks!(mk, 8, m, n, k, a, lda, b, ldb, c, ldc, acc)
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// MR rows × 32 columns as two 16-column halves (6 × 16 uses 12 of the 16 ymm registers).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn mk16<const MR: usize>(
        k: usize,
        a: *const f32,
        lda: usize,
        b: *const f32,
        ldb: usize,
        c: *mut f32,
        ldc: usize,
        acc: bool,
    ) {
        let mut c0 = [_mm256_setzero_ps(); MR];
        let mut c1 = [_mm256_setzero_ps(); MR];
        if acc {
            for r in 0..MR {
                c0[r] = _mm256_loadu_ps(c.add(r * ldc));
                c1[r] = _mm256_loadu_ps(c.add(r * ldc + 8));
            }
        }
        for kk in 0..k {
            let b0 = _mm256_loadu_ps(b.add(kk * ldb));
            let b1 = _mm256_loadu_ps(b.add(kk * ldb + 8));
            for r in 0..MR {
                let av = _mm256_broadcast_ss(&*a.add(r * lda + kk));
                c0[r] = _mm256_fmadd_ps(av, b0, c0[r]);
                c1[r] = _mm256_fmadd_ps(av, b1, c1[r]);
            }
        }
        for r in 0..MR {
            _mm256_storeu_ps(c.add(r * ldc), c0[r]);
            _mm256_storeu_ps(c.add(r * ldc + 8), c1[r]);
        }
    }

    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn mk<const MR: usize>(
        k: usize,
        a: *const f32,
        lda: usize,
        b: *const f32,
        ldb: usize,
        c: *mut f32,
        ldc: usize,
        acc: bool,
    ) {
        mk16::<MR>(k, a, lda, b, ldb, c, ldc, acc);
        mk16::<MR>(k, a, lda, b.add(16), ldb, c.add(16), ldc, acc);
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn sgemm(
        m: usize,
        n: usize,
        k: usize,
        a: *const f32,
        lda: usize,
        b: *const f32,
        ldb: usize,
        c: *mut f32,
        ldc: usize,
        acc: bool,
    ) {
        row_blocks!(mk, 6, m, n, k, a, lda, b, ldb, c, ldc, acc)
    }
}

mod portable {
    use crate::simd::{Fma, PortableFma};

    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn mk<const MR: usize>(
        k: usize,
        a: *const f32,
        lda: usize,
        b: *const f32,
        ldb: usize,
        c: *mut f32,
        ldc: usize,
        acc: bool,
    ) {
        let mut t = [[0f32; 32]; MR];
        if acc {
            for (r, row) in t.iter_mut().enumerate() {
                *row = std::ptr::read_unaligned(c.add(r * ldc) as *const [f32; 32]);
            }
        }
        for kk in 0..k {
            let bv = std::ptr::read_unaligned(b.add(kk * ldb) as *const [f32; 32]);
            for (r, row) in t.iter_mut().enumerate() {
                let av = *a.add(r * lda + kk);
                for l in 0..32 {
                    row[l] = PortableFma::fma(av, bv[l], row[l]);
                }
            }
        }
        for (r, row) in t.iter().enumerate() {
            std::ptr::write_unaligned(c.add(r * ldc) as *mut [f32; 32], *row);
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn sgemm(
        m: usize,
        n: usize,
        k: usize,
        a: *const f32,
        lda: usize,
        b: *const f32,
        ldb: usize,
        c: *mut f32,
        ldc: usize,
        acc: bool,
    ) {
        row_blocks!(mk, 4, m, n, k, a, lda, b, ldb, c, ldc, acc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_naive_product_for_every_shape_and_path() {
        for isa in Isa::all_supported() {
            for (m, n, k) in [
                (1, 32, 1),
                (3, 64, 17),
                (8, 32, 64),
                (13, 96, 40),
                (6, 32, 5),
            ] {
                let (lda, ldb, ldc) = (k + 3, n + 32, n + 1);
                let a: Vec<f32> = (0..m * lda)
                    .map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.25)
                    .collect();
                let b: Vec<f32> = (0..k * ldb)
                    .map(|i| ((i * 5 % 11) as f32 - 5.0) * 0.5)
                    .collect();
                for acc in [false, true] {
                    let mut c: Vec<f32> = (0..m * ldc).map(|i| (i % 3) as f32).collect();
                    let c0 = c.clone();
                    unsafe {
                        sgemm(
                            isa,
                            m,
                            n,
                            k,
                            a.as_ptr(),
                            lda,
                            b.as_ptr(),
                            ldb,
                            c.as_mut_ptr(),
                            ldc,
                            acc,
                        )
                    };
                    for i in 0..m {
                        for j in 0..n {
                            let mut want: f32 =
                                (0..k).map(|p| a[i * lda + p] * b[p * ldb + j]).sum();
                            if acc {
                                want += c0[i * ldc + j];
                            }
                            // Small integers and quarters: every partial sum is exact in f32.
                            assert_eq!(
                                c[i * ldc + j],
                                want,
                                "{isa} m={m} n={n} k={k} acc={acc} [{i},{j}]"
                            );
                        }
                        // Past column n the row is untouched.
                        assert_eq!(c[i * ldc + n], c0[i * ldc + n]);
                    }
                }
            }
        }
    }
}
