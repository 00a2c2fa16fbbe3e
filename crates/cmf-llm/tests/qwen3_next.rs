//! Qwen3-Next (GatedDeltaNet + gated attention) against transformers' pure-torch path on the
//! committed `qwen3next-dense-tiny` and `qwen3next-tiny` (MoE) fixtures
//! (`scripts/make_llm_fixtures.py`): whole-model f32 logits within 1e-4 relative and greedy identical, each layer's residual stream and each GDN
//! layer's recurrent state after the prompt; then the engine against itself: chunked prefill of a
//! 600-token prompt equals token-by-token decoding (logits and state), a state cannot be rewound;
//! the device description (cmf-gpu's reference) equals the CPU model, the single-sequence engine
//! runs the family on the (fake) device and falls back cleanly, the batched engine declines it.

mod common;
use cmf_gpu::facade::fake::FakeBackend;
use cmf_gpu::facade::{Gpu, GpuMode};
use cmf_llm::gpu::{cpu_only, describe, GpuModel, HYBRID_ON_CPU};
use cmf_llm::model::{Mixer, State};
use cmf_llm::{Model, ModelConfig};
use common::*;
use safetensors::SafeTensors;
use std::sync::atomic::Ordering;
use std::sync::Arc;

const DENSE: &str = "qwen3next-dense-tiny";
const MOE: &str = "qwen3next-tiny";
const TOL: f32 = 1e-4;

fn config(name: &str) -> ModelConfig {
    ModelConfig::from_json(&read_json(fixture_dir(name).join("config.json"))).unwrap()
}

