//! Attention (both schedules, every ISA path, every KV element type) against the naive f64
//! reference. Outputs are convex combinations of V rows; f32 scores and the polynomial exp move
//! the weights by ~1e-6 relative, so |err| ≤ 1e-5 · max|v| is the bound checked.

mod common;

use cmf_kernels::attention::attention_with;
use cmf_kernels::attention::KvLayout;
use cmf_kernels::{attention_decode, reference, AttnParams, Isa, Kv, KvCache, KvDtype, KvSlice};
use common::Rng;

struct Case {
    nq: usize,
    len: usize,
    heads: usize,
    kv_heads: usize,
    hd: usize,
    causal: bool,
    window: Option<usize>,
    masked: bool,
}

fn to_bits(dtype: KvDtype, x: &[f32]) -> (Vec<u16>, Vec<f32>) {
    match dtype {
        KvDtype::F16 => {
            let b: Vec<u16> = x
                .iter()
                .map(|v| half::f16::from_f32(*v).to_bits())
                .collect();
            let back = b
                .iter()
                .map(|h| half::f16::from_bits(*h).to_f32())
                .collect();
            (b, back)
        }
        KvDtype::Bf16 => {
            let b: Vec<u16> = x
                .iter()
                .map(|v| half::bf16::from_f32(*v).to_bits())
                .collect();
            let back = b
                .iter()
                .map(|h| half::bf16::from_bits(*h).to_f32())
                .collect();
            (b, back)
        }
        KvDtype::F32 => (vec![], x.to_vec()),
    }
}

fn run_case(rng: &mut Rng, c: &Case) {
    let q = rng.vec(c.nq * c.heads * c.hd, 1.5);
    let k = rng.vec(c.len * c.kv_heads * c.hd, 1.5);
    let v = rng.vec(c.len * c.kv_heads * c.hd, 1.0);
    let mask: Option<Vec<bool>> = c.masked.then(|| (0..c.len).map(|j| j % 7 != 3).collect());
    let q_pos0 = c.len - c.nq;
    let p = AttnParams {
        n_heads: c.heads,
        n_kv_heads: c.kv_heads,
        head_dim: c.hd,
        scale: 1.0 / (c.hd as f32).sqrt(),
        causal: c.causal,
        q_pos0,
        window: c.window,
    };
    for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Bf16] {
        let (kb, kr) = to_bits(dtype, &k);
        let (vbits, vr) = to_bits(dtype, &v);
        let kv = match dtype {
            KvDtype::F32 => Kv::f32(&k, &v, c.len),
            KvDtype::F16 => Kv {
                k: KvSlice::F16(&kb),
                v: KvSlice::F16(&vbits),
                len: c.len,
                layout: KvLayout::TokenMajor,
            },
            KvDtype::Bf16 => Kv {
                k: KvSlice::Bf16(&kb),
                v: KvSlice::Bf16(&vbits),
                len: c.len,
                layout: KvLayout::TokenMajor,
            },
        };
        let mut want = vec![0f32; q.len()];
        reference::attention(
            &q,
            &kr,
            &vr,
            c.len,
            c.heads,
            c.kv_heads,
            c.hd,
            p.scale,
            c.causal,
            q_pos0,
            c.window,
            mask.as_deref(),
            &mut want,
        );
        let vmax = vr.iter().fold(0f32, |m, x| m.max(x.abs()));
        // The same keys in a head-major cache (with spare capacity).
        let mut cache = KvCache::new(dtype, c.len + 5, c.kv_heads, c.hd);
        cache.write(0, &k, &v);
        for isa in Isa::all_supported() {
            let mut got = vec![f32::NAN; q.len()];
            attention_with(isa, &q, cache.view(c.len), &p, mask.as_deref(), &mut got);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-5 * vmax,
                    "{isa} cache {dtype:?} nq={} len={}: [{i}] {g} vs {w}",
                    c.nq,
                    c.len
                );
            }
            let mut got = vec![f32::NAN; q.len()];
            attention_with(isa, &q, kv, &p, mask.as_deref(), &mut got);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-5 * vmax,
                    "{isa} kv {dtype:?} nq={} len={} heads={}/{} hd={} causal={} window={:?} masked={}: [{i}] {g} vs {w}",
                    c.nq, c.len, c.heads, c.kv_heads, c.hd, c.causal, c.window, c.masked
                );
            }
        }
    }
}

