//! The GPU hook: describes a [`Model`] to cmf-gpu in its neutral terms and runs the generation
//! loop's forward passes on the device when the facade lets it, on the CPU otherwise.
//!
//! [`GpuEngine`] implements [`crate::engine::Engine`] (what `generate` and `ChatSession` drive)
//! with the whole model resident on the device (KV cache there; the ids it holds tracked here).
//! The first refusal of the device (an injected one, a pause, a driver error) switches it to a
//! [`CpuEngine`] for good: the CPU cache is rebuilt from the tracked ids and the run continues
//! with identical results (cmf-gpu's refusal contract: nothing the device was handed has been
//! written). [`crate::bench::run_on`] and [`crate::perplexity::perplexity_on`] use a
//! [`GpuModel`] directly (device arg-max, every-row logits).

use crate::engine::{CpuEngine, Engine};
use crate::model::rope::RopeScaling;
use crate::model::{MixerWeights, Model};
use crate::{LlmError, Result};
use cmf_gpu::facade::{Gpu, GpuLlm, LayerSet, Refusal};
use cmf_gpu::llm::sample::SampleSpec;
use cmf_gpu::llm::{
    self as dev, AttentionWeights, DecodeOutput, KvPrecision, LayerWeights, LlmModel, LlmOptions,
    LlmSpec, Logits, Mixer, RopeSpec, Sampler,
};

/// Why the batched engine runs a hybrid linear-attention model (Qwen3-Next) on the CPU: its
/// device step has no recurrent-state slots. The single-sequence engine runs these models on
/// the device.
pub const HYBRID_ON_CPU: &str = "the batched engine has no device path for GatedDeltaNet layers";

/// Why the batched engine (`--parallel`) runs `model` on the CPU whatever the device can do,
/// decided from its config alone so nothing is opened or uploaded first; None when its device
/// step can express it.
pub fn cpu_only(model: &Model) -> Option<&'static str> {
    let c = &model.config;
    if c.gdn.is_some() || c.attn_output_gate || c.norm_style != cmf_kernels::NormStyle::Plain {
        return Some(HYBRID_ON_CPU);
    }
    None
}

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
    describe_bound(model, max_context, &w.final_norm)
}

/// [`describe`] of the layers `model` has bound (all, or the first few of a text encoder),
/// with `final_norm` standing in when the model has none bound.
fn describe_bound<'m>(
    model: &'m Model<'_>,
    max_context: usize,
    final_norm: &'m [f32],
) -> std::result::Result<LlmModel<'m>, String> {
    let c = &model.config;
    let w = &model.weights;
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
        let (attn_norm, mixer) = match &l.mixer {
            MixerWeights::Attention(a) => (&a.attn_norm[..], describe_attention(model, i, a)?),
            MixerWeights::GatedDeltaNet(g) => (&g.in_norm[..], describe_gdn(model, i, g)?),
        };
        let ffn = match &l.ffn {
            crate::model::Ffn::Dense(mlp) => {
                if mlp.gate.bias.is_some() || mlp.up.bias.is_some() || mlp.down.bias.is_some() {
                    return Err(format!(
                        "layer {i}: biases on the MLP projections have no device kernel"
                    ));
                }
                dev::Ffn::Dense(dev::Mlp {
                    gate: mlp.gate.w,
                    up: mlp.up.w,
                    down: mlp.down.w,
                })
            }
            crate::model::Ffn::Moe(m) => dev::Ffn::Moe(describe_moe(model, m)?),
        };
        layers.push(LayerWeights {
            attn_norm,
            mixer,
            ffn_norm: &l.ffn_norm,
            ffn,
        });
    }
    let spec = LlmSpec {
        hidden: c.hidden_size,
        intermediate: c.intermediate_size,
        num_layers: w.layers.len(),
        num_heads: c.num_heads,
        num_kv_heads: c.num_kv_heads,
        head_dim: c.head_dim,
        vocab: c.vocab_size,
        rms_eps: c.rms_norm_eps,
        rope: RopeSpec {
            inv_freq: model.rope.inv_freq_for(max_context).to_vec(),
            attention_factor: model.rope.attention_scaling(),
        },
        sliding_window: c.sliding_window[..w.layers.len()].to_vec(),
        attn_scale: 1.0 / (c.head_dim as f32).sqrt(),
        norm_style: c.norm_style,
    };
    Ok(LlmModel {
        spec,
        embed: w.embed,
        layers,
        final_norm,
        lm_head: w.lm_head,
    })
}

