//! Binding the checkpoint's tensors by name into per-layer weight structs.
//!
//! Matrices stay in their storage codec, borrowed from the mapped file (`cmf_kernels::Weight`);
//! only 1-D tensors (norm weights, biases) are decoded to f32 once. Tensor names are the Hugging
//! Face names the converter keeps (`model.layers.{i}.self_attn.q_proj.weight`, …), optionally under
//! a prefix (the Z-Image pack stores its text encoder under `te.`).
//!
//! Optional operators are chosen by which tensors exist, as the CMF spec prescribes: attention
//! biases (Qwen2, Llama `attention_bias`), MLP biases (Llama `mlp_bias`), Qwen3 q/k norms, a
//! separate `lm_head.weight` (else the embedding is reused, as with tied embeddings). Which mixer
//! a layer has (attention or GatedDeltaNet) comes from the config's `layer_types`; a MoE
//! layer's feed-forward block is bound by [`super::moe::bind`].

use super::config::{Mixer, ModelConfig};
use super::moe::{self, Mlp, MoeWeights};
use crate::error::{LlmError, Result};
use cmf_format::Dtype;
use cmf_kernels::Weight;

/// One tensor as a source hands it out: codec, shape (outermost first) and its bytes.
#[derive(Clone, Debug)]
pub struct TensorRef<'a> {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: &'a [u8],
}

/// Anything that can hand out tensors by name, borrowed for `'a`: a CMF file, a shard set, or
/// (in tests) an in-memory map. The model never needs more than this.
pub trait TensorSource<'a> {
    fn tensor(&self, name: &str) -> Option<TensorRef<'a>>;
}

/// A linear layer y = W·x (+ b).
#[derive(Clone, Debug)]
pub struct Linear<'a> {
    pub w: Weight<'a>,
    pub bias: Option<Vec<f32>>,
}

/// One decoder layer, in checkpoint order: a token mixer, then the feed-forward block.
/// Shapes: hidden H, FFN width F.
#[derive(Clone, Debug)]
pub struct LayerWeights<'a> {
    pub mixer: MixerWeights<'a>,
    /// post_attention_layernorm [H]
    pub ffn_norm: Vec<f32>,
    pub ffn: Ffn<'a>,
}

/// The token mixer's weights, one variant per [`Mixer`].
#[derive(Clone, Debug)]
pub enum MixerWeights<'a> {
    Attention(AttentionWeights<'a>),
    GatedDeltaNet(GdnWeights<'a>),
}

/// An attention mixer. Shapes: q dim Q = heads·head_dim, kv dim K = kv_heads·head_dim.
#[derive(Clone, Debug)]
pub struct AttentionWeights<'a> {
    /// input_layernorm [H]
    pub attn_norm: Vec<f32>,
    /// q_proj [Q, H] (with an output gate: [2Q, H], per head [query | gate]), k_proj / v_proj
    /// [K, H], o_proj [H, Q]
    pub q: Linear<'a>,
    pub k: Linear<'a>,
    pub v: Linear<'a>,
    pub o: Linear<'a>,
    /// Qwen3 per-head RMSNorm weights [head_dim], applied before RoPE.
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
}

/// A GatedDeltaNet mixer (`linear_attn.*`). Shapes from [`cmf_kernels::GdnGeometry`]: key dim
/// Kd = k_heads·dk, value dim Vd = v_heads·dv, conv channels C = 2·Kd + Vd, kernel W.
#[derive(Clone, Debug)]
pub struct GdnWeights<'a> {
    /// input_layernorm [H]
    pub in_norm: Vec<f32>,
    /// in_proj_qkvz [2·Kd + 2·Vd, H], rows grouped per key head: q, k, v, z of that group.
    pub qkvz: Linear<'a>,
    /// in_proj_ba [2·v_heads, H], rows grouped per key head: b then a of that group.
    pub ba: Linear<'a>,
    /// conv1d.weight [C, 1, W] as C rows of W taps (oldest input first).
    pub conv: Vec<f32>,
    /// A_log, dt_bias [v_heads]: decay g = −exp(A_log)·softplus(a + dt_bias).
    pub a_log: Vec<f32>,
    pub dt_bias: Vec<f32>,
    /// norm.weight [dv]: the gated RMSNorm (plain x̂·w, not 1 + w).
    pub norm: Vec<f32>,
    /// out_proj [H, Vd]
    pub out: Linear<'a>,
}

/// A layer's feed-forward block.
#[derive(Clone, Debug)]
pub enum Ffn<'a> {
    /// `mlp.{gate,up,down}_proj`: gate / up [F, H], down [H, F].
    Dense(Mlp<'a>),
    /// Routed experts (and an optional shared expert).
    Moe(MoeWeights<'a>),
}

impl<'a> Ffn<'a> {
    /// The dense MLP, or None for a MoE block.
    pub fn dense(&self) -> Option<&Mlp<'a>> {
        match self {
            Ffn::Dense(m) => Some(m),
            Ffn::Moe(_) => None,
        }
    }
}

