//! `cmf run FILE`: generate text. `--prompt` answers once; without it, an interactive chat when
//! stdin is a terminal (multi-turn, `/reset`, `/exit`), else stdin is read as one prompt.
//! Text streams to stdout; timings go to stderr at the end of each answer.

use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;

use anyhow::Context;
use cmf_format::CmfModel;
use cmf_llm::chat::{ChatSession, TextAssets};
use cmf_llm::engine::CpuEngine;
use cmf_llm::generate::{generate, FinishReason, GenerationConfig, GenerationStats};
use cmf_llm::sampling::SamplingParams;
use cmf_llm::Model;

use super::llm_opts::EngineOpts;
use crate::exit::UsageError;

/// Generate text with an LLM (one-shot or interactive chat).
#[derive(clap::Args)]
pub struct Args {
    /// A .cmf LLM file (or any shard of a set).
    file: PathBuf,
    /// The user message (with the chat template) or, with --raw, the text to continue.
    #[arg(short, long)]
    prompt: Option<String>,
    /// A system message placed before the conversation.
    #[arg(long)]
    system: Option<String>,
    /// Most tokens to generate per answer.
    #[arg(short = 'n', long, default_value_t = 512)]
    max_tokens: usize,
    /// Continue the prompt as plain text: no chat template (the tokenizer's own BOS, if any, is added).
    #[arg(long)]
    raw: bool,
    /// Stop when the output contains this text (repeatable); it is not printed.
    #[arg(long = "stop", value_name = "TEXT")]
    stop: Vec<String>,
    /// Answer with JSON matching this JSON schema file, enforced token by token (one-shot
    /// only: with --prompt or a prompt on stdin).
    #[arg(long, value_name = "FILE")]
    json_schema: Option<PathBuf>,
    /// Context length (prompt + answers) in tokens (default: 4096, capped at the model's maximum).
    #[arg(short = 'c', long, value_name = "N")]
    ctx: Option<usize>,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    engine: EngineOpts,
}

/// Sampling flags (defaults: greedy, no penalties).
#[derive(clap::Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Temperature; 0 = greedy.
    #[arg(long = "temp", default_value_t = 0.0)]
    temperature: f32,
    /// Keep the K most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Keep the most likely tokens up to this cumulative probability (1 = off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Drop tokens below this fraction of the top token's probability (0 = off).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Repetition penalty on the last --repeat-last-n tokens (1 = off).
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    /// Tokens the penalties look back over, prompt included.
    #[arg(long, default_value_t = 64)]
    repeat_last_n: usize,
    /// Subtracted once from the logit of any token in the window.
    #[arg(long, default_value_t = 0.0)]
    presence_penalty: f32,
    /// Subtracted per occurrence from the logit of tokens in the window.
    #[arg(long, default_value_t = 0.0)]
    frequency_penalty: f32,
    /// Seed of the sampler's PRNG (default: from the clock; printed with the stats).
    #[arg(long)]
    seed: Option<u64>,
}

impl SamplingArgs {
    fn params(&self) -> anyhow::Result<SamplingParams> {
        let seed = self.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
        });
        let p = SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            penalty_last_n: self.repeat_last_n,
            seed,
        };
        p.validate()
            .map_err(|e| UsageError(format!("sampling: {e}")))?;
        Ok(p)
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let kv_type = args.engine.apply()?;
    let sampling = args.sampling.params()?;
    let file = CmfModel::open(&args.file)?;
    let path = args.file.display();
    let model = Model::load(&file).with_context(|| format!("{path}"))?;
    let assets = TextAssets::from_cmf(&file)?;
    if args.raw && args.system.is_some() {
        return Err(UsageError(
            "--system needs the chat template; it cannot be used with --raw".into(),
        )
        .into());
    }
    let cfg = GenerationConfig {
        max_tokens: args.max_tokens,
        sampling,
        stop_strings: args.stop.clone(),
        eos_ids: assets.eos_ids.clone(),
    };
    let ctx = args
        .ctx
        .unwrap_or(4096)
        .min(model.config.max_position_embeddings);
    if ctx == 0 {
        return Err(UsageError("--ctx must be at least 1".into()).into());
    }

    let prompt = match &args.prompt {
        Some(p) => Some(p.clone()),
        None if std::io::stdin().is_terminal() => None,
        None => Some(super::stdin_prompt::read(ctx)?),
    };
    let mut out = std::io::stdout();
    let mut print = |t: &str| {
        let _ = out.write_all(t.as_bytes());
        let _ = out.flush();
    };

    if let Some(schema_path) = &args.json_schema {
        let Some(p) = prompt else {
            return Err(UsageError(
                "--json-schema answers one prompt: give --prompt or pipe the prompt on stdin"
                    .into(),
            )
            .into());
        };
        let constraint = schema_constraint(&file, &assets, &model, schema_path)?;
        let ids = if args.raw {
            assets.tokenizer.encode(&p, true)?
        } else {
            let mut msgs = Vec::new();
            if let Some(s) = &args.system {
                msgs.push(cmf_llm::chat::Message::new("system", s.as_str()));
            }
            msgs.push(cmf_llm::chat::Message::new("user", p.as_str()));
            let text = assets.template.render(&msgs, true)?;
            assets.tokenizer.encode(&text, false)?
        };
        if ids.is_empty() {
            return Err(UsageError("the prompt is empty".into()).into());
        }
        let mut engine = args.engine.engine(&model, ctx, kv_type)?;
        let stats =
            generate_with_schema(engine.as_mut(), &assets, &ids, &cfg, constraint, &mut print)?;
        finish(&stats, &cfg);
        return Ok(());
    }

    match prompt {
        Some(p) if args.raw => {
            let ids = assets.tokenizer.encode(&p, true)?;
            if ids.is_empty() {
                return Err(UsageError("the prompt is empty".into()).into());
            }
            let mut engine = args.engine.engine(&model, ctx, kv_type)?;
            let stats = generate(
                engine.as_mut(),
                &assets.tokenizer,
                &ids,
                &mut Vec::new(),
                &cfg,
                &mut print,
            )?;
            finish(&stats, &cfg);
        }
        Some(p) => {
            let mut chat = ChatSession::with_engine(
                args.engine.engine(&model, ctx, kv_type)?,
                &assets.tokenizer,
                &assets.template,
                args.system.as_deref(),
            );
            let (_, stats) = chat.send(&p, &cfg, &mut print)?;
            finish(&stats, &cfg);
        }
        None => interactive(&model, &assets, &args, &cfg, ctx, kv_type)?,
    }
    Ok(())
}

