//! Qwen3-Next's hybrid layers (kernels/gdn.cu) against the CPU reference on fresh random
//! weights: a model of GatedDeltaNet layers and an output-gated, partially rotary attention
//! layer with `(1 + w)` norms, in prefill (the recurrence over a chunk's rows in one launch,
//! chunks carrying the state) and in the captured decode graph; the state after a prefill equals
//! the state after decoding the same tokens one by one; a state asked to resume elsewhere is
//! refused. f32 weights: only the summation order differs, logits < 1e-4, greedy identical.

use super::*;
use cmf_gpu::llm::reference::Q8Inputs;
use cmf_gpu::llm::{
    AttentionWeights, Ffn, GdnGeometry, GdnWeights, LayerWeights, Mixer, Mlp, NormStyle, RopeSpec,
};

/// Owned random weights of a small hybrid model: layers GDN, GDN, gated attention, GDN.
struct Hybrid {
    /// The codec of every matrix but the GatedDeltaNet's b/a projection (f32, as converted
    /// files keep it).
    dtype: Dtype,
    spec: LlmSpec,
    geo: GdnGeometry,
    embed: Vec<u8>,
    head: Vec<u8>,
    final_norm: Vec<f32>,
    layers: Vec<HybridLayer>,
}

struct HybridLayer {
    norms: [Vec<f32>; 2],
    /// GDN: qkvz, ba, out; attention: q (query | gate per head), k, v, o.
    m: Vec<Vec<u8>>,
    /// GDN: conv, A_log, dt_bias, gated norm; attention: q_norm, k_norm.
    vecs: Vec<Vec<f32>>,
    /// gate, up, down.
    mlp: [Vec<u8>; 3],
}

const MIXERS: [bool; 4] = [true, true, false, true];

impl Hybrid {
    fn new(seed: u64, dtype: Dtype) -> Hybrid {
        let (h, f, nh, nkv, d, vocab) = (128, 192, 4, 2, 32, 300);
        // dv 40: the recurrence's block has a partial warp; conv of 4 taps as Qwen3-Next.
        let geo = GdnGeometry {
            num_k_heads: 2,
            num_v_heads: 4,
            k_head_dim: 32,
            v_head_dim: 40,
            conv_kernel: 4,
        };
        let mut rng = Rng::new(seed);
        let mut s = seed;
        let mut mat = |rows: usize, cols: usize, d: Dtype| {
            s += 1;
            random_matrix(d, rows, cols, 1.0 / (cols as f32).sqrt(), s)
        };
        // Partial rotary: 8 of the 16 frequency pairs (rotary dim 16 of head dim 32).
        let inv_freq = (0..8)
            .map(|i| 1.0 / 10_000f32.powf(2.0 * i as f32 / 16.0))
            .collect();
        let spec = LlmSpec {
            hidden: h,
            intermediate: f,
            num_layers: MIXERS.len(),
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: d,
            vocab,
            rms_eps: 1e-6,
            rope: RopeSpec {
                inv_freq,
                attention_factor: 1.0,
            },
            sliding_window: vec![None; MIXERS.len()],
            attn_scale: 1.0 / (d as f32).sqrt(),
            norm_style: NormStyle::OnePlus,
        };
        let layers = MIXERS
            .iter()
            .map(|&gdn| {
                let (m, vecs) = if gdn {
                    let m = vec![
                        mat(geo.qkvz_dim(), h, dtype),
                        mat(2 * geo.num_v_heads, h, Dtype::F32),
                        mat(h, geo.value_dim(), dtype),
                    ];
                    let a_log = rng.vec(geo.num_v_heads, 1.0);
                    let vecs = vec![
                        rng.vec(geo.conv_dim() * geo.conv_kernel, 0.5),
                        a_log,
                        rng.vec(geo.num_v_heads, 1.0),
                        rng.vec(geo.v_head_dim, 0.5)
                            .iter()
                            .map(|v| 1.0 + v)
                            .collect(),
                    ];
                    (m, vecs)
                } else {
                    let m = vec![
                        mat(2 * nh * d, h, dtype),
                        mat(nkv * d, h, dtype),
                        mat(nkv * d, h, dtype),
                        mat(h, nh * d, dtype),
                    ];
                    (m, vec![rng.vec(d, 0.2), rng.vec(d, 0.2)])
                };
                HybridLayer {
                    norms: [rng.vec(h, 0.2), rng.vec(h, 0.2)],
                    m,
                    vecs,
                    mlp: [mat(f, h, dtype), mat(f, h, dtype), mat(h, f, dtype)],
                }
            })
            .collect();
        Hybrid {
            embed: mat(vocab, h, dtype),
            head: mat(vocab, h, dtype),
            dtype,
            final_norm: rng.vec(h, 0.2),
            spec,
            geo,
            layers,
        }
    }

