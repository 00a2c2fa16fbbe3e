//! A fake backend: a "device" that runs the CPU reference forward on its own copy of the
//! weights. It lets the facade's policy (placement, refusal, counters) and callers'
//! fallback paths be tested on machines without a GPU, CI included. Its DiT and VAE are
//! plumbing stand-ins (no reference forward): the DiT's velocity is the item's own patches, the
//! VAE's image is all zeros (mid-gray); numerics are the CUDA tests' job.

use super::{
    Backend, DeviceInfo, DitDevice, Footprint, LlmDevice, MemStats, Placement, Refusal,
    RefusalReason, VaeDevice,
};
use crate::dit::{pad_rows, CondId, DitGeometry, DitItemSetup, DitModel, DitStepItem, RopeRows};
use crate::llm::batch::{self, BatchOut, BatchSeq, PoolShape};
use crate::llm::reference::{self, RefCache};
use crate::llm::{
    AttentionWeights, DecodeOutput, Ffn, GdnGeometry, GdnWeights, LayerWeights, LlmModel,
    LlmOptions, LlmSpec, Logits, Mixer, Mlp, MoeWeights, Routing, Sampler, SharedExpert,
};
use crate::vae::VaeModel;
use cmf_format::Dtype;
use cmf_kernels::Weight;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A backend whose device has `total_bytes` of memory and runs on the CPU.
#[derive(Debug)]
pub struct FakeBackend {
    pub total_bytes: u64,
    stats: Arc<MemStats>,
    /// Faults a test injects; shared with the models it loads.
    pub faults: Arc<FakeFaults>,
}

impl FakeBackend {
    pub fn new(total_bytes: u64) -> FakeBackend {
        FakeBackend {
            total_bytes,
            stats: Arc::new(MemStats::default()),
            faults: Arc::new(FakeFaults {
                alloc_limit: AtomicU64::new(u64::MAX),
                ..FakeFaults::default()
            }),
        }
    }
}

/// What a shared or full card does to a real backend, on demand.
#[derive(Debug, Default)]
pub struct FakeFaults {
    /// Bytes an LLM upload can really allocate (another process holds the rest of what
    /// `free_bytes` reports); more fails as the CUDA driver does. `u64::MAX`: no limit.
    pub alloc_limit: AtomicU64,
    /// The next LLM entry-point call fails to allocate its workspace.
    pub fail_next_alloc: AtomicBool,
    /// Microseconds added to every LLM entry-point call (a card time-sliced with others).
    pub delay_us: AtomicU64,
    /// The next LLM entry-point call panics (a backend bug).
    pub panic_next: AtomicBool,
}

impl FakeFaults {
    /// The driver's out-of-memory error, as the CUDA backend reports it.
    pub fn out_of_memory(op: &'static str, bytes: u64) -> Refusal {
        Refusal::new(
            op,
            RefusalReason::Device(format!(
                "allocating {bytes} bytes on the device: DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")"
            )),
        )
    }

    /// What every LLM entry point goes through first.
    fn before(&self, op: &'static str) -> Result<(), Refusal> {
        let us = self.delay_us.load(Ordering::Relaxed);
        if us > 0 {
            std::thread::sleep(Duration::from_micros(us));
        }
        if self.panic_next.swap(false, Ordering::Relaxed) {
            panic!("{op}: injected backend panic");
        }
        if self.fail_next_alloc.swap(false, Ordering::Relaxed) {
            return Err(FakeFaults::out_of_memory(op, 1 << 20));
        }
        Ok(())
    }
}

impl Backend for FakeBackend {
    fn info(&self) -> DeviceInfo {
        DeviceInfo {
            name: "fake".into(),
            ordinal: 0,
            count: 1,
            arch: "cpu".into(),
            total_bytes: self.total_bytes,
            free_bytes: self.total_bytes,
        }
    }

    fn stats(&self) -> &MemStats {
        &self.stats
    }