fn interactive(
    model: &Model,
    assets: &TextAssets,
    args: &Args,
    cfg: &GenerationConfig,
    ctx: usize,
    kv_type: cmf_kernels::KvDtype,
) -> anyhow::Result<()> {
    // One device session for the chat; `--raw` lines below each take a fresh CPU engine.
    let mut chat = ChatSession::with_engine(
        args.engine.engine(model, ctx, kv_type)?,
        &assets.tokenizer,
        &assets.template,
        args.system.as_deref(),
    );
    eprintln!("chat with {} (context {ctx} tokens); /reset forgets the conversation, /exit or Ctrl-D quits", args.file.display());
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    let mut out = std::io::stdout();
    loop {
        let _ = write!(out, "> ");
        let _ = out.flush();
        let Some(line) = lines.next() else { break };
        let line = line.context("reading stdin")?;
        match line.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                chat.reset();
                eprintln!("(conversation cleared)");
                continue;
            }
            _ => {}
        }
        let mut print = |t: &str| {
            let _ = out.write_all(t.as_bytes());
            let _ = out.flush();
        };
        let result = if args.raw {
            let ids = assets.tokenizer.encode(&line, true)?;
            let mut engine = CpuEngine::new(model, ctx, kv_type)?;
            generate(
                &mut engine,
                &assets.tokenizer,
                &ids,
                &mut Vec::new(),
                cfg,
                &mut print,
            )
        } else {
            chat.send(&line, cfg, &mut print).map(|(_, s)| s)
        };
        match result {
            Ok(stats) => finish(&stats, cfg),
            Err(cmf_llm::LlmError::ContextFull { needed, limit }) => {
                eprintln!("\n(the conversation needs {needed} tokens, the context holds {limit}: /reset, or run with a larger --ctx)");
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// The grammar of `--json-schema FILE`; a file that cannot be read, is not JSON or is not a
/// usable schema is reported with its path.
fn schema_constraint(
    file: &CmfModel,
    assets: &TextAssets,
    model: &Model,
    path: &std::path::Path,
) -> anyhow::Result<cmf_llm::constraint::Constrained> {
    let shown = path.display();
    let bytes = std::fs::read(path).with_context(|| format!("--json-schema {shown}"))?;
    let schema: serde_json::Value = serde_json::from_slice(&bytes)
        .with_context(|| format!("--json-schema {shown}: not valid JSON"))?;
    let vocab = file
        .vocab()
        .context("the model file has no tokenizer (vocab section)")?;
    let grammars =
        cmf_llm::constraint::Grammars::new(vocab, &assets.eos_ids, model.config.vocab_size)?;
    grammars
        .constrain(&cmf_llm::constraint::Grammar::JsonSchema(schema))
        .with_context(|| format!("--json-schema {shown}"))
}

/// One answer under a grammar constraint (the host-side loop that masks the logits).
fn generate_with_schema(
    engine: &mut dyn cmf_llm::engine::Engine,
    assets: &TextAssets,
    ids: &[u32],
    cfg: &GenerationConfig,
    mut constraint: cmf_llm::constraint::Constrained,
    print: &mut dyn FnMut(&str),
) -> anyhow::Result<GenerationStats> {
    use cmf_llm::guided::{generate_guided, Hooks, Step};
    let mut hooks = Hooks {
        processors: vec![&mut constraint],
        ..Hooks::default()
    };
    let mut on_step = |s: Step| {
        if let Step::Text(t) = s {
            print(t);
        }
    };
    let never = || false;
    Ok(generate_guided(
        engine,
        &assets.tokenizer,
        ids,
        &mut Vec::new(),
        cfg,
        &mut hooks,
        &mut on_step,
        &never,
    )?)
}

/// Ends the answer's line and prints the timings to stderr.
fn finish(s: &GenerationStats, cfg: &GenerationConfig) {
    println!();
    let why = match s.finish {
        FinishReason::Eos => "end of sequence",
        FinishReason::Stop => "stop string",
        FinishReason::Length => "max tokens",
        FinishReason::ContextFull => "context full",
        FinishReason::Cancelled => "cancelled",
    };
    let seed = if cfg.sampling.temperature > 0.0 {
        format!(" | seed {}", cfg.sampling.seed)
    } else {
        String::new()
    };
    eprintln!(
        "[prefill {} tok, {:.1} tok/s | decode {} tok, {:.1} tok/s | time to first token {:.0} ms | stopped: {why}{seed}]",
        s.prompt_tokens,
        s.prefill_tok_per_s(),
        s.generated_tokens,
        s.decode_tok_per_s(),
        s.time_to_first_token.as_secs_f64() * 1e3,
    );
}
