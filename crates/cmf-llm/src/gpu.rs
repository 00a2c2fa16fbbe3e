//! The GPU hook: describes a [`Model`] to cmf-gpu in its neutral terms and runs the generation
//! loop's forward passes on the device when the facade lets it, on the CPU otherwise.
//!
//! [`Engine`] is what [`crate::generate::generate_on`] drives: `Cpu` is the plain model;
//! `Gpu` holds a whole model resident on the device (KV cache there, position tracked here).
//! The first refusal of the device (an injected one, a pause, a driver error) switches the
//! engine to the CPU for good: the CPU cache is rebuilt from the ids the caller passes as
//! history, and the run continues with identical results (cmf-gpu's refusal contract: nothing
//! the device was handed has been written).

use crate::model::rope::RopeScaling;
use crate::model::{Model, State};
use crate::sampling::{Sampler, SamplingParams};
use crate::Result;
use cmf_gpu::facade::{Gpu, GpuLlm, LayerSet};
use cmf_gpu::llm::{DecodeOutput, LayerWeights, LlmModel, LlmOptions, LlmSpec, Logits, RopeSpec};

/// The neutral description of `model` for a device session of `max_context` positions, or
/// why the device graph cannot express it (then the model runs on the CPU).
pub fn describe<'m>(
    model: &'m Model<'_>,
    max_context: usize,
) -> std::result::Result<LlmModel<'m>, String> {
    let c = &model.config;
    let w = &model.weights;
    if w.layers.len() != c.num_layers {
        return Err(format!(
            "{} of {} layers bound",
            w.layers.len(),
            c.num_layers
        ));
    }
    if let RopeScaling::Dynamic {
        max_position_embeddings,
        ..
    } = model.rope.config.scaling
    {
        if max_context > max_position_embeddings {
            return Err(
                "dynamic RoPE past max_position_embeddings changes the frequencies per length"
                    .into(),
            );
        }
    }
    let mut layers = Vec::with_capacity(w.layers.len());
    for (i, l) in w.layers.iter().enumerate() {
        if l.o.bias.is_some()
            || l.gate.bias.is_some()
            || l.up.bias.is_some()
            || l.down.bias.is_some()
        {
            return Err(format!(
                "layer {i}: biases on o_proj / MLP projections have no device kernel"
            ));
        }
        layers.push(LayerWeights {
            attn_norm: &l.attn_norm,
            q: l.q.w,
            k: l.k.w,
            v: l.v.w,
            o: l.o.w,
            q_bias: l.q.bias.as_deref(),
            k_bias: l.k.bias.as_deref(),
            v_bias: l.v.bias.as_deref(),
            q_norm: l.q_norm.as_deref(),
            k_norm: l.k_norm.as_deref(),
            ffn_norm: &l.ffn_norm,
            gate: l.gate.w,
            up: l.up.w,
            down: l.down.w,
        });
    }
    let spec = LlmSpec {
        hidden: c.hidden_size,
        intermediate: c.intermediate_size,
        num_layers: c.num_layers,
        num_heads: c.num_heads,
        num_kv_heads: c.num_kv_heads,
        head_dim: c.head_dim,
        vocab: c.vocab_size,
        rms_eps: c.rms_norm_eps,
        rope: RopeSpec {
            inv_freq: model.rope.inv_freq_for(max_context).to_vec(),
            attention_factor: model.rope.attention_scaling(),
        },
        sliding_window: c.sliding_window.clone(),
        attn_scale: 1.0 / (c.head_dim as f32).sqrt(),
    };
    Ok(LlmModel {
        spec,
        embed: w.embed,
        layers,
        final_norm: &w.final_norm,
        lm_head: w.lm_head,
    })
}

/// A model resident on the device, and the position its KV cache has reached.
pub struct GpuModel {
    llm: GpuLlm,
    pos: usize,
}

impl GpuModel {
    /// Uploads `model` for sequences of up to `max_context` tokens. None when the device
    /// refuses (the facade logs why at debug verbosity) or only part of the model would fit
    /// (hybrid placement is not wired into this loop yet: the CPU runs all of it then).
    pub fn load(
        gpu: &Gpu,
        model: &Model,
        max_context: usize,
        layers: Option<&LayerSet>,
    ) -> Option<GpuModel> {
        let max_context = max_context.min(model.config.max_position_embeddings.max(1));
        let desc = match describe(model, max_context) {
            Ok(d) => d,
            Err(why) => {
                cmf_gpu::facade::log::debug(&format!("llm: runs on the CPU: {why}"));
                return None;
            }
        };
        let opts = LlmOptions {
            max_context,
            ..LlmOptions::default()
        };
        let llm = gpu.load_llm(&desc, &opts, layers).ok()?;
        if !llm.placement().is_whole_model() {
            cmf_gpu::facade::log::debug(
                "llm: partial placement: the generation loop runs on the CPU",
            );
            return None;
        }
        Some(GpuModel { llm, pos: 0 })
    }

