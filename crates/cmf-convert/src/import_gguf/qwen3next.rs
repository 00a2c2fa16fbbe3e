//! llama.cpp's `qwen3next` layout → the Hugging Face Qwen3-Next tensors and config fields.
//!
//! llama.cpp's converter (`conversion/qwen.py`, `Qwen3NextModel.modify_tensors`) changes a
//! checkpoint in ways the importer undoes here:
//! - `linear_attn.A_log` is stored as `ssm_a` = −exp(A_log): inverted per element ([`a_log`]);
//! - every zero-centred RMSNorm weight (`input_layernorm`, `post_attention_layernorm`,
//!   `model.norm`, the attention's `q_norm` / `k_norm`; not the GDN's gated `linear_attn.norm`)
//!   is stored + 1: 1 is subtracted again ([`Fix::MinusOne`]);
//! - `in_proj_qkvz` (rows grouped per key head: q, k, v, z) is stored regrouped as `attn_qkv`
//!   (all q rows, then all k rows, then all v rows) and `attn_gate` (the z rows); files from
//!   before that split hold it unchanged as `ssm_in` ([`qkvz_source_row`]);
//! - `dt_bias` is named `ssm_dt.bias`, the conv weight [channels, 1, kernel] is squeezed to
//!   [channels, kernel] (same bytes: only the shape is put back).
//!
//! Geometry (llama.cpp's `load_arch_hparams`): `ssm.group_count` key heads, `ssm.time_step_rank`
//! value heads, `ssm.state_size` key head dim, `ssm.inner_size / time_step_rank` value head dim
//! (as its graph computes it), `ssm.conv_kernel`. Layer kinds come from
//! `attention.recurrent_layers` when present, else layer i is recurrent unless
//! (i + 1) % `full_attention_interval` (default 4) is 0.

use std::path::Path;

use cmf_format::{Arch, Dtype, LayerType};
use serde_json::{Map, Value as Json};

use super::{default_dtype, Meta};
use crate::error::{ConvertError, Result};
use crate::gguf::{Gguf, TensorInfo};
use crate::hf::config::HfConfig;
use crate::hf::qwen3_next::Qwen3Next;
use crate::Options;

/// One planned Hugging Face tensor read from a regrouped pair: name, shape, codec and the
/// `attn_gate` tensor beside the `attn_qkv` one being planned.
pub(super) type Regrouped<'a> = (String, Vec<usize>, Dtype, Option<&'a TensorInfo>);

/// A per-element change applied to a tensor's values after dequantization.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fix {
    None,
    /// Norm weights stored as 1 + w.
    MinusOne,
    /// `ssm_a` = −exp(A_log) back to A_log.
    ALog,
}

/// The hybrid geometry and per-layer kinds; adds the header's `linear_*` extras to `extra`.
pub(super) fn parse(
    m: &Meta,
    num_layers: usize,
    extra: &mut Map<String, Json>,
) -> Result<(Vec<LayerType>, Qwen3Next)> {
    let k_heads = m.usize_req("ssm.group_count")?;
    let v_heads = m.usize_req("ssm.time_step_rank")?;
    let k_head_dim = m.usize_req("ssm.state_size")?;
    let inner = m.usize_req("ssm.inner_size")?;
    let conv_kernel = m.usize_req("ssm.conv_kernel")?;
    if inner % v_heads != 0 {
        return Err(ConvertError::field(
            m.file,
            m.key("ssm.inner_size"),
            format!("{inner} is not a multiple of ssm.time_step_rank {v_heads}"),
        ));
    }
    if v_heads % k_heads != 0 {
        return Err(ConvertError::field(
            m.file,
            m.key("ssm.time_step_rank"),
            format!("{v_heads} value heads are not a multiple of ssm.group_count {k_heads}"),
        ));
    }
    let geo = Qwen3Next {
        k_heads,
        v_heads,
        k_head_dim,
        v_head_dim: inner / v_heads,
        conv_kernel,
    };
    for (key, gguf_key, v) in [
        ("linear_num_key_heads", "ssm.group_count", geo.k_heads),
        ("linear_num_value_heads", "ssm.time_step_rank", geo.v_heads),
        ("linear_key_head_dim", "ssm.state_size", geo.k_head_dim),
        ("linear_value_head_dim", "ssm.inner_size", geo.v_head_dim),
        ("linear_conv_kernel_dim", "ssm.conv_kernel", geo.conv_kernel),
    ] {
        // The bounds `cmf convert` puts on the same config fields.
        if v > 4096 {
            return Err(ConvertError::field(
                m.file,
                m.key(gguf_key),
                format!("{key} {v} is outside 1..=4096"),
            ));
        }
        extra.insert(key.into(), v.into());
    }
    Ok((layer_types(m, num_layers)?, geo))
}