#[test]
fn decode_schedule() {
    let mut rng = Rng(20);
    for (len, window) in [
        (1, None),
        (5, None),
        (300, None),
        (1000, None),
        (1000, Some(100)),
    ] {
        run_case(
            &mut rng,
            &Case {
                nq: 1,
                len,
                heads: 8,
                kv_heads: 2,
                hd: 64,
                causal: true,
                window,
                masked: false,
            },
        );
    }
    run_case(
        &mut rng,
        &Case {
            nq: 3,
            len: 77,
            heads: 9,
            kv_heads: 3,
            hd: 40,
            causal: true,
            window: None,
            masked: false,
        },
    );
    run_case(
        &mut rng,
        &Case {
            nq: 2,
            len: 130,
            heads: 4,
            kv_heads: 4,
            hd: 128,
            causal: false,
            window: None,
            masked: true,
        },
    );
}

#[test]
fn flash_schedule() {
    let mut rng = Rng(21);
    // Prefill from position 0, GQA, head_dim not a multiple of 32.
    run_case(
        &mut rng,
        &Case {
            nq: 130,
            len: 130,
            heads: 6,
            kv_heads: 2,
            hd: 80,
            causal: true,
            window: None,
            masked: false,
        },
    );
    // A chunk continuing a cache, with a sliding window.
    run_case(
        &mut rng,
        &Case {
            nq: 70,
            len: 200,
            heads: 4,
            kv_heads: 1,
            hd: 64,
            causal: true,
            window: Some(50),
            masked: false,
        },
    );
    // Joint (non-causal) attention with masked pad keys.
    run_case(
        &mut rng,
        &Case {
            nq: 150,
            len: 150,
            heads: 3,
            kv_heads: 3,
            hd: 128,
            causal: false,
            window: None,
            masked: true,
        },
    );
    // Few tokens, many heads per group: still the flash schedule (rows = 4·8).
    run_case(
        &mut rng,
        &Case {
            nq: 4,
            len: 33,
            heads: 16,
            kv_heads: 2,
            hd: 16,
            causal: true,
            window: None,
            masked: false,
        },
    );
}

#[test]
fn kv_cache_decode_matches_prefill_rows() {
    // Writing K/V token by token into a cache and decoding each position gives the rows of one
    // causal prefill over the same tokens.
    let mut rng = Rng(22);
    let (heads, kvh, hd, n) = (4usize, 2usize, 32usize, 40usize);
    let q = rng.vec(n * heads * hd, 1.0);
    let k = rng.vec(n * kvh * hd, 1.0);
    let v = rng.vec(n * kvh * hd, 1.0);
    let p = AttnParams {
        n_heads: heads,
        n_kv_heads: kvh,
        head_dim: hd,
        scale: 0.2,
        causal: true,
        q_pos0: 0,
        window: None,
    };
    let mut full = vec![0f32; q.len()];
    cmf_kernels::attention(&q, Kv::f32(&k, &v, n), &p, None, &mut full);
    let mut cache = KvCache::new(KvDtype::F32, 64, kvh, hd);
    assert_eq!(cache.bytes(), 2 * 64 * kvh * hd * 4);
    let row = heads * hd;
    for t in 0..n {
        cache.write(
            t,
            &k[t * kvh * hd..(t + 1) * kvh * hd],
            &v[t * kvh * hd..(t + 1) * kvh * hd],
        );
        let mut out = vec![0f32; row];
        attention_decode(&q[t * row..(t + 1) * row], &cache, t + 1, &p, &mut out);
        for (g, w) in out.iter().zip(&full[t * row..(t + 1) * row]) {
            assert!((g - w).abs() <= 1e-5, "position {t}: {g} vs {w}");
        }
    }
}