/// The neutral form of layer `i`'s attention (output-gated when the config says so).
fn describe_attention<'m>(
    model: &'m Model<'_>,
    i: usize,
    a: &'m crate::model::weights::AttentionWeights<'_>,
) -> std::result::Result<Mixer<'m>, String> {
    if a.o.bias.is_some() {
        return Err(format!("layer {i}: a bias on o_proj has no device kernel"));
    }
    let output_gate = model.config.attn_output_gate;
    if output_gate && a.q.bias.is_some() {
        return Err(format!(
            "layer {i}: a bias on an output-gated q_proj has no device kernel"
        ));
    }
    Ok(Mixer::Attention(AttentionWeights {
        q: a.q.w,
        k: a.k.w,
        v: a.v.w,
        o: a.o.w,
        q_bias: a.q.bias.as_deref(),
        k_bias: a.k.bias.as_deref(),
        v_bias: a.v.bias.as_deref(),
        q_norm: a.q_norm.as_deref(),
        k_norm: a.k_norm.as_deref(),
        output_gate,
    }))
}

/// The neutral form of layer `i`'s GatedDeltaNet mixer.
fn describe_gdn<'m>(
    model: &'m Model<'_>,
    i: usize,
    g: &'m crate::model::weights::GdnWeights<'_>,
) -> std::result::Result<Mixer<'m>, String> {
    let c = model
        .config
        .gdn
        .as_ref()
        .ok_or("a GatedDeltaNet layer without a linear-attention config")?;
    if g.qkvz.bias.is_some() || g.ba.bias.is_some() || g.out.bias.is_some() {
        return Err(format!(
            "layer {i}: biases on the GatedDeltaNet projections have no device kernel"
        ));
    }
    Ok(Mixer::GatedDelta(dev::GdnWeights {
        geometry: *c,
        qkvz: g.qkvz.w,
        ba: g.ba.w,
        conv: &g.conv,
        a_log: &g.a_log,
        dt_bias: &g.dt_bias,
        norm: &g.norm,
        out: g.out.w,
    }))
}

/// Bytes of weight matrices one decoded token reads (every layer matrix but the experts the
/// router does not choose, and the lm_head), for models the device graph can express.
pub fn weight_bytes_per_token(model: &Model) -> Option<u64> {
    let desc = describe(model, 1).ok()?;
    let layers: u64 = desc.layers.iter().map(|l| l.bytes_per_token()).sum();
    Some(layers + desc.lm_head.data.len() as u64)
}

