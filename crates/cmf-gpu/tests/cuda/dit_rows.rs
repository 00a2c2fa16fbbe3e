//! The DiT's GEMM-feeding row kernels (cuda/dit/rows.rs, cuda/dit/kernels/dit.cu: `rms_mod`,
//! `residual_norm`, `swiglu`) against f64 CPU references on fresh random inputs, writing bf16
//! rows and fused 8-bit rows (e4m3, and s8 from the int8 path's module), at the full-size widths (D 3840, F 10240: the vector path), the
//! fixture's D (128) and an odd width (341: the scalar path); swiglu also at a width whose last
//! warp holds one thread's values (2056), in both its forms (shared-memory and register-resident,
//! where the width allows the latter). Row 0 is all zero (e4m3 scale 1);
//! rows span 2⁻² … 2² in scale, each with one outlier that sets its amax.
//!
//! Tolerances, per value: bf16 within one rounding of the reference, 2⁻⁸·|ref|, plus 2e-6·|ref|
//! and 1e-6 of the row's largest value for the f32 evaluation (rsqrtf, summation order), which
//! can move a value across a rounding midpoint. e4m3: the row scale within 1e-6 relative of
//! amax/448, and q·scale within e4m3's rounding of the reference, 2⁻⁴·|ref| (3 mantissa bits)
//! + 2⁻⁹·scale (twice the half step of the subnormals, values under 2⁻⁶·scale). s8: the row
//! scale within 1e-6 relative of amax/127, and q·scale within half a step (scale / 2) of the
//! reference plus 2e-6·|ref| + 1e-6 of amax for the f32 evaluation, no byte -128.
//!
//! residual_norm and swiglu read their GEMM's output as bf16 rows and, as on the int8 path, as
//! s32 sums with a scale per row and per column (`GemmRows::S32`); the references take the
//! values those make (sum · xs · ws, in f64).
//!
//! The norm kernels run with the residual stream in f32 and in bf16 (`X_BF16`): with bf16 the
//! inputs are rounded to bf16 first (the reference sees them), the updated residual must be the
//! reference rounded once (within one bf16 step), and the pre-norm that follows reads the
//! unrounded row, so its bounds are the f32 stream's.

use super::{backend, rel_err, Rng};
use cmf_gpu::cuda::dit::rows::{self as dit_rows, GemmIn, NormCase, RowEnc, RowForm, RowsBack};
use cmf_gpu::cuda::runtime::device::Dev;
use cmf_gpu::cuda::runtime::fp8::e4m3_to_f32;

const ROWS: usize = 37;
const EPS: f32 = 1e-5;

/// Output formats to check: bf16 and s8, and e4m3 where the device has FP8 (8.9+).
fn formats(dev: &Dev) -> Vec<RowEnc> {
    if dev.cc >= (8, 9) {
        vec![RowEnc::Bf16, RowEnc::E4m3, RowEnc::S8]
    } else {
        super::gpu_skip::skip_unsupported(format!(
            "e4m3 outputs: FP8 needs compute capability 8.9+ ({:?})",
            dev.cc
        ));
        vec![RowEnc::Bf16, RowEnc::S8]
    }
}

/// `rows × n` values: row 0 zero, then row scales 2⁻² … 2² and one outlier (×20) per row.
fn rows_of(rng: &mut Rng, rows: usize, n: usize) -> Vec<f32> {
    let mut x: Vec<f32> = (0..rows * n)
        .map(|i| rng.uniform() * 2f32.powi((i / n % 5) as i32 - 2))
        .collect();
    x[..n].fill(0.0);
    for r in 1..rows {
        x[r * n + r * 7 % n] *= 20.0;
    }
    x
}

