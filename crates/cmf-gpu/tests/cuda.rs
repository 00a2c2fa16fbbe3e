//! CUDA backend against the CPU reference, on fresh random inputs. Every test prints
//! `SKIPPED: <reason>` and passes when no device answers (CI has none), and fails instead with
//! `CMF_REQUIRE_GPU=1`; on the GPU machine run it with `--nocapture` and read the parity table
//! each test prints.
//!
//! Tolerances (relative L2 error ‖gpu − ref‖ / ‖ref‖, and why):
//! - f32/f16/bf16 weights in decode: f32 activations and accumulation, only the summation
//!   order differs: < 1e-5 per matvec; whole-model logits < 1e-4; greedy tokens identical.
//! - q8/q4 weights in decode: the activation is quantised to int8 per 32-block (dp4a), an
//!   error of ~0.7 % RMS: < 2e-2 per matvec; whole-model logits < 6e-2.
//! - prefill with bf16/q8/q4 weights: bf16 GEMM operands (2⁻⁹ relative rounding) and an f16
//!   KV cache: whole-model logits < 6e-2.

use cmf_format::Dtype;
use cmf_gpu::cuda::llm::CommonKernels;
use cmf_gpu::cuda::llm::{AttnKernel, CudaLlm, DecodeTuning, ShortDecode};
use cmf_gpu::cuda::runtime::device::Dev;
use cmf_gpu::cuda::runtime::matvec::{self, MvMode, MvSeg};
use cmf_gpu::cuda::runtime::weights::DevWeight;
use cmf_gpu::cuda::CudaBackend;
use cmf_gpu::facade::{Backend, GpuMode, LayerSet, LlmDevice, Placement};
use cmf_gpu::llm::reference::{self, RefCache};
use cmf_gpu::llm::synth::{qwen3_spec, random_matrix, Rng, SynthModel, SynthOptions};
use cmf_gpu::llm::{DecodeOutput, KvPrecision, LlmModel, LlmOptions, LlmSpec, Logits, Sampler};
use cmf_gpu::Gpu;
use cmf_kernels::Weight;
use std::sync::{Arc, Mutex, OnceLock};

#[path = "../../../test-support/gpu.rs"]
mod gpu_skip;

/// The DiT's row kernels (bf16 and fused e4m3 outputs) against CPU references.
#[path = "cuda/dit_rows.rs"]
mod dit_rows;

/// One backend per test process (context creation and kernel compilation are not free);
/// tests share it one at a time.
fn backend() -> Option<std::sync::MutexGuard<'static, Arc<CudaBackend>>> {
    static B: OnceLock<Result<Mutex<Arc<CudaBackend>>, String>> = OnceLock::new();
    let opened = B.get_or_init(|| CudaBackend::open(0).map(|b| Mutex::new(Arc::new(b))));
    gpu_skip::device_or_skip(opened.as_ref()).map(|m| m.lock().unwrap_or_else(|p| p.into_inner()))
}

fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        if !g.is_finite() {
            return f64::INFINITY;
        }
        num += ((g - w) as f64).powi(2);
        den += (*w as f64).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

const CODECS: [Dtype; 7] = [
    Dtype::F32,
    Dtype::F16,
    Dtype::Bf16,
    Dtype::Q8Row,
    Dtype::Q8_2f,
    Dtype::Q4Block,
    Dtype::Q4Tiled,
];

fn matvec_tol(d: Dtype) -> f64 {
    if d.is_quantized() {
        2e-2
    } else {
        1e-5
    }
}

struct HostMat {
    data: Vec<u8>,
    dtype: Dtype,
    rows: usize,
    cols: usize,
}

impl HostMat {
    fn new(dtype: Dtype, rows: usize, cols: usize, seed: u64) -> HostMat {
        HostMat {
            data: random_matrix(dtype, rows, cols, 0.05, seed),
            dtype,
            rows,
            cols,
        }
    }
    fn w(&self) -> Weight<'_> {
        Weight {
            dtype: self.dtype,
            rows: self.rows,
            cols: self.cols,
            data: &self.data,
        }
    }
    fn reference(&self, x: &[f32]) -> Vec<f32> {
        let mut y = vec![0f32; self.rows];
        cmf_kernels::reference::matvec(&self.w(), x, &mut y);
        y
    }
}

#[allow(clippy::too_many_arguments)]
fn run_matvec(
    dev: &Dev,
    ck: &CommonKernels,
    mats: &[&HostMat],
    bias: &[Option<Vec<f32>>],
    x: &[f32],
    norm: Option<&[f32]>,
    mode: MvMode,
    init: &[f32],
) -> Vec<f32> {
    let dw: Vec<DevWeight> = mats
        .iter()
        .map(|m| DevWeight::upload(dev, &m.w()).unwrap())
        .collect();
    let bias_buf: Vec<Option<_>> = bias
        .iter()
        .map(|b| {
            b.as_ref().map(|b| {
                dev.upload_new(cmf_gpu::cuda::runtime::device::bytes_of(b))
                    .unwrap()
            })
        })
        .collect();
    let segs: Vec<MvSeg> = dw
        .iter()
        .zip(&bias_buf)
        .map(|(w, b)| MvSeg {
            w,
            bias: b.as_ref().map_or(0, |b| b.ptr()),
        })
        .collect();
    let xb = dev
        .upload_new(cmf_gpu::cuda::runtime::device::bytes_of(x))
        .unwrap();
    let nb = norm.map(|n| {
        dev.upload_new(cmf_gpu::cuda::runtime::device::bytes_of(n))
            .unwrap()
    });
    let yb = dev
        .upload_new(cmf_gpu::cuda::runtime::device::bytes_of(init))
        .unwrap();
    matvec::launch(
        dev,
        &ck.matvec,
        &segs,
        xb.ptr(),
        nb.as_ref().map_or(0, |b| b.ptr()),
        1e-6,
        yb.ptr(),
        mode,
        false,
    )
    .unwrap();
    let mut y = vec![0f32; init.len()];
    dev.download_f32(&mut y, yb.ptr()).unwrap();
    y
}