    fn model<'a>(&'a self) -> LlmModel<'a> {
        let w = |data: &'a [u8], rows, cols| Weight {
            dtype: self.dtype,
            rows,
            cols,
            data,
        };
        let f32w = |data: &'a [u8], rows, cols| Weight {
            dtype: Dtype::F32,
            rows,
            cols,
            data,
        };
        let (s, g) = (&self.spec, &self.geo);
        let (h, f) = (s.hidden, s.intermediate);
        let layers = self
            .layers
            .iter()
            .map(|l| {
                let mixer = if l.m.len() == 3 {
                    Mixer::GatedDelta(GdnWeights {
                        geometry: *g,
                        qkvz: w(&l.m[0], g.qkvz_dim(), h),
                        ba: f32w(&l.m[1], 2 * g.num_v_heads, h),
                        out: w(&l.m[2], h, g.value_dim()),
                        conv: &l.vecs[0],
                        a_log: &l.vecs[1],
                        dt_bias: &l.vecs[2],
                        norm: &l.vecs[3],
                    })
                } else {
                    Mixer::Attention(AttentionWeights {
                        q: w(&l.m[0], 2 * s.q_dim(), h),
                        k: w(&l.m[1], s.kv_dim(), h),
                        v: w(&l.m[2], s.kv_dim(), h),
                        o: w(&l.m[3], h, s.q_dim()),
                        q_bias: None,
                        k_bias: None,
                        v_bias: None,
                        q_norm: Some(&l.vecs[0]),
                        k_norm: Some(&l.vecs[1]),
                        output_gate: true,
                    })
                };
                LayerWeights {
                    attn_norm: &l.norms[0],
                    mixer,
                    ffn_norm: &l.norms[1],
                    ffn: Ffn::Dense(Mlp {
                        gate: w(&l.mlp[0], f, h),
                        up: w(&l.mlp[1], f, h),
                        down: w(&l.mlp[2], h, f),
                    }),
                }
            })
            .collect();
        LlmModel {
            spec: s.clone(),
            embed: w(&self.embed, s.vocab, h),
            layers,
            final_norm: &self.final_norm,
            lm_head: w(&self.head, s.vocab, h),
        }
    }
}

fn opts(chunk: usize) -> LlmOptions {
    LlmOptions {
        max_context: 256,
        prefill_chunk: chunk,
        ..LlmOptions::default()
    }
}

fn prompt(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 7919 + 13) % 300).collect()
}

/// Prefill in chunks of 16 (every position's logits) and 12 teacher-forced decode steps
/// against the reference, which runs the recurrence one token at a time. f32 weights: within
/// 1e-4 (summation order only), identical greedy ids. q8_row weights: against the reference with
/// the q8 products' inputs rounded as the device rounds them (`with_q8_inputs`: bf16 in the
/// prefill GEMMs, s8 blocks in the decode matvecs) and an f32 KV cache on both sides, within 1e-2
/// and identical greedy ids. This
/// small random model moves 1.1e-1 (bf16) to 1.7e-1 (s8) from that rounding alone, the size of
/// the 1.5e-1 to 1.7e-1 an H100 measured against f32 inputs and far over the dense models' 8-bit
/// bound of 6e-2; a perturbation of 3e-7 in its inputs moves the rounded reference by 7e-7, so
/// 1e-2 leaves room for summation order and the odd rounding flip, not for a wrong product.
#[test]
fn hybrid_model_matches_the_reference() {
    let Some(b) = backend() else { return };
    hybrid_against_reference(&b, Dtype::F32, 1e-4);
    hybrid_against_reference(&b, Dtype::Q8Row, 1e-2);
}

