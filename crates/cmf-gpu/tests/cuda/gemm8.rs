//! The 8-bit GEMMs (FP8 and int8, cuBLASLt with per-row scales) against exact products of the
//! very bytes and scales the device made.

use super::*;

/// FP8 groundwork (cuda/fp8.rs): e4m3 row quantisation, and the cuBLASLt FP8 GEMM with per-row
/// scales on both operands against an f64 product of the very bytes and scales the device made.
/// Tolerances: the quantised rows are within e4m3's rounding of the input (3 mantissa bits:
/// ≤ 2⁻⁴ relative per value, ~2.5 % RMS: bound 4e-2); the GEMM differs from the exact product
/// of its inputs only by f32 accumulation order and the bf16 output (2⁻⁹): bound 5e-3 (1e-2
/// with fast accumulation).
#[test]
fn fp8_gemm_matches_reference_on_its_quantised_inputs() {
    let Some(b) = backend() else { return };
    let dev = b.device();
    if dev.cc < (8, 9) {
        gpu_skip::skip_unsupported(format!("FP8 needs compute capability 8.9+ ({:?})", dev.cc));
        return;
    }
    let fp8 = cmf_gpu::cuda::runtime::fp8::Fp8Gemm::new(dev).unwrap();
    let (m, n, k) = (77usize, 96usize, 256usize);
    let mut rng = Rng::new(5);
    let rows = |rng: &mut Rng, r: usize| -> Vec<f32> {
        (0..r * k)
            .map(|i| rng.uniform() * 2f32.powi((i / k % 5) as i32 - 2))
            .collect()
    };
    let (x, w) = (rows(&mut rng, m), rows(&mut rng, n));
    let to_bf16 = |v: &[f32]| -> Vec<u16> {
        v.iter()
            .map(|&a| half::bf16::from_f32(a).to_bits())
            .collect()
    };
    let (xb, wb) = (to_bf16(&x), to_bf16(&w));
    let up = |v: &[u16]| {
        dev.upload_new(cmf_gpu::cuda::runtime::device::bytes_of(v))
            .unwrap()
    };
    let (dx, dw) = (up(&xb), up(&wb));
    let (qx, sx, qw, sw) = (
        dev.alloc(m * k).unwrap(),
        dev.alloc(4 * m).unwrap(),
        dev.alloc(n * k).unwrap(),
        dev.alloc(4 * n).unwrap(),
    );
    fp8.quantize(dx.ptr(), m, k, k, qx.ptr(), sx.ptr()).unwrap();
    fp8.quantize(dw.ptr(), n, k, k, qw.ptr(), sw.ptr()).unwrap();
    let down = |p: u64, bytes: usize| {
        let mut v = vec![0u8; bytes];
        dev.download(&mut v, p).unwrap();
        v
    };
    let f32s = |v: Vec<u8>| -> Vec<f32> {
        v.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    let (hqx, hsx, hqw, hsw) = (
        down(qx.ptr(), m * k),
        f32s(down(sx.ptr(), 4 * m)),
        down(qw.ptr(), n * k),
        f32s(down(sw.ptr(), 4 * n)),
    );
    let dec = |q: &[u8], s: &[f32]| -> Vec<f32> {
        q.iter()
            .enumerate()
            .map(|(i, &b)| cmf_gpu::cuda::runtime::fp8::e4m3_to_f32(b) * s[i / k])
            .collect()
    };
    let xr: Vec<f32> = xb
        .iter()
        .map(|&h| half::bf16::from_bits(h).to_f32())
        .collect();
    let qerr = rel_err(&dec(&hqx, &hsx), &xr);
    eprintln!("e4m3 row quantisation: rel err {qerr:.2e}");
    assert!(qerr < 4e-2, "quantisation rel err {qerr}");
    let mut want = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let dot: f64 = (0..k)
                .map(|t| {
                    cmf_gpu::cuda::runtime::fp8::e4m3_to_f32(hqx[i * k + t]) as f64
                        * cmf_gpu::cuda::runtime::fp8::e4m3_to_f32(hqw[j * k + t]) as f64
                })
                .sum();
            want[i * n + j] = (dot * hsx[i] as f64 * hsw[j] as f64) as f32;
        }
    }
    let out = dev.alloc(m * n * 4).unwrap();
    use cmf_gpu::cuda::runtime::fp8::Fp8Out;
    // (fast accumulation, f32 output, bound): the f32 output has no output rounding.
    for (fast, f32_out, tol) in [
        (false, false, 5e-3),
        (true, false, 1e-2),
        (false, true, 1e-3),
    ] {
        let to = if f32_out {
            Fp8Out::F32(out.ptr())
        } else {
            Fp8Out::Bf16(out.ptr())
        };
        fp8.gemm(
            qw.ptr(),
            sw.ptr(),
            qx.ptr(),
            sx.ptr(),
            to,
            (n, m, k),
            n,
            fast,
        )
        .unwrap();
        let got: Vec<f32> = if f32_out {
            f32s(down(out.ptr(), m * n * 4))
        } else {
            dev.download_bf16(out.ptr(), m * n).unwrap()
        };
        let err = rel_err(&got, &want);
        eprintln!("fp8 GEMM (fast accumulation {fast}, f32 out {f32_out}): rel err {err:.2e} against its inputs' exact product");
        assert!(err < tol, "fast {fast} f32 {f32_out}: rel err {err}");
    }
}