#[derive(Clone, Debug)]
pub struct ModelWeights<'a> {
    /// embed_tokens [V, H] in any matrix codec; rows are decoded one at a time.
    pub embed: Weight<'a>,
    pub layers: Vec<LayerWeights<'a>>,
    /// model.norm [H]
    pub final_norm: Vec<f32>,
    /// lm_head [V, H]: its own tensor, or the embedding when tied / absent.
    pub lm_head: Weight<'a>,
}

pub(crate) struct Binder<'s, 'a> {
    pub source: &'s dyn TensorSource<'a>,
    pub prefix: &'s str,
}

impl<'a> Binder<'_, 'a> {
    pub fn has(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    fn get(&self, name: &str) -> Option<(String, TensorRef<'a>)> {
        let full = format!("{}{}", self.prefix, name);
        self.source.tensor(&full).map(|t| (full, t))
    }

    fn require(&self, name: &str) -> Result<(String, TensorRef<'a>)> {
        self.get(name)
            .ok_or_else(|| LlmError::MissingTensor(format!("{}{}", self.prefix, name)))
    }

    /// A matrix of exactly `[rows, cols]`.
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Weight<'a>> {
        let (full, t) = self.require(name)?;
        as_matrix(&full, &t, rows, cols)
    }

    pub fn linear(&self, base: &str, rows: usize, cols: usize) -> Result<Linear<'a>> {
        let w = self.matrix(&format!("{base}.weight"), rows, cols)?;
        let bias = self.opt_vector(&format!("{base}.bias"), rows)?;
        Ok(Linear { w, bias })
    }

    pub fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let (full, t) = self.require(name)?;
        as_vector(&full, &t, len)
    }

    pub fn opt_vector(&self, name: &str, len: usize) -> Result<Option<Vec<f32>>> {
        self.get(name)
            .map(|(full, t)| as_vector(&full, &t, len))
            .transpose()
    }

    pub fn opt_matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Option<Weight<'a>>> {
        self.get(name)
            .map(|(full, t)| as_matrix(&full, &t, rows, cols))
            .transpose()
    }
}

/// Binds every tensor the graph needs, checking shapes against the config.
pub(crate) fn bind<'a>(
    b: &Binder<'_, 'a>,
    cfg: &ModelConfig,
    num_layers: usize,
) -> Result<ModelWeights<'a>> {
    let (h, q, kv, v) = (cfg.hidden_size, cfg.q_dim(), cfg.kv_dim(), cfg.vocab_size);
    let embed = b.matrix("model.embed_tokens.weight", v, h)?;
    let mut layers = Vec::with_capacity(num_layers);
    // With an output gate q_proj emits a gate row for every query row.
    let q_rows = if cfg.attn_output_gate { 2 * q } else { q };
    for i in 0..num_layers {
        let p = format!("model.layers.{i}");
        let mixer = match cfg.mixers[i] {
            Mixer::Attention => {
                let q_norm = b.opt_vector(&format!("{p}.self_attn.q_norm.weight"), cfg.head_dim)?;
                let k_norm = b.opt_vector(&format!("{p}.self_attn.k_norm.weight"), cfg.head_dim)?;
                if q_norm.is_some() != k_norm.is_some() {
                    return Err(LlmError::Tensor {
                        name: format!("{}{p}.self_attn.q_norm.weight", b.prefix),
                        msg: "q_norm and k_norm must both be present or both absent".into(),
                    });
                }
                MixerWeights::Attention(AttentionWeights {
                    attn_norm: b.vector(&format!("{p}.input_layernorm.weight"), h)?,
                    q: b.linear(&format!("{p}.self_attn.q_proj"), q_rows, h)?,
                    k: b.linear(&format!("{p}.self_attn.k_proj"), kv, h)?,
                    v: b.linear(&format!("{p}.self_attn.v_proj"), kv, h)?,
                    o: b.linear(&format!("{p}.self_attn.o_proj"), h, q)?,
                    q_norm,
                    k_norm,
                })
            }
            Mixer::GatedDeltaNet => MixerWeights::GatedDeltaNet(bind_gdn(b, cfg, &p)?),
        };
        layers.push(LayerWeights {
            mixer,
            ffn_norm: b.vector(&format!("{p}.post_attention_layernorm.weight"), h)?,
            ffn: bind_ffn(b, cfg, i, &p)?,
        });
    }
    let final_norm = if num_layers == cfg.num_layers {
        b.vector("model.norm.weight", h)?
    } else {
        Vec::new()
    };
    // transformers ties lm_head to the embedding when tie_word_embeddings is set (any stored
    // lm_head is then ignored); llama.cpp falls back to token_embd when `output` is absent.
    let lm_head = match cfg.tie_word_embeddings {
        true => embed,
        false => b.opt_matrix("lm_head.weight", v, h)?.unwrap_or(embed),
    };
    Ok(ModelWeights {
        embed,
        layers,
        final_norm,
        lm_head,
    })
}