/// Uploads return before their DMA finishes (pinned staging, a ring of two 32 MiB buffers):
/// many back-to-back uploads of mixed sizes (tiny plain ones, small staged ones, pieces that
/// wrap the ring, one larger than both buffers), each source dropped (and its memory reused)
/// as soon as `upload` returns, must all land intact; an upload inside a graph capture is an
/// error, not a silently captured copy.
#[test]
fn staged_uploads_land_intact_without_waits() {
    let Some(b) = backend() else { return };
    let dev = b.device();
    let sizes = [
        3usize,
        5000,
        4096,
        (1 << 20) + 7,
        20 << 20,
        (31 << 20) + 5,
        777,
        (70 << 20) + 3,
        12 << 10,
        (9 << 20) + 1,
    ];
    let fill = |i: usize, n: usize| -> Vec<u8> {
        (0..n)
            .map(|j| ((j as u64 * 2654435761 + i as u64 * 97) >> 7) as u8)
            .collect()
    };
    let bufs: Vec<_> = sizes.iter().map(|&n| dev.alloc(n).unwrap()).collect();
    for round in 0..2 {
        for (i, (buf, &n)) in bufs.iter().zip(&sizes).enumerate() {
            let src = fill(i + 10 * round, n);
            dev.upload(buf.ptr(), &src).unwrap();
            // The next source reuses this allocation's memory at once.
            drop(src);
        }
        for (i, (buf, &n)) in bufs.iter().zip(&sizes).enumerate() {
            let mut got = vec![0u8; n];
            dev.download(&mut got, buf.ptr()).unwrap();
            assert!(
                got == fill(i + 10 * round, n),
                "round {round}, upload {i} ({n} bytes)"
            );
        }
    }
    let err = dev.capture(|| dev.upload(bufs[1].ptr(), &fill(0, sizes[1])));
    assert!(err.is_err(), "an upload inside a capture must be refused");
}

/// `each_parallel` (the model loaders' threads): results in the items' order, uploads from
/// several threads at once land intact, and of two failing items the first one's error is
/// returned.
#[test]
fn loader_threads_keep_order_and_report_the_first_error() {
    use cmf_gpu::cuda::runtime::device::DevError;
    let Some(b) = backend() else { return };
    let dev = b.device();
    let items: Vec<usize> = (0..40).collect();
    let bytes = |i: usize| -> Vec<u8> {
        (0..(i * 37_000 + 5))
            .map(|j| (j as u64 * 2654435761 + i as u64) as u8)
            .collect()
    };
    let bufs = dev
        .each_parallel(&items, Dev::LOADER_THREADS, |&i| dev.upload_new(&bytes(i)))
        .unwrap();
    for (i, buf) in bufs.iter().enumerate() {
        let mut got = vec![0u8; buf.len()];
        dev.download(&mut got, buf.ptr()).unwrap();
        assert!(got == bytes(i), "item {i}");
    }
    let err = dev
        .each_parallel(&items, 3, |&i| match i {
            7 | 30 => Err(DevError(format!("item {i} failed"))),
            _ => Ok(i),
        })
        .map(|_| ())
        .unwrap_err();
    assert_eq!(err.0, "item 7 failed");
}

/// A capture that something else invalidated (here a synchronisation inside it; in the GPU
/// parity tests another thread's implicitly synchronising call) is taken again, and the graph
/// of the second attempt does the work.
#[test]
fn an_invalidated_capture_is_taken_again() {
    let Some(b) = backend() else { return };
    let dev = b.device();
    let buf = dev.alloc(4096).unwrap();
    dev.upload(buf.ptr(), &[7u8; 4096]).unwrap();
    dev.sync().unwrap();
    let calls = std::cell::Cell::new(0);
    let graph = dev
        .capture(|| {
            calls.set(calls.get() + 1);
            if calls.get() == 1 {
                assert!(dev.sync().is_err(), "a sync inside a capture must fail");
            }
            dev.memset0(buf.ptr(), 4096)
        })
        .expect("captured on the second attempt");
    assert_eq!(calls.get(), 2);
    let mut got = vec![1u8; 4096];
    dev.download(&mut got, buf.ptr()).unwrap();
    assert!(
        got.iter().all(|&v| v == 7),
        "nothing captured runs before the launch"
    );
    graph.launch().unwrap();
    dev.download(&mut got, buf.ptr()).unwrap();
    assert!(got.iter().all(|&v| v == 0));
}

#[test]
fn missing_device_is_an_error_not_a_panic() {
    // On a machine without the driver this must return Err; with one, Ok. Never a panic.
    match CudaBackend::open(0) {
        Ok(b) => eprintln!("device: {} ({})", b.info().name, b.info().arch),
        Err(why) => eprintln!("no device: {why}"),
    }
    assert!(CudaBackend::open(10_000).is_err());
}