/// A GEMM output `vals [rows, n]` as the int8 path leaves it: s32 sums with one scale per row
/// (2⁻¹⁰ · (1 + r % 3)) and per column (2⁻¹⁰ · (0.5 + c % 7 / 7)), the sums rounded so that
/// sum · xs · ws comes near `vals`; and the values they stand for (f64 products rounded to f32).
struct Sums {
    acc: Vec<i32>,
    xs: Vec<f32>,
    ws: Vec<f32>,
    vals: Vec<f32>,
}

fn sums_of(vals: &[f32], n: usize) -> Sums {
    let rows = vals.len() / n;
    let xs: Vec<f32> = (0..rows).map(|r| (1 + r % 3) as f32 / 1024.0).collect();
    let ws: Vec<f32> = (0..n)
        .map(|c| (0.5 + (c % 7) as f32 / 7.0) / 1024.0)
        .collect();
    let scale = |i: usize| xs[i / n] as f64 * ws[i % n] as f64;
    let acc: Vec<i32> = vals
        .iter()
        .enumerate()
        .map(|(i, &v)| (v as f64 / scale(i)).round() as i32)
        .collect();
    let vals = acc
        .iter()
        .enumerate()
        .map(|(i, &a)| (a as f64 * scale(i)) as f32)
        .collect();
    Sums { acc, xs, ws, vals }
}

impl Sums {
    fn gemm_in(&self) -> GemmIn<'_> {
        GemmIn::S32 {
            acc: &self.acc,
            xs: &self.xs,
            ws: &self.ws,
        }
    }
}

fn bf16_bits(v: &[f32]) -> Vec<u16> {
    v.iter()
        .map(|&a| half::bf16::from_f32(a).to_bits())
        .collect()
}

/// A norm weight around 1.
fn norm_weight(rng: &mut Rng, n: usize) -> Vec<f32> {
    rng.vec(n, 0.2).iter().map(|v| 1.0 + v).collect()
}

/// 1 / RMS of `v` (n values), as the kernels' RMSNorm: 1 / sqrt(mean(v²) + eps).
fn inv_rms(v: impl Iterator<Item = f64>, n: usize) -> f64 {
    1.0 / (v.map(|a| a * a).sum::<f64>() / n as f64 + EPS as f64).sqrt()
}

/// Modulation slot `slot` of row `r`'s item (None: unmodulated).
fn slot_of<'a>(c: &NormCase<'a>, r: usize, slot: usize) -> Option<&'a [f32]> {
    (!c.mods.is_empty()).then(|| &c.mods[(c.items[r] * 4 + slot) * c.d..][..c.d])
}

/// A norm case over `x` (bf16 values when `x_bf16`): two items (rows alternate), their `[4,
/// d]` modulation slots in `mods` (empty: unmodulated).
fn case<'a>(
    x: &'a [f32],
    x_bf16: bool,
    d: usize,
    mods: &'a [f32],
    items: &'a [usize],
) -> NormCase<'a> {
    NormCase {
        x,
        x_bf16,
        d,
        eps: EPS,
        mods,
        items,
    }
}

/// The norm kernels' cases, width and residual type: the full-size width (the vector path), the
/// fixture's, an odd one (the scalar path), and bf16 residual rows at the first and the last.
const NORM_CASES: [(usize, bool); 5] = [
    (3840, false),
    (128, false),
    (341, false),
    (3840, true),
    (341, true),
];

/// A norm case's residual rows (`rows_of`), rounded to bf16 values when `x_bf16`.
fn residual_rows(rng: &mut Rng, d: usize, x_bf16: bool) -> Vec<f32> {
    let x = rows_of(rng, ROWS, d);
    if x_bf16 {
        x.iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect()
    } else {
        x
    }
}

