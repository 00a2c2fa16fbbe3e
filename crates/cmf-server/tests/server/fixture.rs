//! The test model, servers on ephemeral ports, and the reference answers computed with
//! `cmf_llm::generate` directly (what the server must reproduce token for token).

use cmf_format::CmfModel;
use cmf_llm::chat::{Message, TextAssets};
use cmf_llm::generate::{generate, GenerationConfig, GenerationStats};
use cmf_llm::sampling::SamplingParams;
use cmf_llm::Model;
use cmf_server::{EngineOptions, RunningServer, ServerConfig};
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

/// A scratch directory `name` this test binary makes once and shares (see
/// `cmf_test_support::scratch`).
pub fn scratch_dir(name: &str) -> PathBuf {
    cmf_test_support::scratch::scratch_dir(env!("CARGO_TARGET_TMPDIR"), name)
}

/// `fixtures/llm/qwen2-tiny` as a CMF f32 file (converted once per test process).
pub fn model_path() -> &'static PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/llm/qwen2-tiny");
        let dir = scratch_dir("cmf-server");
        let out = dir.join("qwen2-tiny.cmf");
        let opts = cmf_convert::Options {
            quant: Some(cmf_convert::Quant::F32),
            ..Default::default()
        };
        cmf_convert::hf::convert(&src, &out, &opts).expect("convert the qwen2-tiny fixture");
        out
    })
}

pub const MODEL_ID: &str = "qwen2-tiny";

pub fn config() -> ServerConfig {
    ServerConfig {
        port: 0,
        engine: EngineOptions::default(),
        http_threads: 1,
        ..ServerConfig::new(model_path())
    }
}

pub fn start(cfg: ServerConfig) -> RunningServer {
    RunningServer::start(cfg).expect("start the server")
}

/// A server whose worker sleeps `pace` before every forward pass, so a tiny model is slow
/// enough to disconnect from or to queue behind.
pub fn start_paced(pace: Duration, queue: usize) -> RunningServer {
    let mut cfg = config();
    cfg.engine.token_pacing = Some(pace);
    cfg.engine.queue_capacity = queue;
    start(cfg)
}

/// What `cmf_llm::generate` produces for `ids` on a fresh f16-KV state (the server's default).
pub fn reference(ids: &[u32], cfg: &GenerationConfig) -> (String, GenerationStats) {
    let file = CmfModel::open(model_path()).unwrap();
    let model = Model::load(&file).unwrap();
    let assets = TextAssets::from_cmf(&file).unwrap();
    let mut engine = cmf_llm::engine::CpuEngine::new(
        &model,
        model.config.max_position_embeddings,
        cmf_kernels::KvDtype::F16,
    )
    .unwrap();
    let mut text = String::new();
    let stats = generate(
        &mut engine,
        &assets.tokenizer,
        ids,
        &mut Vec::new(),
        cfg,
        &mut |t| text.push_str(t),
    )
    .unwrap();
    (text, stats)
}

pub fn assets() -> TextAssets {
    TextAssets::from_cmf(&CmfModel::open(model_path()).unwrap()).unwrap()
}

/// Grammars and the tool format of the test model, as the server builds them.
pub fn guidance() -> cmf_server::guidance::Guidance {
    let file = CmfModel::open(model_path()).unwrap();
    let a = TextAssets::from_cmf(&file).unwrap();
    let vocab = cmf_llm::ModelConfig::from_cmf(&file).unwrap().vocab_size;
    cmf_server::guidance::Guidance::new(&file, &a, vocab)
}

/// The prompt ids the chat endpoint must build for `messages` (template + tokenizer).
pub fn chat_ids(messages: &[(&str, &str)]) -> Vec<u32> {
    let a = assets();
    let msgs: Vec<Message> = messages.iter().map(|(r, c)| Message::new(*r, *c)).collect();
    let text = a.template.render(&msgs, true).unwrap();
    a.tokenizer.encode(&text, false).unwrap()
}

pub fn text_ids(prompt: &str) -> Vec<u32> {
    assets().tokenizer.encode(prompt, true).unwrap()
}

pub fn gen_config(max_tokens: usize, sampling: SamplingParams, stop: &[&str]) -> GenerationConfig {
    GenerationConfig {
        max_tokens,
        sampling,
        stop_strings: stop.iter().map(|s| s.to_string()).collect(),
        eos_ids: assets().eos_ids,
    }
}

pub fn greedy() -> SamplingParams {
    SamplingParams::default()
}

/// Polls `cond` every 10 ms until it holds or `limit` passes.
pub fn wait_until(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let t = std::time::Instant::now();
    while t.elapsed() < limit {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    cond()
}