#[test]
fn matvec_matches_reference_for_every_codec() {
    let Some(b) = backend() else { return };
    let ck = b.kernels().expect("the shared kernels load");
    let (dev, ck) = (b.device(), &*ck);
    let mut rng = Rng::new(1);
    eprintln!(
        "{:<9} {:>6} {:>6} {:>11} {:>11} {:>11} {:>11} {:>11}",
        "codec", "rows", "cols", "plain", "norm+bias", "3 segs", "swiglu", "accumulate"
    );
    for &d in &CODECS {
        for &(rows, cols) in &[(301usize, 1024usize), (64, 96), (1030, 4096)] {
            let k = cols;
            let x = rng.vec(k, 1.0);
            let nan = vec![f32::NAN; rows];
            let a = HostMat::new(d, rows, k, rng.next_u64());
            // plain
            let got = run_matvec(dev, ck, &[&a], &[None], &x, None, MvMode::Store, &nan);
            let e_plain = rel_err(&got, &a.reference(&x));
            // fused RMSNorm + bias
            let norm = rng.vec(k, 1.0);
            let bias = rng.vec(rows, 0.1);
            let mut xn = vec![0f32; k];
            reference::rms_norm(&x, &norm, 1e-6, &mut xn);
            let want: Vec<f32> = a
                .reference(&xn)
                .iter()
                .zip(&bias)
                .map(|(a, b)| a + b)
                .collect();
            let got = run_matvec(
                dev,
                ck,
                &[&a],
                &[Some(bias)],
                &x,
                Some(&norm),
                MvMode::Store,
                &nan,
            );
            let e_norm = rel_err(&got, &want);
            // three segments (q|k|v)
            let b2 = HostMat::new(d, 64, k, rng.next_u64());
            let c2 = HostMat::new(d, 33, k, rng.next_u64());
            let want = [a.reference(&x), b2.reference(&x), c2.reference(&x)].concat();
            let got = run_matvec(
                dev,
                ck,
                &[&a, &b2, &c2],
                &[None, None, None],
                &x,
                None,
                MvMode::Store,
                &vec![f32::NAN; want.len()],
            );
            let e_segs = rel_err(&got, &want);
            // SwiGLU pair
            let up = HostMat::new(d, rows, k, rng.next_u64());
            let want: Vec<f32> = a
                .reference(&x)
                .iter()
                .zip(up.reference(&x))
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let got = run_matvec(
                dev,
                ck,
                &[&a, &up],
                &[None, None],
                &x,
                None,
                MvMode::SwiGlu,
                &nan,
            );
            let e_swiglu = rel_err(&got, &want);
            // accumulate (residual)
            let init = rng.vec(rows, 1.0);
            let want: Vec<f32> = a
                .reference(&x)
                .iter()
                .zip(&init)
                .map(|(a, b)| a + b)
                .collect();
            let got = run_matvec(dev, ck, &[&a], &[None], &x, None, MvMode::Accumulate, &init);
            let e_acc = rel_err(&got, &want);
            eprintln!("{:<9} {rows:>6} {cols:>6} {e_plain:>11.2e} {e_norm:>11.2e} {e_segs:>11.2e} {e_swiglu:>11.2e} {e_acc:>11.2e}", d.name());
            for (what, e) in [
                ("plain", e_plain),
                ("norm+bias", e_norm),
                ("segments", e_segs),
                ("swiglu", e_swiglu),
                ("accumulate", e_acc),
            ] {
                assert!(
                    e < matvec_tol(d),
                    "{d} {rows}x{cols} {what}: rel err {e:.3e}"
                );
            }
        }
    }
}

fn tiny_spec(head_dim: usize, window: Option<usize>) -> LlmSpec {
    let mut s = qwen3_spec(256, 512, 3, 8, 2, head_dim, 300);
    s.sliding_window[1] = window;
    s
}

fn load(b: &CudaBackend, model: &LlmModel, opts: &LlmOptions) -> CudaLlm {
    b.load_cuda_llm(model, opts, &Placement::all(model.spec.num_layers))
        .unwrap()
}

/// How a test sets up the loaded model before [`compare_model`] runs it.
#[derive(Clone, Copy, Default)]
struct Setup {
    /// Decode-attention tuning (the defaults unless set).
    tuning: DecodeTuning,
    /// The prefill attention kernel (fa2 where it applies unless set).
    attn: Option<AttnKernel>,
    /// The short-context decode attention (staged where it fits unless set).
    short: Option<ShortDecode>,
}

/// Teacher-forced run: prefill `prompt`, then decode `steps` tokens feeding the reference's
/// greedy choice to both; returns (max logits rel err, steps where argmax differed).
fn compare_model(
    b: &CudaBackend,
    m: &SynthModel,
    opts: &LlmOptions,
    prompt: &[u32],
    steps: usize,
    setup: Setup,
) -> (f64, f64, usize) {
    let model = m.model();
    let placement = Placement::all(model.spec.num_layers);
    let mut dev = b
        .load_cuda_llm_tuned(&model, opts, &placement, setup.tuning)
        .unwrap();
    if let Some(attn) = setup.attn {
        dev.set_attention(attn);
    }
    if let Some(short) = setup.short {
        dev.set_short_decode(short);
    }
    let mut cache = RefCache::new(model.spec.num_layers);
    let v = model.spec.vocab;
    // Prefill: all positions' logits against the reference.
    let mut got = vec![f32::NAN; prompt.len() * v];
    dev.prefill(prompt, 0, Logits::All, &mut got).unwrap();
    let mut e_prefill = 0f64;
    let mut last = Vec::new();
    for (p, &t) in prompt.iter().enumerate() {
        last = reference::forward_token(&model, t, p, &mut cache);
        e_prefill = e_prefill.max(rel_err(&got[p * v..(p + 1) * v], &last));
    }
    let mut e_decode = 0f64;
    let mut mismatches = 0;
    let mut tok = reference::argmax(&last);
    for i in 0..steps {
        let pos = prompt.len() + i;
        let mut out = DecodeOutput::default();
        dev.decode(tok, pos, &Sampler::Greedy, true, &mut out)
            .unwrap();
        let want = reference::forward_token(&model, tok, pos, &mut cache);
        e_decode = e_decode.max(rel_err(&out.logits, &want));
        let ref_tok = reference::argmax(&want);
        if out.token != ref_tok {
            mismatches += 1;
        }
        tok = ref_tok;
    }
    (e_prefill, e_decode, mismatches)
}