fn layer_types(m: &Meta, n: usize) -> Result<Vec<LayerType>> {
    let kind = |recurrent: bool| match recurrent {
        true => LayerType::LinearAttention,
        false => LayerType::FullAttention,
    };
    if let Some(v) = m.get("attention.recurrent_layers") {
        let key = m.key("attention.recurrent_layers");
        let Some((_, items)) = v.as_array() else {
            return Err(ConvertError::field(
                m.file,
                key,
                "expected an array of bools",
            ));
        };
        if items.len() != n {
            return Err(ConvertError::field(
                m.file,
                key,
                format!("has {} entries for block_count {n}", items.len()),
            ));
        }
        return items
            .iter()
            .map(|b| {
                b.as_bool()
                    .map(kind)
                    .ok_or_else(|| ConvertError::field(m.file, &key, "expected an array of bools"))
            })
            .collect();
    }
    let interval = m.usize_opt("full_attention_interval")?.unwrap_or(4);
    if interval == 0 {
        return Err(ConvertError::field(
            m.file,
            m.key("full_attention_interval"),
            "must be positive",
        ));
    }
    Ok((0..n).map(|i| kind((i + 1) % interval != 0)).collect())
}

/// `blk.N.attn_qkv.weight` → the plan for `in_proj_qkvz` (with its `attn_gate`);
/// `blk.N.attn_gate.weight` → nothing (read with its `attn_qkv`); any other tensor → `None`.
pub(super) fn regrouped_qkvz<'a>(
    file: &Path,
    g: &'a Gguf,
    geo: &Qwen3Next,
    t: &'a TensorInfo,
    opts: &Options,
) -> Result<Option<Vec<Regrouped<'a>>>> {
    let Some(rest) = t.name.strip_prefix("blk.") else {
        return Ok(None);
    };
    let Some((layer, tail)) = rest.split_once('.') else {
        return Ok(None);
    };
    match tail {
        "attn_gate.weight" => {
            if g.tensor(&format!("blk.{layer}.attn_qkv.weight")).is_none() {
                return Err(ConvertError::tensor(
                    file,
                    &t.name,
                    format!("present without blk.{layer}.attn_qkv.weight"),
                ));
            }
            return Ok(Some(Vec::new()));
        }
        "attn_qkv.weight" => {}
        _ => return Ok(None),
    }
    let gate_name = format!("blk.{layer}.attn_gate.weight");
    let gate = g
        .tensor(&gate_name)
        .ok_or_else(|| ConvertError::tensor(file, &t.name, format!("{gate_name} is missing")))?;
    let (kd, vd) = (geo.k_heads * geo.k_head_dim, geo.v_heads * geo.v_head_dim);
    let dims = |x: &TensorInfo| -> Vec<usize> { x.shape().iter().map(|&d| d as usize).collect() };
    let (qkv, z) = (dims(t), dims(gate));
    if qkv.len() != 2 || qkv[0] != 2 * kd + vd {
        return Err(ConvertError::tensor(
            file,
            &t.name,
            format!(
                "shape {qkv:?} is not [{} (q, k, v rows), hidden]",
                2 * kd + vd
            ),
        ));
    }
    if z != [vd, qkv[1]] {
        return Err(ConvertError::tensor(
            file,
            &gate_name,
            format!("shape {z:?} is not [{vd}, {}]", qkv[1]),
        ));
    }
    for x in [t, gate] {
        if !x.ty.can_dequantize() {
            return Err(ConvertError::tensor(
                file,
                &x.name,
                format!("GGUF tensor type {} is not supported", x.ty),
            ));
        }
    }
    let shape = vec![2 * kd + 2 * vd, qkv[1]];
    let dtype = match opts.quant {
        Some(q) => q.dtype_for(&shape),
        None => default_dtype(t.ty, &shape),
    };
    let hf = format!("model.layers.{layer}.linear_attn.in_proj_qkvz.weight");
    Ok(Some(vec![(hf, shape, dtype, Some(gate))]))
}