/// A named f32 tensor of the fixture's `expected.safetensors`, flattened.
fn expected(name: &str, tensor: &str) -> Vec<f32> {
    let bytes = std::fs::read(fixture_dir(name).join("expected.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(tensor).unwrap();
    t.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

#[test]
fn config_reads_the_hybrid_geometry() {
    let c = config(DENSE);
    use Mixer::*;
    assert_eq!(
        c.mixers,
        [GatedDeltaNet, GatedDeltaNet, GatedDeltaNet, Attention]
    );
    let g = c.gdn.unwrap();
    assert_eq!(
        (g.num_k_heads, g.num_v_heads, g.k_head_dim, g.v_head_dim),
        (2, 4, 16, 24)
    );
    assert_eq!((g.conv_kernel, g.conv_dim()), (4, 160));
    assert_eq!(
        c.rope.rotary_dim, 8,
        "partial_rotary_factor 0.25 of head_dim 32"
    );
    assert!(c.attn_output_gate);
    assert_eq!(c.norm_style, cmf_kernels::NormStyle::OnePlus);
}

#[test]
fn dense_fixture_matches_transformers() {
    let dir = fixture_dir(DENSE);
    let files = read_weight_files(&dir);
    let source = SafetensorsSource::new(&files);
    let model = Model::from_source(&source, config(DENSE), "").unwrap();
    let c = compare(&model, DENSE);
    println!(
        "{DENSE}: prompt logits {:.2e}, decode logits {:.2e}",
        c.prompt_err, c.decode_err
    );
    assert!(c.prompt_err < TOL && c.decode_err < TOL, "{c:?}");
    assert_eq!(c.greedy, c.want_greedy, "greedy continuation differs");
}

/// The same hybrid with every feed-forward a sparse MoE block with a gated shared expert.
#[test]
fn moe_fixture_matches_transformers() {
    let dir = fixture_dir(MOE);
    let files = read_weight_files(&dir);
    let source = SafetensorsSource::new(&files);
    let model = Model::from_source(&source, config(MOE), "").unwrap();
    assert!(model.config.moe.is_some());
    let c = compare(&model, MOE);
    println!(
        "{MOE}: prompt logits {:.2e}, decode logits {:.2e}",
        c.prompt_err, c.decode_err
    );
    assert!(c.prompt_err < TOL && c.decode_err < TOL, "{c:?}");
    assert_eq!(c.greedy, c.want_greedy, "greedy continuation differs");
}

/// Each layer's output (transformers `output_hidden_states`) and each GDN layer's delta and conv
/// state after the prompt: a wrong mixer shows up at its own layer.
#[test]
fn layers_and_recurrent_state_match_transformers() {
    let dir = fixture_dir(DENSE);
    let files = read_weight_files(&dir);
    let source = SafetensorsSource::new(&files);
    let model = Model::from_source(&source, config(DENSE), "").unwrap();
    let prompt = ids(&read_json(dir.join("expected.json"))["prompt_ids"]);
    let (h, n) = (model.config.hidden_size, prompt.len());
    let want = expected(DENSE, "hidden_states");
    // The last entry has the final norm applied: the logits test covers it.
    for k in 1..model.config.num_layers {
        let got = model.hidden_states(&prompt, k).unwrap();
        let w = &want[k * n * h..(k + 1) * n * h];
        let err = max_abs_diff(&got, w) / w.iter().fold(0f32, |m, v| m.max(v.abs()));
        println!("layer {k}: residual rel err {err:.2e}");
        assert!(
            err < TOL,
            "layer {} ({:?}): {err}",
            k - 1,
            model.config.mixers[k - 1]
        );
    }
    let mut st = model.new_state(256).unwrap();
    model.prefill(&mut st, &prompt).unwrap();
    for l in 0..model.config.num_layers {
        let Some(s) = st.gdn_state(l) else {
            assert_eq!(model.config.mixers[l], Mixer::Attention);
            continue;
        };
        let (delta, conv) = (
            expected(DENSE, &format!("gdn_state.{l}")),
            expected(DENSE, &format!("conv_state.{l}")),
        );
        let scale = delta.iter().fold(0f32, |m, v| m.max(v.abs()));
        let err = max_abs_diff(s.delta(), &delta) / scale;
        println!("layer {l}: delta state rel err {err:.2e}");
        assert!(err < TOL, "layer {l} delta state: {err}");
        assert!(max_abs_diff(s.conv(), &conv) < 1e-5, "layer {l} conv state");
    }
}

/// The fixture model with room for `positions` tokens (its config allows 256).
fn long_model<'a>(source: &SafetensorsSource<'a>, positions: usize) -> Model<'a> {
    let mut cfg = config(DENSE);
    cfg.max_position_embeddings = positions;
    Model::from_source(source, cfg, "").unwrap()
}

fn states(model: &Model, st: &State) -> Vec<f32> {
    (0..model.config.num_layers)
        .filter_map(|l| st.gdn_state(l))
        .flat_map(|s| s.delta().iter().chain(s.conv()).copied())
        .collect()
}

/// A 600-token prompt through chunked prefill (256-row passes, 64-row GDN chunks) gives the
/// logits and the recurrent state of decoding the same tokens one at a time.
#[test]
fn chunked_prefill_equals_token_by_token_decode() {
    let dir = fixture_dir(DENSE);
    let files = read_weight_files(&dir);
    let source = SafetensorsSource::new(&files);
    let model = long_model(&source, 700);
    let vocab = model.config.vocab_size;
    let prompt: Vec<u32> = (0..600u32).map(|i| 3 + (i * 7919 + 13) % 509).collect();

    let mut a = model.new_state(700).unwrap();
    let mut scored = vec![0f32; prompt.len() * vocab];
    model
        .forward_scored(&mut a, &prompt, 0, |i, l| {
            scored[i * vocab..(i + 1) * vocab].copy_from_slice(l)
        })
        .unwrap();
    let mut b = model.new_state(700).unwrap();
    let mut worst = 0f32;
    for (i, &t) in prompt.iter().enumerate() {
        let got = model.decode(&mut b, t).unwrap();
        worst = worst.max(rel_err(got, &scored[i * vocab..(i + 1) * vocab]));
    }
    println!("600 tokens: decode vs chunked prefill logits rel err {worst:.2e}");
    assert!(worst < TOL, "{worst}");
    let (sa, sb) = (states(&model, &a), states(&model, &b));
    let err = max_abs_diff(&sa, &sb) / sb.iter().fold(0f32, |m, v| m.max(v.abs()));
    println!("600 tokens: state rel err {err:.2e}");
    assert!(err < TOL, "{err}");
    assert_eq!(a.len(), b.len());
}

/// A recurrent state cannot be rewound: truncating keeps everything or nothing, and a cleared
/// state runs a prompt exactly like a fresh one.
#[test]
fn truncate_keeps_all_or_nothing() {
    let dir = fixture_dir(DENSE);
    let files = read_weight_files(&dir);
    let source = SafetensorsSource::new(&files);
    let model = Model::from_source(&source, config(DENSE), "").unwrap();
    let prompt = ids(&read_json(dir.join("expected.json"))["prompt_ids"]);
    let mut fresh = model.new_state(256).unwrap();
    let want = model.prefill(&mut fresh, &prompt[..20]).unwrap().to_vec();

    let mut st = model.new_state(256).unwrap();
    model.prefill(&mut st, &prompt).unwrap();
    st.truncate(prompt.len());
    assert_eq!(st.len(), prompt.len());
    st.truncate(10);
    assert_eq!(st.len(), 0, "a GDN state cannot keep a prefix");
    assert_eq!(
        states(&model, &st),
        states(&model, &model.new_state(256).unwrap())
    );
    assert_eq!(model.prefill(&mut st, &prompt[..20]).unwrap(), &want[..]);
}

/// The device description of both fixtures, run by cmf-gpu's reference (the CPU model of
/// what the device computes, recurrence one token at a time), equals the CPU model decoding
/// the same tokens one by one: logits within 1e-5 relative per row, and each GatedDeltaNet
/// layer's conv ring and delta state after them.
#[test]
fn device_reference_equals_the_cpu_model() {
    use cmf_gpu::llm::reference::{self, RefCache};
    for name in [DENSE, MOE] {
        let dir = fixture_dir(name);
        let files = read_weight_files(&dir);
        let source = SafetensorsSource::new(&files);
        let model = Model::from_source(&source, config(name), "").unwrap();
        let desc = describe(&model, 256).expect("the hybrid is described");
        desc.validate().unwrap();
        assert!(desc.is_recurrent(), "{name}");
        let prompt = ids(&read_json(dir.join("expected.json"))["prompt_ids"]);
        let mut cache = RefCache::new(desc.spec.num_layers);
        let mut st = model.new_state(256).unwrap();
        let mut worst = 0f32;
        for (pos, &t) in prompt.iter().enumerate() {
            let want = model.decode(&mut st, t).unwrap().to_vec();
            let got = reference::forward_token(&desc, t, pos, &mut cache);
            worst = worst.max(rel_err(&got, &want));
        }
        println!("{name}: reference vs CPU model logits {worst:.2e}");
        assert!(worst < 1e-5, "{name}: {worst:.2e}");
        for l in 0..desc.spec.num_layers {
            let (Some(r), Some(c)) = (cache.gdn_state(l), st.gdn_state(l)) else {
                assert!(st.gdn_state(l).is_none() && cache.gdn_state(l).is_none());
                continue;
            };
            assert_eq!(r.len, prompt.len());
            let scale = c.delta().iter().fold(0f32, |m, v| m.max(v.abs()));
            let err = max_abs_diff(&r.delta, c.delta()) / scale;
            assert!(err < 1e-5, "{name} layer {l} delta state: {err:.2e}");
            let scale = c.conv().iter().fold(0f32, |m, v| m.max(v.abs()));
            let err = max_abs_diff(&r.conv, c.conv()) / scale;
            assert!(err < 1e-5, "{name} layer {l} conv state: {err:.2e}");
        }
    }
}

fn fake_gpu() -> (Gpu, Arc<cmf_gpu::facade::fake::FakeFaults>) {
    let backend = Arc::new(FakeBackend::new(1 << 40));
    let faults = backend.faults.clone();
    (Gpu::with_backend(GpuMode::Auto, backend), faults)
}

/// Prefill, 12 greedy steps, then a second turn that cuts the history back (the state
/// cannot rewind, so the engine keeps nothing and re-runs the prompt): the logits of each step
/// and the ids. `dev` and `cpu` see the same calls.
fn drive(engine: &mut dyn cmf_llm::engine::Engine, prompt: &[u32]) -> (Vec<Vec<f32>>, Vec<u32>) {
    let mut all = vec![engine.prefill(prompt).unwrap().to_vec()];
    let mut got = Vec::new();
    for _ in 0..12 {
        let t = cmf_gpu::llm::reference::argmax(all.last().unwrap());
        got.push(t);
        all.push(engine.decode(t).unwrap().to_vec());
    }
    engine.truncate(prompt.len() / 2);
    let kept = engine.len();
    all.push(engine.prefill(&prompt[kept..]).unwrap().to_vec());
    (all, got)
}

/// The single-sequence engine runs both hybrids on the device (the fake backend runs the
/// reference): the same logits as the CPU engine within 1e-4 relative (the CPU prefill runs the
/// chunked delta rule, the device path the recurrence) and the same greedy ids, without
/// falling back; the batched engine still declines them from the config.
#[test]
fn hybrids_run_on_the_fake_device_like_the_cpu() {
    use cmf_llm::engine::{CpuEngine, Engine};
    use cmf_llm::gpu::GpuEngine;
    for name in [DENSE, MOE] {
        let dir = fixture_dir(name);
        let files = read_weight_files(&dir);
        let source = SafetensorsSource::new(&files);
        let model = Model::from_source(&source, config(name), "").unwrap();
        assert_eq!(
            cpu_only(&model),
            Some(HYBRID_ON_CPU),
            "{name}: batched engine"
        );
        let (gpu, _) = fake_gpu();
        let g = GpuModel::try_load(&gpu, &model, 256, None).expect("the fake takes the hybrid");
        let prompt = ids(&read_json(dir.join("expected.json"))["prompt_ids"]);
        let kv = cmf_kernels::KvDtype::F32;
        let mut dev = GpuEngine::new(&model, g, 256, kv);
        let mut cpu = CpuEngine::new(&model, 256, kv).unwrap();
        let (dl, dids) = drive(&mut dev, &prompt);
        let (cl, cids) = drive(&mut cpu, &prompt);
        assert!(dev.is_gpu(), "{name}: the device engine fell back");
        assert_eq!(dev.len(), cpu.len());
        let worst = dl
            .iter()
            .zip(&cl)
            .map(|(a, b)| rel_err(a, b))
            .fold(0f32, f32::max);
        println!("{name}: fake device vs CPU engine logits {worst:.2e}, greedy {dids:?}");
        assert!(worst < 1e-4, "{name}: {worst:.2e}");
        assert_eq!(dids, cids, "{name}: greedy ids differ");
    }
}

/// A device refusal in the middle of a hybrid run (an allocation failure at a decode step)
/// moves the engine to the CPU, which replays the ids and continues with the same results; a
/// device asked to resume its recurrent state at another position refuses.
#[test]
fn hybrid_device_refusal_falls_back_to_the_cpu() {
    use cmf_llm::engine::{CpuEngine, Engine};
    use cmf_llm::gpu::GpuEngine;
    let dir = fixture_dir(MOE);
    let files = read_weight_files(&dir);
    let source = SafetensorsSource::new(&files);
    let model = Model::from_source(&source, config(MOE), "").unwrap();
    let prompt = ids(&read_json(dir.join("expected.json"))["prompt_ids"]);
    let kv = cmf_kernels::KvDtype::F32;
    let (gpu, faults) = fake_gpu();
    let g = GpuModel::try_load(&gpu, &model, 256, None).unwrap();
    let mut dev = GpuEngine::new(&model, g, 256, kv);
    let mut cpu = CpuEngine::new(&model, 256, kv).unwrap();
    let mut a = dev.prefill(&prompt).unwrap().to_vec();
    let mut b = cpu.prefill(&prompt).unwrap().to_vec();
    let mut worst = rel_err(&a, &b);
    for step in 0..8 {
        if step == 3 {
            faults.fail_next_alloc.store(true, Ordering::SeqCst);
        }
        let t = argmax(&b);
        assert_eq!(argmax(&a), t, "step {step}");
        a = dev.decode(t).unwrap().to_vec();
        b = cpu.decode(t).unwrap().to_vec();
        worst = worst.max(rel_err(&a, &b));
    }
    assert!(
        !dev.is_gpu(),
        "the injected refusal must move the engine to the CPU"
    );
    assert!(worst < 1e-4, "{worst:.2e}");

    let mut g = GpuModel::try_load(&gpu, &model, 256, None).unwrap();
    g.prefill(
        &prompt,
        0,
        cmf_gpu::llm::Logits::Last,
        model.config.vocab_size,
    )
    .unwrap();
    assert!(
        g.decode(prompt[0], prompt.len() - 3, false).is_err(),
        "a recurrent state cannot resume 3 positions back"
    );
    assert!(g.decode(prompt[0], prompt.len(), false).is_ok());
    // Position 0 restarts the state: the same logits as a fresh model.
    let again = g
        .prefill(
            &prompt,
            0,
            cmf_gpu::llm::Logits::Last,
            model.config.vocab_size,
        )
        .unwrap();
    let mut fresh = GpuModel::try_load(&gpu, &model, 256, None).unwrap();
    let want = fresh
        .prefill(
            &prompt,
            0,
            cmf_gpu::llm::Logits::Last,
            model.config.vocab_size,
        )
        .unwrap();
    assert_eq!(again, want);
}

/// `cmf convert` of both fixtures in every codec, loaded from the CMF file: f32 matches
/// transformers as the safetensors do (24/24 greedy); the GDN's decay/gate inputs, conv taps,
/// `A_log` and `dt_bias` stay f32 in every codec. Measured worst logits error (dense / MoE
/// fixture, 2026-12-07) → bound: f16 4.6e-3 / 4.4e-3 → 1e-2; bf16 3.9e-2 / 3.6e-2 → 8e-2;
/// q8_row 0.17 / 0.57 and q8_2f 0.18 / 0.50 → 1.0; q4 1.24 / 1.41 → 3.0. The random tiny weights
/// magnify codec error as in `cmf_parity`, and on the MoE fixture a quantized router picks other
/// experts for some tokens (a jump, not a drift); greedy agreement of lossy codecs is reported.
#[test]
fn converted_files_run_in_every_codec() {
    use cmf_convert::{Options, Quant};
    use cmf_format::{CmfModel, Dtype};
    let tmp = tempfile::tempdir().unwrap();
    let bounds = [
        (Quant::F32, 1e-4, 24),
        (Quant::F16, 1e-2, 0),
        (Quant::Bf16, 8e-2, 0),
        (Quant::Q8, 1.0, 0),
        (Quant::Q8_2f, 1.0, 0),
        (Quant::Q4, 3.0, 0),
    ];
    let mut failures = Vec::new();
    for (quant, bound, agree) in bounds {
        for name in [DENSE, MOE] {
            let path = tmp.path().join(format!("{name}-{quant}.cmf"));
            let opts = Options {
                quant: Some(quant),
                ..Options::default()
            };
            cmf_convert::hf::convert(&fixture_dir(name), &path, &opts).unwrap();
            let file = CmfModel::open(&path).unwrap();
            for t in ["in_proj_ba.weight", "conv1d.weight", "A_log", "dt_bias"] {
                let n = format!("model.layers.0.linear_attn.{t}");
                assert_eq!(file.tensor(&n).unwrap().dtype, Dtype::F32, "{quant} {n}");
            }
            let qkvz = file
                .tensor("model.layers.0.linear_attn.in_proj_qkvz.weight")
                .unwrap();
            assert_eq!(qkvz.dtype, quant.matrix_dtype(), "{quant}");
            let model = Model::load(&file).unwrap();
            let c = compare(&model, name);
            let err = c.prompt_err.max(c.decode_err);
            println!(
                "{quant:>6} {name:>20}: logits {err:.2e}, greedy agrees for {}/24",
                c.greedy_agree()
            );
            if err > bound || c.greedy_agree() < agree {
                failures.push(format!("{quant} {name}: {err:.2e}, {}", c.greedy_agree()));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// A second chat turn over a hybrid model: the cached state cannot be cut back to the common
/// prefix, so the session re-runs what it must and answers exactly like a fresh session given
/// the same conversation.
#[test]
fn second_chat_turn_equals_a_fresh_session() {
    use cmf_convert::{Options, Quant};
    use cmf_format::CmfModel;
    use cmf_llm::chat::{ChatSession, Message, TextAssets};
    use cmf_llm::generate::GenerationConfig;
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("m.cmf");
    let opts = Options {
        quant: Some(Quant::F32),
        ..Options::default()
    };
    cmf_convert::hf::convert(&fixture_dir(MOE), &path, &opts).unwrap();
    let file = CmfModel::open(&path).unwrap();
    let model = Model::load(&file).unwrap();
    let a = TextAssets::from_cmf(&file).unwrap();
    let cfg = GenerationConfig {
        max_tokens: 12,
        eos_ids: a.eos_ids.clone(),
        ..Default::default()
    };
    let kv = cmf_kernels::KvDtype::F32;
    let mut chat = ChatSession::new(&model, &a.tokenizer, &a.template, None, 256, kv).unwrap();
    let (first, _) = chat.send("In the beginning", &cfg, &mut |_| {}).unwrap();
    let (second, _) = chat.send("And then?", &cfg, &mut |_| {}).unwrap();

    let mut fresh = ChatSession::new(&model, &a.tokenizer, &a.template, None, 256, kv).unwrap();
    fresh
        .messages
        .push(Message::new("user", "In the beginning"));
    fresh.messages.push(Message::new("assistant", first));
    let (again, _) = fresh.send("And then?", &cfg, &mut |_| {}).unwrap();
    assert!(!second.is_empty());
    assert_eq!(second, again);
}