    fn llm_footprint(&self, model: &LlmModel, opts: &LlmOptions) -> Result<Footprint, Refusal> {
        let s = &model.spec;
        let kv = (2 * opts.max_context * s.kv_dim() * 4) as u64;
        let layer_bytes = model
            .layers
            .iter()
            .map(|w| {
                w.matrices()
                    .iter()
                    .map(|m| m.data.len() as u64)
                    .sum::<u64>()
                    + kv
            })
            .collect();
        let head_bytes = (model.embed.data.len()
            + if model.head_is_tied() {
                0
            } else {
                model.lm_head.data.len()
            }) as u64;
        Ok(Footprint {
            layer_bytes,
            head_bytes,
            fixed_bytes: 0,
        })
    }

    fn load_dit(&self, model: &DitModel) -> Result<Box<dyn DitDevice>, Refusal> {
        Ok(Box::new(FakeDit {
            geo: model.geo.clone(),
            conds: Vec::new(),
            items: Vec::new(),
            ni: 0,
        }))
    }

    fn load_vae(&self, model: &VaeModel) -> Result<Box<dyn VaeDevice>, Refusal> {
        let g = &model.geometry;
        Ok(Box::new(FakeVae {
            latent_channels: g.latent_channels,
            out_channels: g.out_channels,
            scale: 1 << g.block_out_channels.len().saturating_sub(1),
        }))
    }

    fn load_llm(
        &self,
        model: &LlmModel,
        opts: &LlmOptions,
        placement: &Placement,
    ) -> Result<Box<dyn LlmDevice>, Refusal> {
        let fp = self.llm_footprint(model, opts)?;
        let on: u64 = fp
            .layer_bytes
            .iter()
            .zip(&placement.on_device)
            .filter(|(_, &on)| on)
            .map(|(b, _)| b)
            .sum();
        let head = if placement.head_on_device {
            fp.head_bytes
        } else {
            0
        };
        let bytes = on + head + fp.fixed_bytes;
        if bytes > self.faults.alloc_limit.load(Ordering::Relaxed) {
            return Err(FakeFaults::out_of_memory("llm.load", bytes));
        }
        let owned = OwnedModel::copy(model);
        self.stats.add_uploaded(owned.bytes);
        self.stats.add_resident(owned.bytes);
        Ok(Box::new(FakeLlm {
            pool: None,
            cache: RefCache::new(model.spec.num_layers),
            ids: Vec::new(),
            model: owned,
            placement: placement.clone(),
            stats: self.stats.clone(),
            faults: self.faults.clone(),
        }))
    }
}

#[derive(Debug, Clone)]
struct OwnedWeight {
    dtype: Dtype,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
}

impl OwnedWeight {
    fn copy(w: &Weight) -> OwnedWeight {
        OwnedWeight {
            dtype: w.dtype,
            rows: w.rows,
            cols: w.cols,
            data: w.data.to_vec(),
        }
    }
    fn view(&self) -> Weight<'_> {
        Weight {
            dtype: self.dtype,
            rows: self.rows,
            cols: self.cols,
            data: &self.data,
        }
    }
}

/// An owned copy of a layer: its matrices in the order of [`LayerWeights::matrices`], its
/// vectors, and what [`OwnedModel::view`] needs to rebuild the description around them.
#[derive(Debug, Clone)]
struct OwnedLayer {
    m: Vec<OwnedWeight>,
    /// attn_norm, ffn_norm, q/k/v biases, q/k norms, the routing bias.
    vecs: [Option<Vec<f32>>; 8],
    /// Whether the attention has an output gate.
    output_gate: bool,
    /// A GatedDeltaNet mixer: its geometry and conv taps, A_log, dt_bias, gated-norm weight.
    gdn: Option<(GdnGeometry, [Vec<f32>; 4])>,
    ffn: OwnedFfn,
}

/// The feed-forward block's shape (the matrices live in `OwnedLayer::m`).
#[derive(Debug, Clone, Copy)]
enum OwnedFfn {
    Dense,
    Moe {
        experts: usize,
        top_k: usize,
        norm_topk_prob: bool,
        /// (n_group, topk_group, routed_scaling_factor) of sigmoid group routing.
        group: Option<(usize, usize, f32)>,
        /// Whether there is a shared expert, and whether it has a gate.
        shared: Option<bool>,
    },
}