fn hybrid_against_reference(b: &CudaBackend, dtype: Dtype, tol: f64) {
    let m = Hybrid::new(7, dtype);
    let model = m.model();
    model.validate().unwrap();
    // An f32 cache for q8 too, so that the only rounding is the inputs' (the reference's cache
    // is f32).
    let opts = LlmOptions {
        kv: KvPrecision::F32,
        ..opts(16)
    };
    let mut dev = b
        .load_cuda_llm(&model, &opts, &Placement::all(model.spec.num_layers))
        .expect("the hybrid loads");
    let reference_token = |t: u32, pos: usize, cache: &mut RefCache, r: Q8Inputs| {
        reference::with_q8_inputs(r, || reference::forward_token(&model, t, pos, cache))
    };
    let v = model.spec.vocab;
    let p = prompt(40);
    let mut got = vec![f32::NAN; p.len() * v];
    dev.prefill(&p, 0, Logits::All, &mut got).unwrap();
    let mut cache = RefCache::new(model.spec.num_layers);
    let (mut e_prefill, mut last) = (0f64, Vec::new());
    for (i, &t) in p.iter().enumerate() {
        last = reference_token(t, i, &mut cache, Q8Inputs::Bf16);
        e_prefill = e_prefill.max(rel_err(&got[i * v..(i + 1) * v], &last));
    }
    let (mut e_decode, mut differ) = (0f64, 0);
    let mut tok = reference::argmax(&last);
    for i in 0..12 {
        let pos = p.len() + i;
        let mut out = DecodeOutput::default();
        dev.decode(tok, pos, &Sampler::Greedy, true, &mut out)
            .unwrap();
        let want = reference_token(tok, pos, &mut cache, Q8Inputs::S8Blocks32);
        e_decode = e_decode.max(rel_err(&out.logits, &want));
        let t = reference::argmax(&want);
        differ += (out.token != t) as usize;
        tok = t;
    }
    eprintln!(
        "hybrid {dtype}: prefill {e_prefill:.2e}, decode {e_decode:.2e}, {differ} ids differ"
    );
    assert!(
        e_prefill < tol && e_decode < tol,
        "{dtype}: {e_prefill} {e_decode}"
    );
    assert_eq!(differ, 0, "{dtype}: greedy ids differ");
}

/// The state after a 40-token prefill (chunks of 16) equals the state after one token of
/// prefill and 39 decode steps: the next step's logits agree (1e-4: GEMM against matvec
/// summation orders; a state off by a token is off by far more), and both equal the reference.
#[test]
fn prefill_state_equals_token_by_token_decode() {
    let Some(b) = backend() else { return };
    let m = Hybrid::new(11, Dtype::F32);
    let model = m.model();
    let all = Placement::all(model.spec.num_layers);
    let v = model.spec.vocab;
    let p = prompt(41);
    let (head, next) = (&p[..40], p[40]);
    let step = |dev: &mut CudaLlm| {
        let mut out = DecodeOutput::default();
        dev.decode(next, 40, &Sampler::Greedy, true, &mut out)
            .unwrap();
        out.logits
    };
    let mut a = b.load_cuda_llm(&model, &opts(16), &all).unwrap();
    let mut none = vec![0f32; 0];
    a.prefill(head, 0, Logits::None, &mut none).unwrap();
    let la = step(&mut a);
    let mut bb = b.load_cuda_llm(&model, &opts(16), &all).unwrap();
    let mut first = vec![0f32; v];
    bb.prefill(&head[..1], 0, Logits::Last, &mut first).unwrap();
    for (i, &t) in head.iter().enumerate().skip(1) {
        let mut out = DecodeOutput::default();
        bb.decode(t, i, &Sampler::Greedy, false, &mut out).unwrap();
    }
    let lb = step(&mut bb);
    let want = reference::last_logits(&model, &p);
    let (ab, ar) = (rel_err(&la, &lb), rel_err(&la, &want));
    println!("state after prefill vs decode: next logits {ab:.2e}, vs reference {ar:.2e}");
    assert!(ab < 1e-4 && ar < 1e-4, "{ab} {ar}");
}