    /// Positions held in the device KV cache.
    pub fn len(&self) -> usize {
        self.pos
    }

    pub fn is_empty(&self) -> bool {
        self.pos == 0
    }

    pub fn max_context(&self) -> usize {
        self.llm.max_context()
    }

    /// Forgets everything (a new conversation).
    pub fn clear(&mut self) {
        self.pos = 0;
    }
}

/// What a forward pass hands the sampler: logits, or the token the device already chose.
pub enum Step {
    Logits(Vec<f32>),
    Token(u32),
}

impl Step {
    pub fn pick(self, sampler: &mut Sampler, history: &[u32]) -> u32 {
        match self {
            Step::Token(t) => t,
            Step::Logits(mut l) => sampler.sample(&mut l, history),
        }
    }
}

/// Where the generation loop's forward passes run.
pub enum Engine {
    Cpu,
    Gpu(GpuModel),
}

/// Greedy without penalties: the device's arg-max is the sampler's choice (4-byte readback).
fn device_greedy(p: &SamplingParams) -> bool {
    let penalties = p.penalty_last_n > 0
        && (p.repeat_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0);
    (p.temperature == 0.0 || p.top_k == 1) && !penalties
}

impl Engine {
    /// Tokens in the cache of whichever side runs.
    pub fn len(&self, st: &State) -> usize {
        match self {
            Engine::Gpu(g) => g.pos,
            Engine::Cpu => st.len(),
        }
    }

    pub fn is_gpu(&self) -> bool {
        matches!(self, Engine::Gpu(_))
    }

    /// Keeps the first `len` cached positions (the CPU state is truncated by its owner).
    pub fn truncate(&mut self, len: usize) {
        if let Engine::Gpu(g) = self {
            g.pos = g.pos.min(len);
        }
    }

    /// Runs `tokens` from an empty cache and calls `f(i, logits_i)` for every `i >= first`
    /// (perplexity). On the device: one prefill returning every row's logits.
    pub fn forward_scored(
        &mut self,
        model: &Model,
        st: &mut State,
        tokens: &[u32],
        first: usize,
        mut f: impl FnMut(usize, &[f32]) + Send,
    ) -> Result<()> {
        if let Engine::Gpu(g) = self {
            let v = model.config.vocab_size;
            let mut all = vec![0f32; tokens.len() * v];
            if g.llm.prefill(tokens, 0, Logits::All, &mut all).is_ok() {
                g.pos = tokens.len();
                for i in first..tokens.len() {
                    f(i, &all[i * v..(i + 1) * v]);
                }
                return Ok(());
            }
            *self = Engine::Cpu;
        }
        st.clear();
        model.forward_scored(st, tokens, first, f)
    }

    pub fn limit(&self, st: &State) -> usize {
        match self {
            Engine::Gpu(g) => g.max_context().min(st.kv.limit()),
            Engine::Cpu => st.kv.limit(),
        }
    }

    /// Leaves the device: the CPU cache is rebuilt from `history` (the ids in the cache).
    fn fall_back(&mut self, model: &Model, st: &mut State, history: &[u32]) -> Result<()> {
        *self = Engine::Cpu;
        st.clear();
        if !history.is_empty() {
            model.prefill(st, history)?;
        }
        Ok(())
    }

    /// Runs `tokens` after `history` (the ids already in the cache); logits of the last one.
    pub fn prefill(
        &mut self,
        model: &Model,
        st: &mut State,
        tokens: &[u32],
        history: &[u32],
    ) -> Result<Step> {
        if let Engine::Gpu(g) = self {
            let mut logits = vec![0f32; model.config.vocab_size];
            if g.pos == history.len()
                && g.llm
                    .prefill(tokens, g.pos, Logits::Last, &mut logits)
                    .is_ok()
            {
                g.pos += tokens.len();
                return Ok(Step::Logits(logits));
            }
            self.fall_back(model, st, history)?;
        }
        Ok(Step::Logits(model.prefill(st, tokens)?.to_vec()))
    }

    /// Runs one sampled token after `history`.
    pub fn decode(
        &mut self,
        model: &Model,
        st: &mut State,
        token: u32,
        history: &[u32],
        params: &SamplingParams,
    ) -> Result<Step> {
        if let Engine::Gpu(g) = self {
            let greedy = device_greedy(params);
            let mut out = DecodeOutput::default();
            let sampler = cmf_gpu::llm::Sampler::Greedy;
            if g.pos == history.len()
                && g.llm
                    .decode(token, g.pos, &sampler, !greedy, &mut out)
                    .is_ok()
            {
                g.pos += 1;
                return Ok(if greedy {
                    Step::Token(out.token)
                } else {
                    Step::Logits(out.logits)
                });
            }
            self.fall_back(model, st, history)?;
        }
        Ok(Step::Logits(model.decode(st, token)?.to_vec()))
    }
}