#[derive(Debug)]
struct OwnedModel {
    spec: LlmSpec,
    embed: OwnedWeight,
    lm_head: OwnedWeight,
    final_norm: Vec<f32>,
    layers: Vec<OwnedLayer>,
    bytes: u64,
}

impl OwnedModel {
    fn copy(m: &LlmModel) -> OwnedModel {
        let layers: Vec<OwnedLayer> = m
            .layers
            .iter()
            .map(|w| {
                let a = w.attention();
                let gdn = w.gated_delta().map(|g| {
                    let v = [g.conv, g.a_log, g.dt_bias, g.norm].map(|v| v.to_vec());
                    (g.geometry, v)
                });
                let (ffn, bias) = match &w.ffn {
                    Ffn::Dense(_) => (OwnedFfn::Dense, None),
                    Ffn::Moe(x) => {
                        let (group, bias) = match x.routing {
                            Routing::Softmax => (None, None),
                            Routing::SigmoidGroup {
                                n_group,
                                topk_group,
                                routed_scaling_factor,
                                bias,
                            } => (
                                Some((n_group, topk_group, routed_scaling_factor)),
                                Some(bias),
                            ),
                        };
                        let ffn = OwnedFfn::Moe {
                            experts: x.experts.len(),
                            top_k: x.top_k,
                            norm_topk_prob: x.norm_topk_prob,
                            group,
                            shared: x.shared.as_ref().map(|s| s.gate.is_some()),
                        };
                        (ffn, bias)
                    }
                };
                OwnedLayer {
                    m: w.matrices().iter().map(OwnedWeight::copy).collect(),
                    vecs: [
                        Some(w.attn_norm),
                        Some(w.ffn_norm),
                        a.and_then(|a| a.q_bias),
                        a.and_then(|a| a.k_bias),
                        a.and_then(|a| a.v_bias),
                        a.and_then(|a| a.q_norm),
                        a.and_then(|a| a.k_norm),
                        bias,
                    ]
                    .map(|v| v.map(|s| s.to_vec())),
                    output_gate: a.is_some_and(|a| a.output_gate),
                    gdn,
                    ffn,
                }
            })
            .collect();
        let bytes = layers
            .iter()
            .flat_map(|l| l.m.iter())
            .map(|w| w.data.len() as u64)
            .sum::<u64>()
            + (m.embed.data.len() + m.lm_head.data.len()) as u64;
        OwnedModel {
            spec: m.spec.clone(),
            embed: OwnedWeight::copy(&m.embed),
            lm_head: OwnedWeight::copy(&m.lm_head),
            final_norm: m.final_norm.to_vec(),
            layers,
            bytes,
        }
    }

    fn view(&self) -> LlmModel<'_> {
        let layers = self
            .layers
            .iter()
            .map(|l| {
                let v = |i: usize| l.vecs[i].as_deref();
                let mut m = l.m.iter().map(OwnedWeight::view);
                let mixer = match &l.gdn {
                    Some((geometry, [conv, a_log, dt_bias, norm])) => {
                        Mixer::GatedDelta(GdnWeights {
                            geometry: *geometry,
                            qkvz: next(&mut m),
                            ba: next(&mut m),
                            out: next(&mut m),
                            conv,
                            a_log,
                            dt_bias,
                            norm,
                        })
                    }
                    None => Mixer::Attention(AttentionWeights {
                        q: next(&mut m),
                        k: next(&mut m),
                        v: next(&mut m),
                        o: next(&mut m),
                        q_bias: v(2),
                        k_bias: v(3),
                        v_bias: v(4),
                        q_norm: v(5),
                        k_norm: v(6),
                        output_gate: l.output_gate,
                    }),
                };
                let ffn = match l.ffn {
                    OwnedFfn::Dense => Ffn::Dense(mlp(&mut m)),
                    OwnedFfn::Moe {
                        experts,
                        top_k,
                        norm_topk_prob,
                        group,
                        shared,
                    } => {
                        let router = next(&mut m);
                        let experts = (0..experts).map(|_| mlp(&mut m)).collect();
                        let shared = shared.map(|gated| SharedExpert {
                            mlp: mlp(&mut m),
                            gate: gated.then(|| next(&mut m)),
                        });
                        let routing = match group {
                            None => Routing::Softmax,
                            Some((n_group, topk_group, routed_scaling_factor)) => {
                                Routing::SigmoidGroup {
                                    n_group,
                                    topk_group,
                                    routed_scaling_factor,
                                    bias: v(7).unwrap_or(&[]),
                                }
                            }
                        };
                        Ffn::Moe(MoeWeights {
                            router,
                            experts,
                            top_k,
                            norm_topk_prob,
                            routing,
                            shared,
                        })
                    }
                };
                LayerWeights {
                    attn_norm: v(0).unwrap_or(&[]),
                    mixer,
                    ffn_norm: v(1).unwrap_or(&[]),
                    ffn,
                }
            })
            .collect();
        LlmModel {
            spec: self.spec.clone(),
            embed: self.embed.view(),
            layers,
            final_norm: &self.final_norm,
            lm_head: self.lm_head.view(),
        }
    }
}