/// A recurrent state goes on only from where it is: a decode 3 positions back is refused and
/// changes nothing (the right position still gives the reference's logits); position 0
/// restarts it.
#[test]
fn recurrent_state_refuses_other_positions() {
    let Some(b) = backend() else { return };
    let m = Hybrid::new(13, Dtype::F32);
    let model = m.model();
    let all = Placement::all(model.spec.num_layers);
    let v = model.spec.vocab;
    let p = prompt(20);
    let mut dev = b.load_cuda_llm(&model, &opts(64), &all).unwrap();
    let mut last = vec![0f32; v];
    dev.prefill(&p, 0, Logits::Last, &mut last).unwrap();
    let mut out = DecodeOutput::default();
    assert!(dev
        .decode(p[0], p.len() - 3, &Sampler::Greedy, true, &mut out)
        .is_err());
    let mut cache = RefCache::new(model.spec.num_layers);
    for (i, &t) in p.iter().enumerate() {
        reference::forward_token(&model, t, i, &mut cache);
    }
    dev.decode(p[1], p.len(), &Sampler::Greedy, true, &mut out)
        .unwrap();
    let want = reference::forward_token(&model, p[1], p.len(), &mut cache);
    assert!(rel_err(&out.logits, &want) < 1e-4);
    let mut again = vec![0f32; v];
    dev.prefill(&p, 0, Logits::Last, &mut again).unwrap();
    assert!(
        rel_err(&again, &last) < 1e-6,
        "a restart at 0 equals the first run"
    );
}

/// A grammar-masked decode steps a hybrid's recurrent state like a plain one: masked decodes
/// at positions 20 and 21 (every token allowed), then a plain decode at 22 is accepted and gives
/// the reference's logits; a masked decode 3 positions back is refused.
#[test]
fn masked_decode_keeps_the_recurrent_position() {
    let Some(b) = backend() else { return };
    let m = Hybrid::new(17, Dtype::F32);
    let model = m.model();
    let all = Placement::all(model.spec.num_layers);
    let p = prompt(23);
    let mut dev = b.load_cuda_llm(&model, &opts(64), &all).unwrap();
    let mut none = vec![0f32; 0];
    dev.prefill(&p[..20], 0, Logits::None, &mut none).unwrap();
    let mut allow_all = |_: &mut [u32]| {};
    for (i, &t) in p.iter().enumerate().take(22).skip(20) {
        dev.decode_masked(t, i, &Sampler::Greedy, &mut allow_all)
            .unwrap();
    }
    assert!(dev
        .decode_masked(p[0], 19, &Sampler::Greedy, &mut allow_all)
        .is_err());
    let mut out = DecodeOutput::default();
    dev.decode(p[22], 22, &Sampler::Greedy, true, &mut out)
        .unwrap();
    let want = reference::last_logits(&model, &p);
    let e = rel_err(&out.logits, &want);
    println!("plain decode after masked decodes: {e:.2e} against the reference");
    assert!(e < 1e-4, "{e}");
}