/// The neutral form of a MoE block (the routing as the model's config says).
fn describe_moe<'m>(
    model: &'m Model<'_>,
    m: &'m crate::model::moe::MoeWeights<'_>,
) -> std::result::Result<dev::MoeWeights<'m>, String> {
    use crate::model::moe::Routing;
    let cfg = model
        .config
        .moe
        .as_ref()
        .ok_or("a MoE block without a moe config")?;
    let mlp = |e: &crate::model::moe::Expert<'m>| dev::Mlp {
        gate: e.gate,
        up: e.up,
        down: e.down,
    };
    let (norm_topk_prob, routing) = match cfg.routing {
        Routing::SoftmaxTopK { norm_topk_prob } => (norm_topk_prob, dev::Routing::Softmax),
        Routing::SigmoidGroupTopK {
            n_group,
            topk_group,
            norm_topk_prob,
            routed_scaling_factor,
        } => (
            norm_topk_prob,
            dev::Routing::SigmoidGroup {
                n_group,
                topk_group,
                routed_scaling_factor,
                bias: m
                    .selection_bias
                    .as_deref()
                    .ok_or("noaux_tc routing without e_score_correction_bias")?,
            },
        ),
    };
    Ok(dev::MoeWeights {
        router: m.router,
        experts: m.experts.iter().map(mlp).collect(),
        top_k: cfg.top_k,
        norm_topk_prob,
        routing,
        shared: m.shared.as_ref().map(|s| dev::SharedExpert {
            mlp: mlp(&s.mlp),
            gate: s.gate,
        }),
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
    /// (generation places the whole model or none of it: the CPU runs all of it then).
    pub fn load(
        gpu: &Gpu,
        model: &Model,
        max_context: usize,
        layers: Option<&LayerSet>,
    ) -> Option<GpuModel> {
        Self::try_load(gpu, model, max_context, layers)
            .map_err(|why| cmf_gpu::facade::log::debug(&format!("llm: runs on the CPU: {why}")))
            .ok()
    }

    /// [`GpuModel::load`], with the reason when the model stays on the CPU.
    pub fn try_load(
        gpu: &Gpu,
        model: &Model,
        max_context: usize,
        layers: Option<&LayerSet>,
    ) -> std::result::Result<GpuModel, String> {
        Self::try_load_with(gpu, model, max_context, layers, KvPrecision::Auto)
    }

    /// [`GpuModel::try_load`] with the device KV cache's precision (see [`device_kv`]).
    pub fn try_load_with(
        gpu: &Gpu,
        model: &Model,
        max_context: usize,
        layers: Option<&LayerSet>,
        kv: KvPrecision,
    ) -> std::result::Result<GpuModel, String> {
        let max_context = max_context.min(model.config.max_position_embeddings.max(1));
        let desc = describe(model, max_context)?;
        let llm = load_llm(gpu, &desc, max_context, layers, kv)?;
        if !llm.placement().is_whole_model() {
            return Err(partial_fit(model, &desc, llm.placement()));
        }
        Ok(GpuModel { llm, pos: 0 })
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

    /// Runs `tokens` at position `start`; the logits asked for (`Last`: [V], `All`: [T, V]).
    pub fn prefill(
        &mut self,
        tokens: &[u32],
        start: usize,
        want: Logits,
        vocab: usize,
    ) -> std::result::Result<Vec<f32>, Refusal> {
        let mut out = vec![0f32; want.len(tokens.len(), vocab)];
        self.llm.prefill(tokens, start, want, &mut out)?;
        self.pos = start + tokens.len();
        Ok(out)
    }

    /// One token at position `pos`, sampled on the device by `sampler`; only the token comes
    /// back. The next step's graph is launched before this returns (decode ahead), so the
    /// caller should feed the token back at `pos + 1`.
    pub fn decode_sampled(
        &mut self,
        token: u32,
        pos: usize,
        sampler: &Sampler,
    ) -> std::result::Result<u32, Refusal> {
        let mut out = DecodeOutput::default();
        self.llm.decode(token, pos, sampler, false, &mut out)?;
        self.pos = pos + 1;
        Ok(out.token)
    }

    /// One token at position `pos`, drawn on the device by `sampler` among the tokens `mask`
    /// allows (`LlmDevice::decode_masked`); only the token comes back.
    pub fn decode_masked(
        &mut self,
        token: u32,
        pos: usize,
        sampler: &Sampler,
        mask: &mut dyn FnMut(&mut [u32]),
    ) -> std::result::Result<u32, Refusal> {
        let next = self.llm.decode_masked(token, pos, sampler, mask)?;
        self.pos = pos + 1;
        Ok(next)
    }

    /// One token at position `pos`, greedy on the device: the arg-max (and the logits when
    /// `want_logits`).
    pub fn decode(
        &mut self,
        token: u32,
        pos: usize,
        want_logits: bool,
    ) -> std::result::Result<DecodeOutput, Refusal> {
        let mut out = DecodeOutput::default();
        self.llm
            .decode(token, pos, &Sampler::Greedy, want_logits, &mut out)?;
        self.pos = pos + 1;
        Ok(out)
    }
}

/// Loads a described model for `max_context` positions, or the device's refusal as text.
fn load_llm(
    gpu: &Gpu,
    desc: &LlmModel<'_>,
    max_context: usize,
    layers: Option<&LayerSet>,
    kv: KvPrecision,
) -> std::result::Result<GpuLlm, String> {
    let opts = LlmOptions {
        max_context,
        kv,
        ..LlmOptions::default()
    };
    gpu.load_llm(desc, &opts, layers).map_err(|r| r.to_string())
}

/// The device KV cache that holds what a CPU cache of `kv` elements holds: f16 for f16, f32
/// for f32, and f32 for bf16 (the device keeps no bf16 cache; f32 has bf16's range and more
/// precision). So `--kv-type` means the same on both sides and `--gpu off` and `--gpu cuda`
/// round the cache alike.
pub fn device_kv(kv: cmf_kernels::KvDtype) -> KvPrecision {
    match kv {
        cmf_kernels::KvDtype::F16 => KvPrecision::F16,
        cmf_kernels::KvDtype::F32 | cmf_kernels::KvDtype::Bf16 => KvPrecision::F32,
    }
}

/// Why a model of which only some layers fit stays on the CPU; for a mixture of experts, how
/// much of it the routed experts are (they must all be resident: any token may choose any).
fn partial_fit(model: &Model, desc: &LlmModel, placement: &cmf_gpu::Placement) -> String {
    let (on, n) = (placement.device_layer_count(), desc.layers.len());
    let experts: u64 = desc
        .layers
        .iter()
        .filter_map(|l| match &l.ffn {
            dev::Ffn::Moe(m) => Some(m.experts.iter()),
            dev::Ffn::Dense(_) => None,
        })
        .flatten()
        .flat_map(|e| e.matrices())
        .map(|w| w.data.len() as u64)
        .sum();
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let total: u64 = desc
        .layers
        .iter()
        .flat_map(|l| l.matrices())
        .map(|w| w.data.len() as u64)
        .sum();
    if model.config.moe.is_some() {
        format!(
            "the experts do not fit the VRAM budget: {on} of {n} layers would fit, and the routed \
             experts take {:.2} of the layers' {:.2} GiB; the CPU runs this mixture-of-experts model",
            gib(experts),
            gib(total)
        )
    } else {
        format!("only {on} of {n} layers fit the VRAM budget; the generation loop runs on the CPU")
    }
}

/// The bound layers of a model resident on the device for hidden states (a text encoder's
/// `hidden_states[k]`, k = the layers bound): the embedding rows are looked up on the CPU, the
/// layers run on the device through the prefill path (`forward_layers`).
pub struct GpuEncoder {
    llm: GpuLlm,
    layers: usize,
}

impl GpuEncoder {
    /// None when the device refuses (the facade logs why at debug verbosity).
    pub fn load(gpu: &Gpu, model: &Model, max_tokens: usize) -> Option<GpuEncoder> {
        let max_context = max_tokens.clamp(1, model.config.max_position_embeddings.max(1));
        // The head is never used; a unit norm stands in when the model bound none.
        let unit = vec![1f32; model.config.hidden_size];
        let norm = if model.weights.final_norm.is_empty() {
            &unit[..]
        } else {
            &model.weights.final_norm[..]
        };
        let desc = describe_bound(model, max_context, norm)
            .map_err(|why| cmf_gpu::facade::log::debug(&format!("encoder: runs on the CPU: {why}")))
            .ok()?;
        let layers = model.weights.layers.len();
        let llm = load_llm(
            gpu,
            &desc,
            max_context,
            Some(&LayerSet::All),
            KvPrecision::Auto,
        )
        .ok()?;
        if llm.placement().device_layer_count() != layers {
            return None;
        }
        Some(GpuEncoder { llm, layers })
    }

    /// `hidden_states[layers]` of `tokens`: `[tokens.len(), hidden]`.
    pub fn hidden_states(
        &mut self,
        model: &Model,
        tokens: &[u32],
    ) -> std::result::Result<Vec<f32>, Refusal> {
        let h = model.config.hidden_size;
        let vocab = model.config.vocab_size;
        if tokens.is_empty()
            || tokens.len() > self.llm.max_context()
            || tokens.iter().any(|&t| t as usize >= vocab)
        {
            return Err(Refusal::new(
                "llm.forward_layers",
                cmf_gpu::RefusalReason::UnsupportedShape(format!(
                    "{} tokens for a device context of {}",
                    tokens.len(),
                    self.llm.max_context()
                )),
            ));
        }
        let mut x = vec![0f32; tokens.len() * h];
        for (row, &t) in x.chunks_exact_mut(h).zip(tokens) {
            cmf_kernels::reference::decode_row(&model.weights.embed, t as usize, row);
        }
        // Causal chunks through every layer (each chunk reads the KV rows of the ones before).
        let chunk = LlmOptions::default().prefill_chunk.max(1);
        for (i, rows) in x.chunks_mut(chunk * h).enumerate() {
            let t = rows.len() / h;
            self.llm
                .forward_layers(0..self.layers, rows, t, i * chunk)?;
        }
        Ok(x)
    }
}

/// A device refusal as the engine's error (bench and perplexity do not switch backends
/// halfway through a measurement).
pub fn refused(r: Refusal) -> LlmError {
    LlmError::Other(format!("GPU: {r}"))
}

/// The generation engine on the device, with the CPU as its fallback.
pub struct GpuEngine<'m, 'a> {
    model: &'m Model<'a>,
    gpu: Option<GpuModel>,
    cpu: Option<CpuEngine<'m, 'a>>,
    /// Ids in the cache, in order (what the CPU replays after a refusal).
    ids: Vec<u32>,
    logits: Vec<f32>,
    limit: usize,
    kv_dtype: cmf_kernels::KvDtype,
    /// The device refused a masked step: masks go to the host from then on (the device still
    /// runs the forward).
    no_masked: bool,
}

impl<'m, 'a> GpuEngine<'m, 'a> {
    /// `limit` and `kv_dtype` size the CPU cache should the device refuse.
    pub fn new(
        model: &'m Model<'a>,
        gpu: GpuModel,
        limit: usize,
        kv_dtype: cmf_kernels::KvDtype,
    ) -> Self {
        let limit = limit.min(gpu.max_context());
        GpuEngine {
            model,
            gpu: Some(gpu),
            cpu: None,
            ids: Vec::new(),
            logits: Vec::new(),
            limit,
            kv_dtype,
            no_masked: false,
        }
    }

    /// Whether the device still runs it (false after a refusal).
    pub fn is_gpu(&self) -> bool {
        self.gpu.is_some()
    }

    /// Leaves the device: a CPU engine replays the cached ids.
    fn fall_back(&mut self) -> Result<&mut CpuEngine<'m, 'a>> {
        self.gpu = None;
        let mut cpu = CpuEngine::new(self.model, self.limit, self.kv_dtype)?;
        if !self.ids.is_empty() {
            cpu.prefill(&self.ids)?;
        }
        Ok(self.cpu.insert(cpu))
    }
}

impl Engine for GpuEngine<'_, '_> {
    fn prefill(&mut self, tokens: &[u32]) -> Result<&[f32]> {
        if let Some(g) = &mut self.gpu {
            if let Ok(l) = g.prefill(
                tokens,
                self.ids.len(),
                Logits::Last,
                self.model.config.vocab_size,
            ) {
                self.ids.extend_from_slice(tokens);
                self.logits = l;
                return Ok(&self.logits);
            }
            self.fall_back()?;
        }
        self.ids.extend_from_slice(tokens);
        self.cpu
            .as_mut()
            .expect("CPU after the device")
            .prefill(tokens)
    }

    fn decode(&mut self, token: u32) -> Result<&[f32]> {
        if let Some(g) = &mut self.gpu {
            if let Ok(out) = g.decode(token, self.ids.len(), true) {
                self.ids.push(token);
                self.logits = out.logits;
                return Ok(&self.logits);
            }
            self.fall_back()?;
        }
        self.ids.push(token);
        self.cpu
            .as_mut()
            .expect("CPU after the device")
            .decode(token)
    }

    fn decode_sampled(&mut self, token: u32, spec: &SampleSpec) -> Result<Option<u32>> {
        let Some(g) = &mut self.gpu else {
            return Ok(None);
        };
        if spec.device_limit().is_some() {
            return Ok(None);
        }
        match g.decode_sampled(token, self.ids.len(), &Sampler::of(spec)) {
            Ok(next) => {
                self.ids.push(token);
                Ok(Some(next))
            }
            Err(_) => {
                // Nothing of this step was kept; the CPU takes over from the cached ids.
                self.fall_back()?;
                Ok(None)
            }
        }
    }

    fn decode_masked(
        &mut self,
        token: u32,
        spec: &SampleSpec,
        mask: &mut dyn FnMut(&mut [u32]),
    ) -> Result<Option<u32>> {
        let Some(g) = &mut self.gpu else {
            return Ok(None);
        };
        if self.no_masked || spec.device_limit().is_some() {
            return Ok(None);
        }
        match g.decode_masked(token, self.ids.len(), &Sampler::of(spec), mask) {
            Ok(next) => {
                self.ids.push(token);
                Ok(Some(next))
            }
            Err(_) => {
                // Nothing of this step was kept. A real device fault refuses the plain decode
                // the caller runs next too, and that moves the engine to the CPU.
                self.no_masked = true;
                Ok(None)
            }
        }
    }

    fn len(&self) -> usize {
        self.ids.len()
    }

    fn limit(&self) -> usize {
        self.limit
    }

    fn truncate(&mut self, len: usize) {
        // A recurrent state cannot rewind either on the device: keep all or nothing, as the
        // CPU engine does (the device restarts its state at position 0).
        let keep = if len < self.ids.len() && self.model.config.gdn.is_some() {
            0
        } else {
            len
        };
        self.ids.truncate(keep);
        if let Some(c) = &mut self.cpu {
            c.truncate(len);
            // The CPU engine keeps less when its state cannot rewind.
            self.ids.truncate(c.len());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cmf_kernels::KvDtype;

    /// `--kv-type` asks the device for the cache the CPU would keep: f16 stays f16 (the device
    /// no longer keeps f32 for an all-float model the CPU caches in f16), f32 stays f32, and
    /// bf16, which the device lacks, gets f32 rather than f16's narrower range.
    #[test]
    fn the_device_cache_follows_the_kv_type() {
        assert_eq!(device_kv(KvDtype::F16), KvPrecision::F16);
        assert_eq!(device_kv(KvDtype::F32), KvPrecision::F32);
        assert_eq!(device_kv(KvDtype::Bf16), KvPrecision::F32);
    }
}