/// The next matrix of a layer, in [`LayerWeights::matrices`] order.
fn next<'a>(m: &mut dyn Iterator<Item = Weight<'a>>) -> Weight<'a> {
    m.next().expect("matrices in LayerWeights::matrices order")
}

fn mlp<'a>(m: &mut dyn Iterator<Item = Weight<'a>>) -> Mlp<'a> {
    Mlp {
        gate: next(m),
        up: next(m),
        down: next(m),
    }
}

/// The fake's KV block pool: per layer, `[blocks · B, NKV·D]` keys and values in f32.
struct FakePool {
    shape: PoolShape,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

struct FakeLlm {
    pool: Option<FakePool>,
    model: OwnedModel,
    cache: RefCache,
    /// The token at each cached position (the penalties' window).
    ids: Vec<u32>,
    placement: Placement,
    stats: Arc<MemStats>,
    faults: Arc<FakeFaults>,
}

impl FakeLlm {
    /// As the CUDA backend: a recurrent state goes on from where it is, or restarts at 0.
    fn resume(&self, op: &'static str, pos: usize) -> Result<(), Refusal> {
        if self.cache.can_resume(pos) {
            return Ok(());
        }
        Err(fake_refusal(
            op,
            &format!("the recurrent state cannot resume at position {pos}"),
        ))
    }

    fn need_whole(&self, op: &'static str) -> Result<(), Refusal> {
        if !self.placement.is_whole_model() {
            return Err(Refusal::new(
                op,
                RefusalReason::NotResident("the whole model".into()),
            ));
        }
        Ok(())
    }
}

impl LlmDevice for FakeLlm {
    fn placement(&self) -> &Placement {
        &self.placement
    }

    fn max_context(&self) -> usize {
        usize::MAX
    }

    fn decode(
        &mut self,
        token: u32,
        pos: usize,
        sampler: &Sampler,
        want_logits: bool,
        out: &mut DecodeOutput,
    ) -> Result<(), Refusal> {
        self.need_whole("llm.decode")?;
        self.faults.before("llm.decode")?;
        if let Some(why) = match sampler {
            Sampler::Sample(spec) => spec.device_limit(),
            Sampler::Greedy => None,
        } {
            return Err(Refusal::new(
                "llm.decode",
                RefusalReason::UnsupportedShape(why),
            ));
        }
        self.resume("llm.decode", pos)?;
        let kv = self.model.spec.kv_dim();
        self.cache.truncate(pos, kv);
        self.ids.truncate(pos);
        self.ids.push(token);
        let logits = reference::forward_token(&self.model.view(), token, pos, &mut self.cache);
        // The device samplers run the host's algorithm; the fake runs it literally.
        out.token = match sampler {
            Sampler::Greedy => reference::argmax(&logits),
            Sampler::Sample(spec) => {
                let window = &self.ids[self.ids.len().saturating_sub(spec.penalty_last_n)..];
                crate::llm::sample::sample(&mut logits.clone(), window, spec, pos as u64)
            }
        };
        out.logits = if want_logits { logits } else { Vec::new() };
        self.stats.add_downloaded(4);
        Ok(())
    }