/// Checks a kernel's rows (in encoding `enc`) against the reference `want [rows, n]`; prints how
/// close to its bound the worst value came.
fn check(label: &str, enc: RowEnc, got: &RowsBack, want: &[f64], n: usize) {
    let mut worst = 0f64;
    let mut within = |err: f64, tol: f64, what: &dyn Fn() -> String| {
        assert!(err <= tol, "{label}: {}", what());
        worst = worst.max(err / tol);
    };
    let rows = want.chunks(n);
    match got {
        RowsBack::Bf16(v) => {
            for (r, (g, w)) in v.chunks(n).zip(rows).enumerate() {
                let big = w.iter().fold(0f64, |m, a| m.max(a.abs()));
                for (i, (&a, &b)) in g.iter().zip(w).enumerate() {
                    let tol = b.abs() * (2f64.powi(-8) + 2e-6) + big * 1e-6 + 1e-30;
                    within((a as f64 - b).abs(), tol, &|| {
                        format!("[{r}, {i}] = {a}, want {b}")
                    });
                }
            }
        }
        RowsBack::Row8 { q, scale } if enc == RowEnc::S8 => {
            for (r, (qr, w)) in q.chunks(n).zip(rows).enumerate() {
                let amax = w.iter().fold(0f64, |m, a| m.max(a.abs()));
                let want_s = if amax > 0.0 { amax / 127.0 } else { 1.0 };
                let s = scale[r] as f64;
                within((s - want_s).abs(), 1e-6 * want_s, &|| {
                    format!("row {r}: scale {s}, want {want_s}")
                });
                for (i, (&b, &v)) in qr.iter().zip(w).enumerate() {
                    let qv = b as i8;
                    assert!(qv != -128, "{label}: [{r}, {i}] byte -128");
                    let got = qv as f64 * s;
                    let tol = 0.5 * s + v.abs() * 2e-6 + amax * 1e-6;
                    within((got - v).abs(), tol, &|| {
                        format!("[{r}, {i}] = {got} (s8 {qv}), want {v}")
                    });
                }
            }
        }
        RowsBack::Row8 { q, scale } => {
            for (r, (qr, w)) in q.chunks(n).zip(rows).enumerate() {
                let amax = w.iter().fold(0f64, |m, a| m.max(a.abs()));
                let want_s = if amax > 0.0 { amax / 448.0 } else { 1.0 };
                let s = scale[r] as f64;
                within((s - want_s).abs(), 1e-6 * want_s, &|| {
                    format!("row {r}: scale {s}, want {want_s}")
                });
                for (i, (&b, &v)) in qr.iter().zip(w).enumerate() {
                    let got = e4m3_to_f32(b) as f64 * s;
                    let tol = v.abs() * 2f64.powi(-4) + s * 2f64.powi(-9);
                    within((got - v).abs(), tol, &|| {
                        format!("[{r}, {i}] = {got} (byte {b:#04x}), want {v}")
                    });
                }
            }
        }
    }
    eprintln!("{label} {enc:?}: worst value at {worst:.2} of its bound");
}

/// rms_mod: `x · inv_rms(x) · w · (1 + scale)`.
fn rms_mod_ref(c: &NormCase, w: &[f32], slot: usize) -> Vec<f64> {
    let d = c.d;
    let mut out = Vec::with_capacity(c.x.len());
    for (r, xr) in c.x.chunks(d).enumerate() {
        let inv = inv_rms(xr.iter().map(|&a| a as f64), d);
        let sc = slot_of(c, r, slot);
        out.extend(
            (0..d)
                .map(|i| xr[i] as f64 * inv * w[i] as f64 * sc.map_or(1.0, |s| 1.0 + s[i] as f64)),
        );
    }
    out
}