#[test]
fn whole_model_matches_reference() {
    let Some(b) = backend() else { return };
    eprintln!(
        "{:<7} {:>3} {:>5} {:>6} {:>11} {:>11} {:>9}",
        "codec", "hd", "tied", "bias", "prefill", "decode", "argmax≠"
    );
    let prompt: Vec<u32> = (0..37).map(|i| (i * 7 + 3) % 300).collect();
    for &(d, hd, tied, bias) in &[
        (Dtype::F32, 64, false, false),
        (Dtype::F32, 16, false, true),
        (Dtype::Bf16, 16, true, false),
        (Dtype::F32, 128, true, true),
        (Dtype::F16, 64, true, false),
        (Dtype::Bf16, 128, false, false),
        (Dtype::Q8Row, 128, false, true),
        (Dtype::Q8_2f, 64, false, false),
        (Dtype::Q4Block, 128, true, false),
        (Dtype::Q4Tiled, 64, false, false),
    ] {
        let opts = SynthOptions {
            qk_norm: !bias,
            qkv_bias: bias,
            tied,
        };
        let m = SynthModel::new(tiny_spec(hd, Some(20)), d, opts, 42 + hd as u64);
        let (ep, ed, mis) = compare_model(
            &b,
            &m,
            &LlmOptions {
                max_context: 256,
                ..Default::default()
            },
            &prompt,
            24,
            Setup::default(),
        );
        eprintln!(
            "{:<7} {hd:>3} {tied:>5} {bias:>6} {ep:>11.2e} {ed:>11.2e} {mis:>9}",
            d.name()
        );
        let exact = matches!(d, Dtype::F32 | Dtype::F16);
        let tol = if exact { 1e-4 } else { 6e-2 };
        assert!(
            ep < tol && ed < tol,
            "{d} hd {hd}: prefill {ep:.2e} decode {ed:.2e}"
        );
        if exact {
            assert_eq!(mis, 0, "{d}: greedy tokens differ from the reference");
        }
    }
}

#[test]
fn chunked_prefill_and_split_attention_at_long_context() {
    let Some(b) = backend() else { return };
    // bf16 weights → f16 KV cache → tensor-core prefill attention; 3 chunks of 128 with a
    // sliding-window layer; decode then runs split-K over ~400 positions. Both prefill
    // attention kernels (the fallback forced where fa2 applies).
    let m = SynthModel::new(
        tiny_spec(128, Some(100)),
        Dtype::Bf16,
        SynthOptions::QWEN3,
        7,
    );
    let prompt: Vec<u32> = (0..380).map(|i| (i * 13 + 1) % 300).collect();
    let opts = LlmOptions {
        max_context: 1024,
        kv: KvPrecision::Auto,
        prefill_chunk: 128,
        ..Default::default()
    };
    for attn in [AttnKernel::Fa2, AttnKernel::Simple] {
        let setup = Setup {
            attn: Some(attn),
            ..Setup::default()
        };
        let (ep, ed, mis) = compare_model(&b, &m, &opts, &prompt, 16, setup);
        eprintln!(
            "long context bf16, f16 KV, {attn:?}: prefill {ep:.2e} decode {ed:.2e} argmax≠ {mis}"
        );
        assert!(ep < 6e-2 && ed < 6e-2, "{attn:?}");
    }
    // Many small decode splits (16 keys at least: ~25 per kv head here) through the merge of
    // the last block (the default, 128, gives four).
    let setup = Setup {
        tuning: DecodeTuning { min_chunk: 16 },
        ..Setup::default()
    };
    let (ep, ed, mis) = compare_model(&b, &m, &opts, &prompt, 8, setup);
    eprintln!("long context bf16, f16 KV, decode splits of 16 keys: prefill {ep:.2e} decode {ed:.2e} argmax≠ {mis}");
    assert!(ep < 6e-2 && ed < 6e-2, "small decode splits");
    let opts = LlmOptions {
        kv: KvPrecision::F32,
        ..opts
    };
    let (ep2, ed2, _) = compare_model(&b, &m, &opts, &prompt, 4, Setup::default());
    eprintln!("long context bf16, f32 KV (simple attention): prefill {ep2:.2e} decode {ed2:.2e}");
    assert!(ep2 < 6e-2 && ed2 < 6e-2);
}