    fn decode_masked(
        &mut self,
        token: u32,
        pos: usize,
        sampler: &Sampler,
        mask: &mut dyn FnMut(&mut [u32]),
    ) -> Result<u32, Refusal> {
        self.need_whole("llm.decode_masked")?;
        self.faults.before("llm.decode_masked")?;
        if let Sampler::Sample(spec) = sampler {
            if let Some(why) = spec.device_limit() {
                return Err(Refusal::new(
                    "llm.decode_masked",
                    RefusalReason::UnsupportedShape(why),
                ));
            }
        }
        let kv = self.model.spec.kv_dim();
        self.cache.truncate(pos, kv);
        self.ids.truncate(pos);
        self.ids.push(token);
        let mut logits = reference::forward_token(&self.model.view(), token, pos, &mut self.cache);
        let mut bits = vec![u32::MAX; crate::llm::sample::mask_words(logits.len())];
        mask(&mut bits);
        crate::llm::sample::apply_token_mask(&mut logits, &bits);
        let token = match sampler {
            Sampler::Greedy => crate::llm::sample::argmax(&logits),
            Sampler::Sample(spec) => {
                let window = &self.ids[self.ids.len().saturating_sub(spec.penalty_last_n)..];
                crate::llm::sample::sample(&mut logits, window, spec, pos as u64)
            }
        };
        self.stats.add_downloaded(4);
        Ok(token)
    }

    fn prefill(
        &mut self,
        tokens: &[u32],
        start: usize,
        logits: Logits,
        out: &mut [f32],
    ) -> Result<(), Refusal> {
        self.need_whole("llm.prefill")?;
        self.faults.before("llm.prefill")?;
        let vocab = self.model.spec.vocab;
        if out.len() != logits.len(tokens.len(), vocab) {
            return Err(Refusal::new(
                "llm.prefill",
                RefusalReason::UnsupportedShape("logits buffer size".into()),
            ));
        }
        self.resume("llm.prefill", start)?;
        self.cache.truncate(start, self.model.spec.kv_dim());
        self.ids.truncate(start);
        self.ids.extend_from_slice(tokens);
        let model = self.model.view();
        let mut all = Vec::new();
        for (i, &t) in tokens.iter().enumerate() {
            all.push(reference::forward_token(
                &model,
                t,
                start + i,
                &mut self.cache,
            ));
        }
        match logits {
            Logits::None => {}
            Logits::Last => out.copy_from_slice(all.last().map(|v| v.as_slice()).unwrap_or(&[])),
            Logits::All => out.copy_from_slice(&all.concat()),
        }
        Ok(())
    }

    fn forward_layers(
        &mut self,
        layers: Range<usize>,
        x: &mut [f32],
        t: usize,
        start: usize,
    ) -> Result<(), Refusal> {
        if layers
            .clone()
            .any(|l| !self.placement.on_device.get(l).copied().unwrap_or(false))
        {
            return Err(Refusal::new(
                "llm.forward_layers",
                RefusalReason::NotResident(format!("layers {layers:?}")),
            ));
        }
        self.faults.before("llm.forward_layers")?;
        self.resume("llm.forward_layers", start)?;
        let h = self.model.spec.hidden;
        let kv = self.model.spec.kv_dim();
        let model = self.model.view();
        let mut y = x.to_vec();
        for l in layers.clone() {
            self.cache.truncate_layer(l, start, kv);
            for i in 0..t {
                reference::layer(
                    &model,
                    l,
                    &mut y[i * h..(i + 1) * h],
                    start + i,
                    &mut self.cache,
                );
            }
        }
        x.copy_from_slice(&y);
        Ok(())
    }

    fn kv_block_bytes(&self, block_size: usize) -> u64 {
        self.block_bytes(block_size)
    }