/// residual_norm: (x + tanh(gate) · o · inv_rms(o) · w, then its pre-norm with `nw` and the
/// scale of `next_slot`).
fn residual_norm_ref(
    c: &NormCase,
    (o, w): (&[f32], &[f32]),
    gate_slot: usize,
    (nw, next_slot): (&[f32], usize),
) -> (Vec<f64>, Vec<f64>) {
    let d = c.d;
    let (mut xs, mut ys) = (Vec::new(), Vec::new());
    for (r, (xr, or)) in c.x.chunks(d).zip(o.chunks(d)).enumerate() {
        let inv = inv_rms(or.iter().map(|&a| a as f64), d);
        let g = slot_of(c, r, gate_slot);
        let nx: Vec<f64> = (0..d)
            .map(|i| {
                let gate = g.map_or(1.0, |g| (g[i] as f64).tanh());
                xr[i] as f64 + or[i] as f64 * inv * w[i] as f64 * gate
            })
            .collect();
        let inv2 = inv_rms(nx.iter().copied(), d);
        let sc = slot_of(c, r, next_slot);
        ys.extend(
            (0..d).map(|i| nx[i] * inv2 * nw[i] as f64 * sc.map_or(1.0, |s| 1.0 + s[i] as f64)),
        );
        xs.extend(nx);
    }
    (xs, ys)
}

#[test]
fn dit_rms_mod_matches_reference() {
    let Some(b) = backend() else { return };
    let dev = b.device();
    for (d, x_bf16) in NORM_CASES {
        let mut rng = Rng::new(d as u64);
        let x = residual_rows(&mut rng, d, x_bf16);
        let w = norm_weight(&mut rng, d);
        let mods = rng.vec(2 * 4 * d, 0.5);
        let items: Vec<usize> = (0..ROWS).map(|r| r % 2).collect();
        for modulated in [true, false] {
            let c = case(&x, x_bf16, d, if modulated { &mods } else { &[] }, &items);
            let want = rms_mod_ref(&c, &w, 2);
            for enc in formats(dev) {
                let got = dit_rows::rms_mod_for_test(dev, &c, &w, 2, enc).unwrap();
                check(
                    &format!("rms_mod d {d} modulated {modulated} x bf16 {x_bf16}"),
                    enc,
                    &got,
                    &want,
                    d,
                );
            }
        }
    }
}

#[test]
fn dit_residual_norm_matches_reference() {
    let Some(b) = backend() else { return };
    let dev = b.device();
    for (d, x_bf16) in NORM_CASES {
        let mut rng = Rng::new(100 + d as u64);
        let x = residual_rows(&mut rng, d, x_bf16);
        // o as the GEMMs write it (bf16, or s32 sums), so the reference sees the kernel's very
        // inputs.
        let o_raw = rows_of(&mut rng, ROWS, d);
        let o_bits = bf16_bits(&o_raw);
        let o_bf16: Vec<f32> = o_bits
            .iter()
            .map(|&b| half::bf16::from_bits(b).to_f32())
            .collect();
        let o_sums = sums_of(&o_raw, d);
        let (w, nw) = (norm_weight(&mut rng, d), norm_weight(&mut rng, d));
        // Gate slots around ±2 (tanh far from linear), scale slots within ±0.5.
        let mods: Vec<f32> = (0..2 * 4 * d)
            .map(|i| rng.uniform() * if i / d % 2 == 1 { 2.0 } else { 0.5 })
            .collect();
        let items: Vec<usize> = (0..ROWS).map(|r| r % 2).collect();
        let inputs = [
            ("bf16", GemmIn::Bf16(&o_bits), &o_bf16),
            ("s32", o_sums.gemm_in(), &o_sums.vals),
        ];
        for modulated in [true, false] {
            for (input, o_in, o) in &inputs {
                let c = case(&x, x_bf16, d, if modulated { &mods } else { &[] }, &items);
                let (want_x, want) = residual_norm_ref(&c, (o, &w), 3, (&nw, 0));
                // bf16 rows into every output format; s32 sums (the int8 path) into bf16 and
                // s8 rows.
                for enc in formats(dev) {
                    if *input == "s32" && enc == RowEnc::E4m3 {
                        continue;
                    }
                    let (got_x, got) =
                        dit_rows::residual_norm_for_test(dev, &c, (*o_in, &w), 3, (&nw, 0), enc)
                            .unwrap();
                    let label = format!(
                        "residual_norm d {d} modulated {modulated} x bf16 {x_bf16} o {input}"
                    );
                    if x_bf16 {
                        // One rounding of the f32 update: within one bf16 step of the reference
                        // (2⁻⁷·|ref|), since the f32 evaluation's error, a few ulps of the operands
                        // x and the update (2e-6 of their sizes: cancellation makes it large next to
                        // a small sum), can carry the value across a rounding midpoint.
                        for (i, (&a, &b)) in got_x.iter().zip(&want_x).enumerate() {
                            let xi = x[i] as f64;
                            let tol = b.abs() * 2f64.powi(-7)
                                + (xi.abs() + (b - xi).abs()) * 2e-6
                                + 1e-30;
                            assert!(
                                (a as f64 - b).abs() <= tol,
                                "{label}: x[{i}] = {a}, want {b}"
                            );
                        }
                    } else {
                        let want_x32: Vec<f32> = want_x.iter().map(|&a| a as f32).collect();
                        let err = rel_err(&got_x, &want_x32);
                        assert!(err < 2e-6, "{label}: residual rel err {err}");
                    }
                    check(&label, enc, &got, &want, d);
                }
            }
        }
    }
}