#[test]
fn short_context_decode_graphs_match_reference_across_the_switch() {
    let Some(b) = backend() else { return };
    // Below DEC_ONE_BLOCK (256) keys decode runs a second graph with one attention block per kv
    // head (K/V staged in shared memory by default); from position 256 on, the split-K graph.
    // Decode from 250 crosses the switch; both modes, with a sliding-window layer, q8 and bf16
    // weights (f16 KV) and f16 weights (f32 KV: too large to stage at head_dim 128, so `Grid`).
    let below = cmf_gpu::cuda::llm::DEC_ONE_BLOCK - 6;
    let prompt: Vec<u32> = (0..below as u32).map(|i| (i * 17 + 2) % 300).collect();
    let opts = LlmOptions {
        max_context: 512,
        prefill_chunk: 128,
        ..Default::default()
    };
    for (d, hd) in [(Dtype::Q8Row, 128), (Dtype::Bf16, 64), (Dtype::F16, 128)] {
        let m = SynthModel::new(tiny_spec(hd, Some(100)), d, SynthOptions::QWEN3, 11);
        for mode in [ShortDecode::Grid, ShortDecode::Staged] {
            let setup = Setup {
                short: Some(mode),
                ..Setup::default()
            };
            let (ep, ed, mis) = compare_model(&b, &m, &opts, &prompt, 12, setup);
            eprintln!(
                "{d} hd {hd}, short decode {mode:?}: prefill {ep:.2e} decode {ed:.2e} argmax≠ {mis}"
            );
            let exact = d == Dtype::F16;
            let tol = if exact { 1e-4 } else { 6e-2 };
            assert!(
                ep < tol && ed < tol,
                "{d} hd {hd} {mode:?}: decode {ed:.2e}"
            );
            if exact {
                assert_eq!(
                    mis, 0,
                    "{d} {mode:?}: greedy tokens differ from the reference"
                );
            }
        }
    }
}

#[test]
fn precise_mode_is_exact_for_bf16_weights() {
    let Some(b) = backend() else { return };
    // bf16 weights are exact in f32; with f32 prefill GEMMs and an f32 cache every operation
    // is f32, so the logits match the reference as closely as an f32 model's.
    let m = SynthModel::new(
        tiny_spec(64, Some(20)),
        Dtype::Bf16,
        SynthOptions::QWEN3,
        21,
    );
    let prompt: Vec<u32> = (0..41).map(|i| (i * 11 + 5) % 300).collect();
    let opts = LlmOptions {
        max_context: 256,
        prefill_chunk: 32,
        precise: true,
        ..Default::default()
    };
    let (ep, ed, mis) = compare_model(&b, &m, &opts, &prompt, 16, Setup::default());
    eprintln!("bf16 precise: prefill {ep:.2e} decode {ed:.2e} argmax≠ {mis}");
    assert!(ep < 1e-4 && ed < 1e-4);
    assert_eq!(mis, 0);
}

/// Greedy generation as a caller does it: device first, CPU reference after a refusal.
fn generate(gpu: &Gpu, model: &LlmModel, prompt: &[u32], steps: usize) -> (Vec<u32>, usize) {
    let mut dev = gpu
        .load_llm(
            model,
            &LlmOptions {
                max_context: 128,
                ..Default::default()
            },
            None,
        )
        .ok();
    assert!(dev.is_some(), "model should load on the device");
    let mut tokens = prompt.to_vec();
    let mut logits = vec![0f32; model.spec.vocab];
    let mut next = match dev
        .as_mut()
        .unwrap()
        .prefill(prompt, 0, Logits::Last, &mut logits)
    {
        Ok(()) => reference::argmax(&logits),
        Err(_) => panic!("prefill refused"),
    };
    let mut refusals = 0;
    let mut cpu: Option<RefCache> = None;
    for _ in 0..steps {
        tokens.push(next);
        let pos = tokens.len() - 1;
        if let Some(d) = dev.as_mut() {
            let mut out = DecodeOutput {
                token: 0xDEAD,
                logits: vec![1.0],
            };
            match d.decode(next, pos, &Sampler::Greedy, false, &mut out) {
                Ok(()) => {
                    next = out.token;
                    continue;
                }
                Err(_) => {
                    assert_eq!(
                        out,
                        DecodeOutput {
                            token: 0xDEAD,
                            logits: vec![1.0]
                        },
                        "refusal touched the output"
                    );
                    refusals += 1;
                    dev = None;
                }
            }
        }
        let c = cpu.get_or_insert_with(|| {
            let mut c = RefCache::new(model.spec.num_layers);
            for (p, &t) in tokens[..pos].iter().enumerate() {
                reference::forward_token(model, t, p, &mut c);
            }
            c
        });
        next = reference::argmax(&reference::forward_token(model, next, pos, c));
    }
    (tokens, refusals)
}

#[test]
fn forced_refusal_mid_run_leaves_outputs_and_matches_cpu() {
    let Some(b) = backend() else { return };
    let m = SynthModel::new(tiny_spec(64, None), Dtype::F32, SynthOptions::QWEN3, 3);
    let model = m.model();
    let prompt = [5u32, 17, 29, 41];
    let mut cache = RefCache::new(3);
    let mut cpu_tokens = prompt.to_vec();
    let mut l = Vec::new();
    for (p, &t) in prompt.iter().enumerate() {
        l = reference::forward_token(&model, t, p, &mut cache);
    }
    for _ in 0..12 {
        let t = reference::argmax(&l);
        cpu_tokens.push(t);
        l = reference::forward_token(&model, t, cpu_tokens.len() - 1, &mut cache);
    }
    let gpu = Gpu::with_backend(GpuMode::Cuda, b.clone());
    let (all_dev, r0) = generate(&gpu, &model, &prompt, 12);
    assert_eq!(r0, 0);
    gpu.inject_refusal_after(6); // load, prefill, 4 decodes, then refuse
    let (mixed, r1) = generate(&gpu, &model, &prompt, 12);
    gpu.inject_refusal_after(u64::MAX);
    assert_eq!(r1, 1);
    assert_eq!(all_dev, cpu_tokens);
    assert_eq!(mixed, cpu_tokens);
}