    fn kv_pool(&mut self, bytes: u64, block_size: usize) -> Result<PoolShape, Refusal> {
        self.need_whole("llm.kv_pool")?;
        self.faults.before("llm.kv_pool")?;
        if block_size == 0 {
            return Err(fake_refusal("llm.kv_pool", "block size 0"));
        }
        // As the CUDA backend: the batched step has no recurrent-state slots.
        if self.model.layers.iter().any(|l| l.gdn.is_some()) {
            return Err(fake_refusal(
                "llm.kv_pool",
                "the batched step has no GatedDeltaNet layers",
            ));
        }
        let blocks = (bytes / self.block_bytes(block_size)) as usize;
        if blocks == 0 {
            return Err(Refusal::new(
                "llm.kv_pool",
                RefusalReason::OutOfMemory {
                    need: self.block_bytes(block_size),
                    budget: bytes,
                },
            ));
        }
        let s = &self.model.spec;
        let n = blocks * block_size * s.kv_dim();
        let shape = PoolShape { block_size, blocks };
        self.pool = Some(FakePool {
            shape,
            k: vec![vec![0.0; n]; s.num_layers],
            v: vec![vec![0.0; n]; s.num_layers],
        });
        Ok(shape)
    }

    fn batch_step(&mut self, seqs: &[BatchSeq], out: BatchOut) -> Result<(), Refusal> {
        self.need_whole("llm.batch_step")?;
        self.faults.before("llm.batch_step")?;
        let shape = self.pool.as_ref().map(|p| p.shape);
        batch::validate(seqs, &out, shape, self.model.spec.vocab, usize::MAX)?;
        self.run_batch(seqs, out);
        Ok(())
    }

    fn head(&mut self, x: &[f32], t: usize, logits: &mut [f32]) -> Result<(), Refusal> {
        if !self.placement.head_on_device {
            return Err(Refusal::new(
                "llm.head",
                RefusalReason::NotResident("lm_head".into()),
            ));
        }
        self.faults.before("llm.head")?;
        let (h, v) = (self.model.spec.hidden, self.model.spec.vocab);
        let model = self.model.view();
        for i in 0..t {
            logits[i * v..(i + 1) * v]
                .copy_from_slice(&reference::head(&model, &x[i * h..(i + 1) * h]));
        }
        Ok(())
    }
}

impl FakeLlm {
    /// Bytes the fake's pool takes per block (f32 keys and values of every layer).
    fn block_bytes(&self, block_size: usize) -> u64 {
        let s = &self.model.spec;
        (2 * s.num_layers * block_size * s.kv_dim() * 4) as u64
    }