/// gdn_prep and gdn_delta alone against the reference's pieces (`gdn_inputs`, `gdn_conv`,
/// `gdn_l2norm`, `gdn_recurrence`, `gdn_gated_norm`) on random projections: passes of 1, 37, 1
/// and 5 rows in a row (the state carried between launches), each pass's outputs and at the end
/// the conv ring (copied inputs: exact) and the delta state, L2-relative < 1e-4 (f32, only the
/// summation order differs); the fixtures' geometry (dv 24: a partial warp), Qwen3-Next
/// 80B's heads (dk = dv = 128: four row groups of the state), a 2-tap conv, two row groups, and
/// dk 80 (three row groups of 27 or 26 rows) with a 3-tap conv.
#[test]
fn gdn_kernels_match_the_reference() {
    use cmf_gpu::cuda::llm::gdn::{launch_mix, DevGdn, GdnKernels, GdnWs};
    use cmf_gpu::cuda::runtime::device::bytes_of;
    use cmf_gpu::llm::reference::{
        gdn_conv, gdn_gated_norm, gdn_inputs, gdn_l2norm, gdn_recurrence, GdnState,
    };
    let Some(b) = backend() else { return };
    let dev = b.device();
    let k = GdnKernels::load(dev).expect("the gdn module loads");
    let geo = |nk, nv, dk, dv, w| GdnGeometry {
        num_k_heads: nk,
        num_v_heads: nv,
        k_head_dim: dk,
        v_head_dim: dv,
        conv_kernel: w,
    };
    let eps = 1e-6;
    for (i, g) in [
        geo(2, 4, 16, 24, 4),
        geo(16, 32, 128, 128, 4),
        geo(1, 3, 32, 64, 2),
        geo(2, 2, 64, 32, 4),
        geo(1, 1, 80, 40, 3),
    ]
    .into_iter()
    .enumerate()
    {
        let mut rng = Rng::new(100 + i as u64);
        let h = 64;
        let mat = |rows, cols, seed| random_matrix(Dtype::F32, rows, cols, 0.1, seed);
        let (qkvz_w, ba_w, out_w) = (
            mat(g.qkvz_dim(), h, 1),
            mat(2 * g.num_v_heads, h, 2),
            mat(h, g.value_dim(), 3),
        );
        let conv = rng.vec(g.conv_dim() * g.conv_kernel, 0.5);
        let (a_log, dt_bias) = (rng.vec(g.num_v_heads, 1.0), rng.vec(g.num_v_heads, 1.0));
        let norm: Vec<f32> = rng.vec(g.v_head_dim, 0.5).iter().map(|v| 1.0 + v).collect();
        fn f32w(data: &[u8], rows: usize, cols: usize) -> Weight<'_> {
            Weight {
                dtype: Dtype::F32,
                rows,
                cols,
                data,
            }
        }
        let w = GdnWeights {
            geometry: g,
            qkvz: f32w(&qkvz_w, g.qkvz_dim(), h),
            ba: f32w(&ba_w, 2 * g.num_v_heads, h),
            out: f32w(&out_w, h, g.value_dim()),
            conv: &conv,
            a_log: &a_log,
            dt_bias: &dt_bias,
            norm: &norm,
        };
        let dg = DevGdn::upload(dev, &w).unwrap();
        let mut st = GdnState::new(&g);
        let mut worst = 0f64;
        for rows in [1, 37, 1, 5] {
            let ws = GdnWs::for_layer(dev, &g, rows).unwrap();
            let qkvz = rng.vec(rows * g.qkvz_dim(), 1.0);
            let ba = rng.vec(rows * 2 * g.num_v_heads, 2.0);
            let (qp, bp) = ws.inputs();
            dev.upload(qp, bytes_of(&qkvz)).unwrap();
            dev.upload(bp, bytes_of(&ba)).unwrap();
            launch_mix(dev, &k, &dg, rows, &ws, eps, false).unwrap();
            let mut got = vec![0f32; rows * g.value_dim()];
            dev.download_f32(&mut got, ws.core()).unwrap();
            let mut want = Vec::new();
            for t in 0..rows {
                let (mut mixed, z, beta, decay) = gdn_inputs(
                    &w,
                    &qkvz[t * g.qkvz_dim()..(t + 1) * g.qkvz_dim()],
                    &ba[t * 2 * g.num_v_heads..(t + 1) * 2 * g.num_v_heads],
                );
                gdn_conv(&g, &conv, &mut mixed, &mut st.conv);
                gdn_l2norm(&g, &mut mixed);
                let mut core = vec![0f32; g.value_dim()];
                gdn_recurrence(&g, &mixed, &beta, &decay, &mut st.delta, &mut core);
                gdn_gated_norm(&g, &mut core, &z, &norm, eps);
                want.extend(core);
            }
            worst = worst.max(rel_err(&got, &want));
        }
        let (ring_p, state_p) = dg.state();
        let mut ring = vec![0f32; st.conv.len()];
        let mut delta = vec![0f32; st.delta.len()];
        dev.download_f32(&mut ring, ring_p).unwrap();
        dev.download_f32(&mut delta, state_p).unwrap();
        let (er, ed) = (rel_err(&ring, &st.conv), rel_err(&delta, &st.delta));
        println!("gdn kernels {g:?}: outputs {worst:.2e}, ring {er:.2e}, state {ed:.2e}");
        assert!(
            worst < 1e-4 && er < 1e-6 && ed < 1e-4,
            "{g:?}: {worst} {er} {ed}"
        );
    }
}