#[test]
fn steady_state_decode_uploads_nothing() {
    let Some(b) = backend() else { return };
    let m = SynthModel::new(tiny_spec(64, None), Dtype::Q8Row, SynthOptions::QWEN3, 9);
    let mut dev = load(
        &b,
        &m.model(),
        &LlmOptions {
            max_context: 128,
            ..Default::default()
        },
    );
    let mut out = DecodeOutput::default();
    dev.decode(1, 0, &Sampler::Greedy, false, &mut out).unwrap();
    let before = b.stats().uploaded();
    let mut tok = out.token;
    for pos in 1..40 {
        dev.decode(tok, pos, &Sampler::Greedy, false, &mut out)
            .unwrap();
        tok = out.token;
    }
    assert_eq!(b.stats().uploaded(), before, "decode window uploaded bytes");
}

/// The device sampler draws what the host's algorithm (`cmf_gpu::llm::sample`) draws from the
/// same logits: every option (penalties over a prefilled window, temperature, top-k, top-p
/// within the 64 best and past them, min-p), many seeds. A token whose weight sits on a cut or
/// a draw between two tokens may differ by the device's `expf` rounding: at most one in the run.
#[test]
fn device_sampler_matches_the_host_algorithm() {
    use cmf_gpu::llm::sample::{sample, SampleSpec};
    let Some(b) = backend() else { return };
    let m = SynthModel::new(tiny_spec(64, None), Dtype::F32, SynthOptions::QWEN3, 5);
    let model = m.model();
    let mut dev = load(
        &b,
        &model,
        &LlmOptions {
            max_context: 64,
            ..Default::default()
        },
    );
    let prompt = [3u32, 5, 3, 9, 3];
    let mut none = Vec::new();
    dev.prefill(&prompt[..4], 0, Logits::None, &mut none)
        .unwrap();
    let mut raw = DecodeOutput::default();
    dev.decode(prompt[4], 4, &Sampler::Greedy, true, &mut raw)
        .unwrap();
    let base = SampleSpec::default();
    let specs = [
        SampleSpec {
            temperature: 1.0,
            ..base
        },
        SampleSpec {
            temperature: 2.0,
            top_k: 5,
            ..base
        },
        SampleSpec {
            temperature: 0.7,
            top_p: 0.9,
            ..base
        },
        SampleSpec {
            temperature: 4.0,
            top_p: 0.95,
            ..base
        }, // the nucleus passes the 64 best
        SampleSpec {
            temperature: 3.0,
            top_p: 0.6,
            min_p: 0.05,
            ..base
        },
        SampleSpec {
            temperature: 1.5,
            top_k: 40,
            top_p: 0.8,
            ..base
        },
        SampleSpec {
            temperature: 1.0,
            repeat_penalty: 1.3,
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            penalty_last_n: 4,
            ..base
        },
        SampleSpec {
            temperature: 0.0,
            repeat_penalty: 5.0,
            penalty_last_n: 64,
            ..base
        },
    ];
    let (mut runs, mut differ) = (0, Vec::new());
    let mut seen = std::collections::HashSet::new();
    for spec in specs {
        for seed in 0..24u64 {
            let spec = SampleSpec { seed, ..spec };
            let n = spec.penalty_last_n.min(prompt.len());
            let want = sample(
                &mut raw.logits.clone(),
                &prompt[prompt.len() - n..],
                &spec,
                4,
            );
            let mut out = DecodeOutput::default();
            dev.decode(prompt[4], 4, &Sampler::Sample(spec), false, &mut out)
                .unwrap();
            runs += 1;
            if out.token != want {
                differ.push((spec, out.token, want));
            }
            seen.insert(out.token);
        }
    }
    assert!(
        differ.len() <= 1,
        "{} of {runs} draws differ: {differ:?}",
        differ.len()
    );
    assert!(seen.len() > 20, "draws are not spread: {seen:?}");
}

/// Greedy decode with a caller that sometimes does not feed the sampled token back (`forced`:
/// step → token) or wants logits (`logits_at`); returns the fed tokens and the logits asked for.
fn decode_run(
    dev: &mut CudaLlm,
    v: usize,
    prompt: &[u32],
    last: usize,
    forced: &[(usize, u32)],
    logits_at: &[usize],
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut l = vec![0f32; v];
    dev.prefill(prompt, 0, Logits::Last, &mut l).unwrap();
    let mut fed = prompt.to_vec();
    let mut next = reference::argmax(&l);
    let mut got_logits = Vec::new();
    for pos in prompt.len()..=last {
        if let Some(&(_, t)) = forced.iter().find(|(p, _)| *p == pos) {
            next = t;
        }
        fed.push(next);
        let want = logits_at.contains(&pos);
        let mut out = DecodeOutput::default();
        dev.decode(next, pos, &Sampler::Greedy, want, &mut out)
            .unwrap();
        if want {
            got_logits.push(out.logits);
        }
        next = out.token;
    }
    fed.push(next);
    (fed, got_logits)
}