#[test]
fn dit_swiglu_matches_reference() {
    let Some(b) = backend() else { return };
    let dev = b.device();
    // The register form (where it applies; 341 takes the shared one either way): 10240 at 16
    // values a thread; 2056 at 8, 257 threads (the last warp one thread full); 128 at 8, 16 of
    // the block's 32 threads holding values.
    for f in [10240usize, 341, 128, 2056] {
        let mut rng = Rng::new(200 + f as u64);
        // Each row [g | u]: rows_of over 2F values gives both halves the row's scale.
        let raw = rows_of(&mut rng, ROWS, 2 * f);
        let gu = bf16_bits(&raw);
        let sums = sums_of(&raw, 2 * f);
        let bf16_vals: Vec<f32> = gu
            .iter()
            .map(|&b| half::bf16::from_bits(b).to_f32())
            .collect();
        let want_of = |v: &[f32]| -> Vec<f64> {
            (0..ROWS * f)
                .map(|k| {
                    let (r, i) = (k / f, k % f);
                    let (g, u) = (v[r * 2 * f + i] as f64, v[r * 2 * f + f + i] as f64);
                    g / (1.0 + (-g).exp()) * u
                })
                .collect()
        };
        let (want_b, want_s) = (want_of(&bf16_vals), want_of(&sums.vals));
        // bf16 rows in every output format; s32 sums into bf16 and s8 rows (the int8 path).
        let cases = formats(dev)
            .into_iter()
            .map(|e| (false, e))
            .chain([RowEnc::Bf16, RowEnc::S8].map(|e| (true, e)));
        for (from_sums, enc) in cases {
            let want = if from_sums { &want_s } else { &want_b };
            let input = if from_sums { "s32" } else { "bf16" };
            let [shared, regs] = [RowForm::Shared, RowForm::Registers].map(|form| {
                let gu_in = if from_sums {
                    sums.gemm_in()
                } else {
                    GemmIn::Bf16(&gu)
                };
                let got = dit_rows::swiglu_for_test(dev, gu_in, f, enc, form).unwrap();
                check(
                    &format!("swiglu {form:?} F {f} gu {input}"),
                    enc,
                    &got,
                    want,
                    f,
                );
                got
            });
            // The two forms compute each value the same way: the same bits.
            let bits = |r: &RowsBack| match r {
                RowsBack::Bf16(v) => v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>(),
                RowsBack::Row8 { q, scale } => q
                    .iter()
                    .map(|&b| b as u32)
                    .chain(scale.iter().map(|x| x.to_bits()))
                    .collect(),
            };
            assert!(
                bits(&shared) == bits(&regs),
                "swiglu F {f} {enc:?} gu {input}: the register form's bits differ from the shared one's"
            );
        }
    }
}