    /// The reference forward of each sequence's new tokens over the positions its block table
    /// holds; the new keys and values go back to its blocks.
    fn run_batch(&mut self, seqs: &[BatchSeq], out: BatchOut) {
        let pool = self.pool.as_mut().expect("validated");
        let bs = pool.shape.block_size;
        let model = self.model.view();
        let (layers, kv) = (model.spec.num_layers, model.spec.kv_dim());
        let slot = |s: &BatchSeq, p: usize| s.blocks[p / bs] as usize * bs + p % bs;
        let mut wanted = Vec::new();
        for s in seqs {
            let gather = |pool: &[f32]| -> Vec<f32> {
                (0..s.start)
                    .flat_map(|p| pool[slot(s, p) * kv..][..kv].iter().copied())
                    .collect()
            };
            let mut cache = RefCache::from_rows(
                pool.k.iter().map(|l| gather(l)).collect(),
                pool.v.iter().map(|l| gather(l)).collect(),
            );
            let mut last = Vec::new();
            for (i, &t) in s.tokens.iter().enumerate() {
                last = reference::forward_token(&model, t, s.start + i, &mut cache);
            }
            for l in 0..layers {
                let (k, v) = cache.rows(l);
                for p in s.start..s.start + s.tokens.len() {
                    let at = slot(s, p) * kv;
                    pool.k[l][at..at + kv].copy_from_slice(&k[p * kv..][..kv]);
                    pool.v[l][at..at + kv].copy_from_slice(&v[p * kv..][..kv]);
                }
            }
            if s.want {
                wanted.push(last);
            }
        }
        match out {
            BatchOut::Logits(dst) => dst.copy_from_slice(&wanted.concat()),
            BatchOut::Greedy(dst) => {
                for (d, l) in dst.iter_mut().zip(&wanted) {
                    *d = reference::argmax(l);
                }
            }
            // The device's draw is the host sampler's (cuda/llm/batched/sample.rs checks it).
            BatchOut::Sampled { rows, ids } => {
                for ((d, l), r) in ids.iter_mut().zip(&mut wanted).zip(rows) {
                    *d = r.sample_host(l);
                }
            }
        }
    }
}

fn fake_refusal(op: &'static str, why: &str) -> Refusal {
    Refusal::new(op, RefusalReason::UnsupportedShape(why.into()))
}

/// The fake DiT: checks what callers hand it as the CUDA DiT does (caption and RoPE sizes, the
/// prepared items, the output size) and returns each item's patches as its velocity.
struct FakeDit {
    geo: DitGeometry,
    /// Padded length of each conditioned caption.
    conds: Vec<usize>,
    /// Caption of each prepared item.
    items: Vec<usize>,
    ni: usize,
}

impl DitDevice for FakeDit {
    fn condition(&mut self, cap: &[f32], len: usize, rope: RopeRows) -> Result<CondId, Refusal> {
        let half = self.geo.head_dim() / 2;
        let lp = pad_rows(len.max(1));
        if len == 0 || cap.len() != len * self.geo.cap_feat_dim {
            return Err(fake_refusal("dit.condition", "caption size"));
        }
        if rope.cos.len() != lp * half || rope.sin.len() != lp * half {
            return Err(fake_refusal("dit.condition", "caption RoPE rows"));
        }
        self.conds.push(lp);
        Ok(CondId(self.conds.len() - 1))
    }

    fn prepare(&mut self, items: &[DitItemSetup], ni: usize) -> Result<(), Refusal> {
        let half = self.geo.head_dim() / 2;
        let mut caps = Vec::with_capacity(items.len());
        for it in items {
            let lp = *self
                .conds
                .get(it.cond.0)
                .ok_or_else(|| fake_refusal("dit.prepare", "unknown caption"))?;
            let want = (pad_rows(ni) + lp) * half;
            if it.rope.cos.len() != want || it.rope.sin.len() != want {
                return Err(fake_refusal("dit.prepare", "joint RoPE rows"));
            }
            caps.push(it.cond.0);
        }
        self.items = caps;
        self.ni = ni;
        Ok(())
    }

    fn step(&mut self, items: &[DitStepItem], out: &mut [f32]) -> Result<(), Refusal> {
        let per = self.ni * self.geo.patch_dim;
        if self.items.is_empty() || out.len() != items.len() * per {
            return Err(fake_refusal("dit.step", "not prepared, or output size"));
        }
        if items.iter().any(|it| {
            it.slot >= self.items.len()
                || it.patches.len() != per
                || it.t_emb.len() != self.geo.adaln_dim
        }) {
            return Err(fake_refusal("dit.step", "item slot or input size"));
        }
        for (o, it) in out.chunks_exact_mut(per).zip(items) {
            o.copy_from_slice(it.patches);
        }
        Ok(())
    }

    fn release(&mut self) {
        self.conds.clear();
        self.items.clear();
    }
}

/// The fake VAE: checks sizes and writes zeros.
struct FakeVae {
    latent_channels: usize,
    out_channels: usize,
    scale: usize,
}

impl VaeDevice for FakeVae {
    fn decode(&mut self, z: &[f32], h: usize, w: usize, out: &mut [f32]) -> Result<(), Refusal> {
        let want = self.out_channels * h * self.scale * w * self.scale;
        if z.len() != self.latent_channels * h * w || out.len() != want {
            return Err(fake_refusal("vae.decode", "latent or output size"));
        }
        out.fill(0.0);
        Ok(())
    }
}