/// The int8 path's GEMM (cuda/int8.rs): s8 row quantisation against its contract, and the s8
/// GEMM (exact s32 sums, scaled to bf16) against an exact integer product of the very bytes and
/// scales the device made. Tolerances: each row's scale within 1e-6 relative of amax / 127 (f32
/// division), each value's q · scale within half a step of the bf16 input (round to nearest) plus
/// 1e-6 of the row's amax for the f32 reciprocal; each output value within one bf16 rounding
/// (2⁻⁸ relative) plus 1e-6 for the f32 scaling, since the sums themselves are exact.
#[test]
fn int8_gemm_matches_exact_product_of_its_quantised_inputs() {
    let Some(b) = backend() else { return };
    let dev = b.device();
    let g = match cmf_gpu::cuda::runtime::int8::Int8Gemm::new(dev) {
        Ok(g) => g,
        Err(e) if dev.cc < (8, 0) => {
            gpu_skip::skip_unsupported(&e.0);
            return;
        }
        Err(e) => panic!("int8 GEMM unavailable on {:?}: {}", dev.cc, e.0),
    };
    // m as the DiT pads rows (a multiple of 32); widths multiples of 16 (`q8_fits`).
    let (m, n, k) = (96usize, 112usize, 320usize);
    let mut rng = Rng::new(8);
    let rows = |rng: &mut Rng, r: usize| -> Vec<u16> {
        let mut v: Vec<f32> = (0..r * k)
            .map(|i| rng.uniform() * 2f32.powi((i / k % 5) as i32 - 2))
            .collect();
        v[..k].fill(0.0); // a row of zeros: scale 1
        for row in 1..r {
            v[row * k + row * 7 % k] *= 20.0; // one outlier sets each row's amax
        }
        v.iter()
            .map(|&a| half::bf16::from_f32(a).to_bits())
            .collect()
    };
    let (xb, wb) = (rows(&mut rng, m), rows(&mut rng, n));
    let up = |v: &[u16]| {
        dev.upload_new(cmf_gpu::cuda::runtime::device::bytes_of(v))
            .unwrap()
    };
    let (dx, dw) = (up(&xb), up(&wb));
    let (qx, sx, qw, sw) = (
        dev.alloc(m * k).unwrap(),
        dev.alloc(4 * m).unwrap(),
        dev.alloc(n * k).unwrap(),
        dev.alloc(4 * n).unwrap(),
    );
    g.quantize(dx.ptr(), m, k, k, qx.ptr(), sx.ptr()).unwrap();
    g.quantize(dw.ptr(), n, k, k, qw.ptr(), sw.ptr()).unwrap();
    let down = |p: u64, bytes: usize| {
        let mut v = vec![0u8; bytes];
        dev.download(&mut v, p).unwrap();
        v
    };
    let scales = |p: u64, r: usize| {
        let mut s = vec![0f32; r];
        dev.download_f32(&mut s, p).unwrap();
        s
    };
    let (hqx, hsx) = (down(qx.ptr(), m * k), scales(sx.ptr(), m));
    let (hqw, hsw) = (down(qw.ptr(), n * k), scales(sw.ptr(), n));
    for (what, src, q, s) in [("x", &xb, &hqx, &hsx), ("w", &wb, &hqw, &hsw)] {
        for (r, row) in src.chunks(k).enumerate() {
            let vals: Vec<f64> = row
                .iter()
                .map(|&h| half::bf16::from_bits(h).to_f64())
                .collect();
            let amax = vals.iter().fold(0f64, |a, v| a.max(v.abs()));
            let want_s = if amax > 0.0 { amax / 127.0 } else { 1.0 };
            let got_s = s[r] as f64;
            assert!(
                (got_s - want_s).abs() <= 1e-6 * want_s,
                "{what} row {r}: scale {got_s}, want {want_s}"
            );
            for (i, &v) in vals.iter().enumerate() {
                let qv = q[r * k + i] as i8;
                assert!(qv != -128, "{what}[{r}, {i}]: byte -128 is outside ±127");
                let err = (qv as f64 * got_s - v).abs();
                assert!(
                    err <= 0.5 * got_s + 1e-6 * amax,
                    "{what}[{r}, {i}] = {qv}·{got_s}, want {v}"
                );
            }
        }
    }
    let out = dev.alloc(m * n * 2).unwrap();
    let acc = dev.alloc(m * n * 4).unwrap();
    g.gemm(
        (qw.ptr(), sw.ptr()),
        (qx.ptr(), sx.ptr()),
        acc.ptr(),
        out.ptr(),
        (n, m, k),
        n,
    )
    .unwrap();
    let got = dev.download_bf16(out.ptr(), m * n).unwrap();
    let mut worst = 0f64;
    for i in 0..m {
        for j in 0..n {
            let dot: i64 = (0..k)
                .map(|t| hqx[i * k + t] as i8 as i64 * hqw[j * k + t] as i8 as i64)
                .sum();
            let want = dot as f64 * hsx[i] as f64 * hsw[j] as f64;
            let g = got[i * n + j] as f64;
            let tol = want.abs() * (2f64.powi(-8) + 1e-6) + 1e-30;
            assert!(
                (g - want).abs() <= tol,
                "out[{i}, {j}] = {g}, want {want} (sum {dot})"
            );
            worst = worst.max((g - want).abs() / tol);
        }
    }
    eprintln!("int8 GEMM: worst value at {worst:.2} of its bound");
}