fn bind_gdn<'a>(b: &Binder<'_, 'a>, cfg: &ModelConfig, p: &str) -> Result<GdnWeights<'a>> {
    let g = cfg
        .gdn
        .as_ref()
        .ok_or_else(|| LlmError::Other("a GatedDeltaNet layer without linear_* geometry".into()))?;
    let (h, nv, w) = (cfg.hidden_size, g.num_v_heads, g.conv_kernel);
    let a = format!("{p}.linear_attn");
    // conv1d.weight is [C, 1, W]: read it as the vector of its C·W taps after checking the shape.
    let conv_name = format!("{a}.conv1d.weight");
    let (full, t) = b.require(&conv_name)?;
    if t.shape != [g.conv_dim(), 1, w] {
        return Err(LlmError::Tensor {
            name: full,
            msg: format!("shape {:?}, expected [{}, 1, {w}]", t.shape, g.conv_dim()),
        });
    }
    let flat = TensorRef {
        shape: vec![g.conv_dim() * w],
        ..t
    };
    Ok(GdnWeights {
        in_norm: b.vector(&format!("{p}.input_layernorm.weight"), h)?,
        qkvz: b.linear(&format!("{a}.in_proj_qkvz"), g.qkvz_dim(), h)?,
        ba: b.linear(&format!("{a}.in_proj_ba"), 2 * nv, h)?,
        conv: as_vector(&full, &flat, g.conv_dim() * w)?,
        a_log: b.vector(&format!("{a}.A_log"), nv)?,
        dt_bias: b.vector(&format!("{a}.dt_bias"), nv)?,
        norm: b.vector(&format!("{a}.norm.weight"), g.v_head_dim)?,
        out: b.linear(&format!("{a}.out_proj"), h, g.value_dim())?,
    })
}

/// Layer `i`'s feed-forward block: routed experts where the config's layer plan (or, without
/// one, the presence of the router tensor) says so, else the dense MLP.
fn bind_ffn<'a>(b: &Binder<'_, 'a>, cfg: &ModelConfig, i: usize, p: &str) -> Result<Ffn<'a>> {
    let (h, ff) = (cfg.hidden_size, cfg.intermediate_size);
    if let Some(m) = &cfg.moe {
        if m.is_sparse(i).unwrap_or_else(|| moe::has_router(b, p)) {
            return Ok(Ffn::Moe(moe::bind(b, m, h, p)?));
        }
    }
    Ok(Ffn::Dense(Mlp {
        gate: b.linear(&format!("{p}.mlp.gate_proj"), ff, h)?,
        up: b.linear(&format!("{p}.mlp.up_proj"), ff, h)?,
        down: b.linear(&format!("{p}.mlp.down_proj"), h, ff)?,
    }))
}

fn as_matrix<'a>(name: &str, t: &TensorRef<'a>, rows: usize, cols: usize) -> Result<Weight<'a>> {
    let err = |msg: String| LlmError::Tensor {
        name: name.to_string(),
        msg,
    };
    if t.shape != [rows, cols] {
        return Err(err(format!(
            "shape {:?}, expected [{rows}, {cols}]",
            t.shape
        )));
    }
    match t.dtype {
        Dtype::F32
        | Dtype::F16
        | Dtype::Bf16
        | Dtype::Q8Row
        | Dtype::Q8_2f
        | Dtype::Q4Block
        | Dtype::Q4Tiled => {}
        other => {
            return Err(err(format!(
                "codec {other} is not supported for a weight matrix"
            )))
        }
    }
    let shape = [rows as u64, cols as u64];
    if t.dtype.expected_nbytes(&shape) != Some(t.data.len() as u64) {
        return Err(err(format!(
            "{} bytes do not match codec {} and shape {:?}",
            t.data.len(),
            t.dtype,
            t.shape
        )));
    }
    Ok(Weight {
        dtype: t.dtype,
        rows,
        cols,
        data: t.data,
    })
}

fn as_vector(name: &str, t: &TensorRef, len: usize) -> Result<Vec<f32>> {
    let err = |msg: String| LlmError::Tensor {
        name: name.to_string(),
        msg,
    };
    if t.shape != [len] {
        return Err(err(format!("shape {:?}, expected [{len}]", t.shape)));
    }
    let width = match t.dtype {
        Dtype::F32 => 4,
        Dtype::F16 | Dtype::Bf16 => 2,
        other => {
            return Err(err(format!(
                "codec {other} is not supported for a 1-D tensor (f32/f16/bf16)"
            )))
        }
    };
    if t.data.len() != len * width {
        return Err(err(format!(
            "{} bytes for {len} {} values",
            t.data.len(),
            t.dtype
        )));
    }
    Ok(match t.dtype {
        Dtype::F32 => t
            .data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::F16 => t
            .data
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        _ => t
            .data
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
    })
}