#[test]
fn decode_ahead_matches_step_by_step_and_the_reference() {
    let Some(b) = backend() else { return };
    // The graph for position p + 1 is launched before the token of p is read; a caller that
    // feeds another token, asks for logits, or stops at the context's end must see exactly what
    // step-by-step decoding gives. f32 weights: greedy tokens equal the CPU reference's.
    let m = SynthModel::new(tiny_spec(64, None), Dtype::F32, SynthOptions::QWEN3, 31);
    let model = m.model();
    let opts = LlmOptions {
        max_context: 48,
        ..Default::default()
    };
    let prompt = [3u32, 141, 59, 26, 5];
    let forced = [(17, 7u32), (18, 7), (30, 299)];
    let logits_at = [12, 31, 47];
    let mut runs = Vec::new();
    for ahead in [true, false] {
        let mut dev = load(&b, &model, &opts);
        dev.set_decode_ahead(ahead);
        runs.push(decode_run(
            &mut dev,
            model.spec.vocab,
            &prompt,
            47,
            &forced,
            &logits_at,
        ));
    }
    assert_eq!(runs[0].0, runs[1].0, "tokens differ with decode-ahead on");
    assert_eq!(runs[0].1, runs[1].1, "logits differ with decode-ahead on");
    // The CPU reference fed the same tokens.
    let mut cache = RefCache::new(model.spec.num_layers);
    let fed = &runs[0].0;
    let mut want_logits = Vec::new();
    for pos in 0..fed.len() - 1 {
        let l = reference::forward_token(&model, fed[pos], pos, &mut cache);
        let forced_next = forced.iter().any(|(p, _)| *p == pos + 1);
        if pos >= prompt.len() - 1 && !forced_next {
            assert_eq!(
                fed[pos + 1],
                reference::argmax(&l),
                "greedy token at {}",
                pos + 1
            );
        }
        if logits_at.contains(&pos) {
            want_logits.push(l);
        }
    }
    for (g, w) in runs[0].1.iter().zip(&want_logits) {
        assert!(rel_err(g, w) < 1e-4, "logits rel err {:.2e}", rel_err(g, w));
    }
}

#[test]
fn hybrid_layers_match_reference() {
    let Some(b) = backend() else { return };
    let m = SynthModel::new(tiny_spec(64, None), Dtype::F32, SynthOptions::QWEN3, 13);
    let model = m.model();
    let set = LayerSet::parse("0,2", "--gpu-layers").unwrap();
    let placement = Placement::plan(&[1; 3], 1, 0, u64::MAX, Some(&set)).unwrap();
    let mut dev = b
        .load_cuda_llm(
            &model,
            &LlmOptions {
                max_context: 64,
                ..Default::default()
            },
            &placement,
        )
        .unwrap();
    let mut cache = RefCache::new(3);
    let mut cpu_cache = RefCache::new(3);
    let tokens = [3u32, 9, 27, 81, 243];
    // A batched step (t = 4) then single tokens.
    let want: Vec<Vec<f32>> = tokens
        .iter()
        .enumerate()
        .map(|(p, &t)| reference::forward_token(&model, t, p, &mut cache))
        .collect();
    let run = |dev: &mut cmf_gpu::cuda::llm::CudaLlm,
               cpu_cache: &mut RefCache,
               toks: &[u32],
               start: usize|
     -> Vec<Vec<f32>> {
        let h = model.spec.hidden;
        let mut x: Vec<f32> = toks
            .iter()
            .flat_map(|&t| reference::embed(&model, t))
            .collect();
        dev.forward_layers(0..1, &mut x, toks.len(), start).unwrap();
        for (i, row) in x.chunks_mut(h).enumerate() {
            reference::layer(&model, 1, row, start + i, cpu_cache);
        }
        dev.forward_layers(2..3, &mut x, toks.len(), start).unwrap();
        x.chunks(h).map(|r| reference::head(&model, r)).collect()
    };
    let mut got = run(&mut dev, &mut cpu_cache, &tokens[..4], 0);
    got.extend(run(&mut dev, &mut cpu_cache, &tokens[4..], 4));
    for (p, (g, w)) in got.iter().zip(&want).enumerate() {
        let e = rel_err(g, w);
        assert!(e < 1e-4, "position {p}: rel err {e:.2e}");
    }
    // The head is not resident in a split placement: refused, buffer untouched.
    let mut logits = vec![f32::NAN; model.spec.vocab];
    assert!(dev
        .head(&vec![0.0; model.spec.hidden], 1, &mut logits)
        .is_err());
    assert!(logits.iter().all(|v| v.is_nan()));
}

/// f64 reference of the DiT's non-causal attention on f16-rounded inputs: q `[t, nh, hd]`,
/// k/v `[nh, t, hd]`; out `[t, nh · hd]`.
fn full_attention_reference(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    t: usize,
    nh: usize,
    hd: usize,
) -> Vec<f32> {
    let r16 = |x: f32| half::f16::from_f32(x).to_f64();
    let scale = 1.0 / (hd as f64).sqrt();
    let mut out = vec![0f32; t * nh * hd];
    let mut s = vec![0f64; t];
    for h in 0..nh {
        for i in 0..t {
            let qi = &q[(i * nh + h) * hd..][..hd];
            let mut mx = f64::NEG_INFINITY;
            for (j, sj) in s.iter_mut().enumerate() {
                let kj = &k[(h * t + j) * hd..][..hd];
                *sj = qi
                    .iter()
                    .zip(kj)
                    .map(|(&a, &b)| r16(a) * r16(b))
                    .sum::<f64>()
                    * scale;
                mx = mx.max(*sj);
            }
            let mut den = 0.0;
            for sj in s.iter_mut() {
                *sj = (*sj - mx).exp();
                den += *sj;
            }
            for d in 0..hd {
                let acc: f64 = (0..t).map(|j| s[j] * r16(v[(h * t + j) * hd + d])).sum();
                out[(i * nh + h) * hd + d] = (acc / den) as f32;
            }
        }
    }
    out
}

/// Random DiT attention inputs of `n` values each: q scaled by `spread` (how peaked the scores
/// get), k and v as the attention tests use them.
fn random_qkv(seed: u64, n: usize, spread: f32) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut rng = Rng::new(seed);
    let q = rng.vec(n, spread * 1.7);
    let k = rng.vec(n, 1.7);
    let v = rng.vec(n, 1.0);
    (q, k, v)
}