/// The Hugging Face shape of a qwen3next tensor: the conv weight gets back its middle axis of 1
/// and the shared expert's gate its row axis (llama.cpp loads either as a vector).
pub(super) fn hf_shape(file: &Path, t: &TensorInfo, hf: &str) -> Result<Vec<usize>> {
    let shape: Vec<usize> = t.shape().iter().map(|&d| d as usize).collect();
    if hf.ends_with(".linear_attn.conv1d.weight") {
        return match shape[..] {
            [ch, k] => Ok(vec![ch, 1, k]),
            _ => Err(ConvertError::tensor(
                file,
                &t.name,
                format!("shape {shape:?} is not [channels, kernel]"),
            )),
        };
    }
    if hf.ends_with(".mlp.shared_expert_gate.weight") && shape.len() == 1 {
        return Ok(vec![1, shape[0]]);
    }
    Ok(shape)
}

/// The imported tensors hold what `cmf convert` requires of the same model: every tensor a layer
/// of its kind needs, in the same shape (so llama.cpp's geometry keys were read consistently).
pub(super) fn check_tensors(
    file: &Path,
    arch: &Arch,
    geo: &Qwen3Next,
    have: &[(&str, &[usize])],
) -> Result<()> {
    let sparse: Vec<bool> = (0..arch.num_layers)
        .map(|i| {
            let router = format!("model.layers.{i}.mlp.gate.weight");
            have.iter().any(|(n, _)| *n == router)
        })
        .collect();
    let cfg = HfConfig {
        arch: arch.clone(),
        attention_bias: false,
        mlp_bias: false,
        sparse_layers: sparse,
        eos_token_ids: Vec::new(),
        bos_token_id: None,
        pad_token_id: None,
        qwen3_next: Some(geo.clone()),
    };
    for (name, shape) in crate::hf::required_tensors(&cfg) {
        match have.iter().find(|(n, _)| *n == name) {
            None => return Err(ConvertError::tensor(
                file,
                &name,
                "missing: no GGUF tensor maps to it (the llama.cpp tensor for this layer's kind)",
            )),
            Some((_, s)) if *s != shape.as_slice() => {
                return Err(ConvertError::tensor(
                    file,
                    &name,
                    format!(
                    "shape {s:?} after import, expected {shape:?} from the GGUF's geometry keys"
                ),
                ))
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// For row `row` of the Hugging Face `in_proj_qkvz` (per key head: q [dk], k [dk],
/// v [r·dv], z [r·dv] with r = value heads per key head), where llama.cpp's regrouped pair
/// holds it: `(false, row of attn_qkv)` or `(true, row of attn_gate)`.
pub fn qkvz_source_row(geo: &Qwen3Next, row: usize) -> (bool, usize) {
    let (dk, nk) = (geo.k_head_dim, geo.k_heads);
    let vr = geo.v_heads / nk * geo.v_head_dim;
    let block = 2 * dk + 2 * vr;
    let (h, o) = (row / block, row % block);
    if o < dk {
        (false, h * dk + o)
    } else if o < 2 * dk {
        (false, nk * dk + h * dk + o - dk)
    } else if o < 2 * dk + vr {
        (false, 2 * nk * dk + h * vr + o - 2 * dk)
    } else {
        (true, h * vr + o - 2 * dk - vr)
    }
}

/// The GGUF norm weights llama.cpp stores as 1 + w (see the module docs).
pub fn stores_one_plus(gguf: &str) -> bool {
    gguf == "output_norm.weight"
        || gguf.strip_prefix("blk.").is_some_and(|rest| {
            rest.split_once('.').is_some_and(|(_, tail)| {
                matches!(
                    tail,
                    "attn_norm.weight"
                        | "post_attention_norm.weight"
                        | "attn_q_norm.weight"
                        | "attn_k_norm.weight"
                )
            })
        })
}

/// Applies `fix` in place; `Err` names the first value that cannot be inverted.
pub fn apply(fix: Fix, values: &mut [f32]) -> std::result::Result<(), String> {
    match fix {
        Fix::None => {}
        // Exact whenever 1 + w was (Sterbenz), so the model's (1 + w) is the converter's value.
        Fix::MinusOne => values
            .iter_mut()
            .for_each(|v| *v = (*v as f64 - 1.0) as f32),
        Fix::ALog => {
            for v in values.iter_mut() {
                *v = a_log(*v).ok_or_else(|| {
                    format!("value {v} is not −exp(A_log) (must be negative and finite)")
                })?;
            }
        }
    }
    Ok(())
}

/// A_log from a = −exp(A_log): the f32 nearest ln(−a) whose exp is exactly −a when one lies
/// within a few ulps (so the model's −exp(A_log) reproduces the stored value bit for bit), else
/// the nearest f32 to ln(−a).
pub fn a_log(a: f32) -> Option<f32> {
    if !(a.is_finite() && a < 0.0) {
        return None;
    }
    let x0 = ((-a as f64).ln()) as f32;
    let step = |x: f32, up: bool| {
        let b = x.to_bits() as i32;
        // Moving the bit pattern by one is one ulp towards ±infinity for either sign.
        let towards_larger = up == (x >= 0.0);
        f32::from_bits(if towards_larger { b + 1 } else { b - 1 } as u32)
    };
    let (mut lo, mut hi) = (x0, x0);
    if x0.exp() == -a {
        return Some(x0);
    }
    for _ in 0..4 {
        lo = step(lo, false);
        hi = step(hi, true);
        for x in [lo, hi] {
            if x.exp() == -a {
                return Some(x);
            }
        }
    }
    Some(x0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geo() -> Qwen3Next {
        Qwen3Next {
            k_heads: 2,
            v_heads: 4,
            k_head_dim: 3,
            v_head_dim: 5,
            conv_kernel: 4,
        }
    }

    /// The converter's regrouping (`Qwen3NextModel.modify_tensors`), written out row by row, is
    /// undone by `qkvz_source_row`.
    #[test]
    fn qkvz_rows_invert_the_converter() {
        let g = geo();
        let (dk, nk, vr) = (3, 2, 2 * 5);
        let block = 2 * dk + 2 * vr;
        let hf: Vec<usize> = (0..nk * block).collect();
        let (mut qkv, mut gate): (Vec<usize>, Vec<usize>) = (Vec::new(), Vec::new());
        // q, k, v parts: (length per key head, offset in the head's block)
        for (len, off) in [(dk, 0), (dk, dk), (vr, 2 * dk)] {
            for h in 0..nk {
                qkv.extend(&hf[h * block + off..h * block + off + len]);
            }
        }
        for h in 0..nk {
            gate.extend(&hf[h * block + 2 * dk + vr..(h + 1) * block]);
        }
        for (r, &want) in hf.iter().enumerate() {
            let got = match qkvz_source_row(&g, r) {
                (false, s) => qkv[s],
                (true, s) => gate[s],
            };
            assert_eq!(got, want, "row {r}");
        }
    }

    #[test]
    fn a_log_round_trips_through_exp() {
        for x in [-3.5f32, -0.7, -1e-3, 0.0, 1e-6, 0.2, 0.6, 1.0, 2.3, 4.1] {
            let a = -x.exp();
            let back = a_log(a).unwrap();
            assert_eq!(-back.exp(), a, "A_log {x}");
        }
        assert_eq!(a_log(0.5), None);
        assert_eq!(a_log(f32::NAN), None);
        assert_eq!(a_log(-f32::INFINITY), None);
    }

    #[test]
    fn one_plus_norms() {
        assert!(stores_one_plus("blk.3.attn_q_norm.weight"));
        assert!(stores_one_plus("output_norm.weight"));
        assert!(stores_one_plus("blk.0.post_attention_norm.weight"));
        assert!(!stores_one_plus("blk.0.ssm_norm.weight"));
        let mut v = [1.25f32, 0.999, 1.0 + 1e-7];
        apply(Fix::MinusOne, &mut v).unwrap();
        assert_eq!(v[0], 0.25);
        assert_eq!(1.0 + v[1], 0.999);
        assert_eq!(1.0 + v[2], 1.0 + 1e-7);
    }
}