/// Both DiT attention kernels (`ws` on Hopper, `base` everywhere) against the f64 reference, on lengths
/// that leave partial query and key tiles, with flat and peaked score distributions; `+split`:
/// half of the tiles run as two halves of their keys, merged (the tail split; lengths of one key
/// tile split none).
/// Tolerance 1e-2: the kernels round q and the probabilities to f16 and write bf16 (2⁻⁹).
#[test]
fn dit_attention_variants_match_reference() {
    let Some(b) = backend() else { return };
    let (nh, hd) = (3usize, 128usize);
    // 176 and 352: whole key tiles of `ws` (no tail); 177: a one-key tail; 1100: 7 tiles,
    // each slot's barriers reused over several phases.
    for (t, spread) in [
        (77usize, 1.0f32),
        (176, 2.0),
        (177, 1.0),
        (300, 3.0),
        (352, 1.0),
        (1100, 1.0),
        (1100, 4.0),
    ] {
        let (q, k, v) = random_qkv(t as u64 * 31 + spread as u64, t * nh * hd, spread);
        let want = full_attention_reference(&q, &k, &v, t, nh, hd);
        for variant in ["base", "ws", "ws+split"] {
            let got =
                cmf_gpu::cuda::dit::attention_for_test(b.device(), variant, &q, &k, &v, t, nh)
                    .unwrap_or_else(|e| panic!("{variant}: {e:?}"));
            let err = rel_err(&got, &want);
            eprintln!("dit attention {variant:>5} t {t:>4} spread {spread}: rel err {err:.2e}");
            assert!(err < 1e-2, "{variant} t {t}: rel err {err}");
        }
    }
}

/// e4m3 rounding as the device's `cvt.rn.satfinite.e4m3x2.f32` does it: 3 mantissa bits,
/// nearest-even, subnormal steps of 2⁻⁹ below 2⁻⁶, saturating at ±448.
fn e4m3(x: f32) -> f32 {
    let a = x.abs();
    let e = if a < 2f32.powi(-6) {
        -6
    } else {
        a.log2().floor() as i32
    };
    let step = 2f32.powi(e - 3);
    ((a / step).round_ties_even() * step).min(448.0).copysign(x)
}

/// `x` (chunks of `n` values share a scale: their amax / 448) quantised to e4m3 and back.
fn e4m3_scaled(x: &[f32], n: usize) -> Vec<f32> {
    x.chunks(n)
        .flat_map(|c| {
            let amax = c.iter().fold(0f32, |m, v| m.max(v.abs()));
            let s = if amax > 0.0 { amax / 448.0 } else { 1.0 };
            let inv = 1.0 / s;
            c.iter()
                .map(move |&v| e4m3(v * inv) * s)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The FP8 DiT attention (`ws8`, attn_full_ws8) against the f64 reference on the values it
/// quantised: Q per row and head, K over all heads, V per head (of their f16 values), all rounded
/// to e4m3 here as the device rounds them. What is left is the probabilities' own e4m3 rounding
/// (3 mantissa bits, ~2.5 % RMS per probability, averaged by the sum over keys) and the bf16
/// output: bound 3e-2. `ws8q` writes e4m3 rows with one scale (the largest V maximum / 448),
/// read back with the scales it wrote: its own rounding adds ~3.6 % RMS (uniform in ±2⁻⁴),
/// bound 6e-2 (`+split`: half of the tiles as two merged halves of their keys, the same bounds).
/// A layout mistake (the Vᵀ key order, a scale, a row's scale) gives errors of
/// order one. Against the unquantised inputs the error is printed, not bounded (it grows with how
/// peaked the scores are; the image criterion of the FP8 path is PSNR against bf16, gpu_dit.rs).
#[test]
fn dit_fp8_attention_matches_reference_on_its_quantised_inputs() {
    let Some(b) = backend() else { return };
    if b.device().arch_specific().is_none() {
        gpu_skip::skip_unsupported("attn_full_ws8 needs sm_90a");
        return;
    }
    let (nh, hd) = (3usize, 128usize);
    for (t, spread) in [
        (77usize, 1.0f32),
        (128, 2.0),
        (300, 1.0),
        (1100, 1.0),
        (1100, 3.0),
    ] {
        let (q, k, v) = random_qkv(t as u64 * 37 + spread as u64, t * nh * hd, spread);
        let r16 = |x: &[f32]| -> Vec<f32> {
            x.iter().map(|&a| half::f16::from_f32(a).to_f32()).collect()
        };
        let (qq, kq, vq) = (
            e4m3_scaled(&q, hd),
            e4m3_scaled(&r16(&k), t * hd * nh),
            e4m3_scaled(&r16(&v), t * hd),
        );
        let want_q = full_attention_reference(&qq, &kq, &vq, t, nh, hd);
        let want = full_attention_reference(&q, &k, &v, t, nh, hd);
        for (variant, bound) in [
            ("ws8", 3e-2),
            ("ws8q", 6e-2),
            ("ws8+split", 3e-2),
            ("ws8q+split", 6e-2),
        ] {
            let got =
                cmf_gpu::cuda::dit::attention_for_test(b.device(), variant, &q, &k, &v, t, nh)
                    .unwrap_or_else(|e| panic!("{variant}: {e:?}"));
            let (eq, e) = (rel_err(&got, &want_q), rel_err(&got, &want));
            eprintln!(
                "dit attention {variant} t {t:>4} spread {spread}: rel err {eq:.2e} (quantised inputs), {e:.2e} (exact inputs)"
            );
            assert!(eq < bound, "{variant} t {t} spread {spread}: rel err {eq}");
        }
    }
}

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
