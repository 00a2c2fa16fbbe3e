//! Mixture-of-experts feed-forward blocks (Qwen2-MoE, Qwen3-MoE): geometry, routing and the CPU
//! forward pass.
//!
//! ```text
//! p = softmax(xn·Wrᵀ)                          router, [n, E] in f32
//! S = top_k(p);  w_e = p_e (/ Σ_S p when norm_topk_prob)
//! out = Σ_{e∈S} w_e · (silu(xn·Wg_eᵀ) ⊙ xn·Wu_eᵀ)·Wd_eᵀ
//!     (+ sigmoid(xn·w_sg) · shared_mlp(xn))      Qwen2-MoE's shared expert
//! ```
//! Reference numerics: transformers `Qwen3MoeTopKRouter` / `Qwen3MoeExperts` /
//! `Qwen2MoeSparseMoeBlock` (`modeling_qwen3_moe.py`, `modeling_qwen2_moe.py`). Which layers are
//! sparse follows `Qwen3MoeDecoderLayer.__init__`: layer i uses experts unless it is listed in
//! `mlp_only_layers` or `(i + 1) % decoder_sparse_step != 0`.
//!
//! Decode runs the selected experts' gate and up projections (and the shared expert's) as one
//! `cmf_kernels::matvec_multi`; prefill orders the chunk's rows by expert and runs one GEMM per
//! expert over its rows. Both split each product's rows over the kernels' pool.

use super::config::{Family, Fields};
use super::weights::{Binder, Linear};
use crate::error::{config_err, LlmError, Result};
use cmf_format::limits;
use cmf_kernels::{ops, Weight};
use serde_json::{Map, Value};

/// How the router turns scores into expert weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Routing {
    /// Softmax over all experts, the k largest kept; renormalised to sum 1 when
    /// `norm_topk_prob` (Qwen3-MoE checkpoints) or used as they are (Qwen2-MoE).
    SoftmaxTopK { norm_topk_prob: bool },
}

/// The routed experts of a MoE model.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    /// Experts each token uses (`num_experts_per_tok`).
    pub top_k: usize,
    /// Intermediate width of each routed expert (`moe_intermediate_size`).
    pub expert_width: usize,
    /// Width of the always-on shared expert (Qwen2-MoE), if any.
    pub shared_expert_width: Option<usize>,
    pub routing: Routing,
    /// Per layer, whether it routes to experts (else a dense MLP of `intermediate_size`). None
    /// when the config does not say (a CMF header written without `mlp_only_layers` /
    /// `decoder_sparse_step`): then a layer is sparse iff its router tensor is present, the
    /// CMF rule.
    pub sparse_layers: Option<Vec<bool>>,
}

impl MoeConfig {
    /// Reads the CMF header's `moe` object when present, else the Hugging Face fields
    /// (`num_experts` or `num_local_experts`, `num_experts_per_tok`, `moe_intermediate_size`, `norm_topk_prob`,
    /// `shared_expert_intermediate_size`), and the sparse-layer plan.
    pub(super) fn from_json(
        obj: &Map<String, Value>,
        family: Family,
        num_layers: usize,
    ) -> Result<MoeConfig> {
        let top = Fields(obj);
        let cfg = match obj.get("moe") {
            Some(Value::Object(m)) => from_cmf(&Fields(m))?,
            Some(Value::Null) | None => from_hf(&top, family)?,
            Some(_) => return Err(config_err("moe", "is not an object")),
        };
        for (field, v) in [
            ("moe.num_experts", cfg.num_experts),
            ("moe.top_k", cfg.top_k),
            ("moe.moe_intermediate_size", cfg.expert_width),
        ] {
            let max = match field {
                "moe.moe_intermediate_size" => limits::MAX_INTERMEDIATE,
                _ => limits::MAX_EXPERTS,
            };
            limits::check_size(field, v, max).map_err(|(k, m)| config_err(&k, m))?;
        }
        if let Some(w) = cfg.shared_expert_width {
            limits::check_size(
                "moe.shared_expert_intermediate_size",
                w,
                limits::MAX_INTERMEDIATE,
            )
            .map_err(|(k, m)| config_err(&k, m))?;
        }
        if cfg.top_k > cfg.num_experts {
            return Err(config_err(
                "num_experts_per_tok",
                format!("{} is more than the {} experts", cfg.top_k, cfg.num_experts),
            ));
        }
        Ok(MoeConfig {
            sparse_layers: sparse_plan(&top, num_layers)?,
            ..cfg
        })
    }

    /// Whether layer `l` routes to experts, when the config says.
    pub fn is_sparse(&self, l: usize) -> Option<bool> {
        self.sparse_layers.as_ref().map(|p| p[l])
    }
}

/// `cortiq_core::types::MoeConfig`: router variants other than softmax top-k are refused.
fn from_cmf(m: &Fields) -> Result<MoeConfig> {
    for key in ["router_sigmoid", "router_resonance"] {
        if m.opt_bool(key)? == Some(true) {
            return Err(LlmError::Unsupported(format!(
                "`moe.{key}`: only softmax top-k routing is implemented"
            )));
        }
    }
    if let Some(s) = m.opt_f64(&["routed_scaling_factor"])? {
        if s != 1.0 {
            return Err(LlmError::Unsupported(format!(
                "`moe.routed_scaling_factor` {s}: only softmax top-k routing is implemented"
            )));
        }
    }
    Ok(MoeConfig {
        num_experts: m.usize_any(&["num_experts"]).map_err(in_moe)?,
        top_k: m.usize_any(&["top_k"]).map_err(in_moe)?,
        expert_width: m.usize_any(&["moe_intermediate_size"]).map_err(in_moe)?,
        shared_expert_width: m.opt_usize(&["shared_expert_intermediate_size"])?,
        routing: Routing::SoftmaxTopK {
            norm_topk_prob: m.opt_bool("norm_topk_prob")?.unwrap_or(false),
        },
        sparse_layers: None,
    })
}

/// Names a missing field of the CMF `moe` object by its path.
fn in_moe(e: LlmError) -> LlmError {
    match e {
        LlmError::Config { field, msg } => LlmError::Config {
            field: format!("moe.{field}"),
            msg,
        },
        e => e,
    }
}

/// transformers `Qwen2MoeConfig` / `Qwen3MoeConfig` / `Qwen3NextConfig`; Qwen2-MoE and
/// Qwen3-Next have a shared expert.
fn from_hf(f: &Fields, family: Family) -> Result<MoeConfig> {
    if let Some(kind) = f.opt_str(&["scoring_func"])? {
        if kind != "softmax" {
            return Err(config_err(
                "scoring_func",
                format!("`{kind}` is not implemented (only softmax)"),
            ));
        }
    }
    let shared_expert_width = match family {
        Family::Qwen2Moe | Family::Qwen3Next => {
            Some(f.usize_any(&["shared_expert_intermediate_size"])?)
        }
        _ => None,
    };
    Ok(MoeConfig {
        num_experts: f.usize_any(&["num_experts", "num_local_experts"])?,
        top_k: f.usize_any(&["num_experts_per_tok"])?,
        expert_width: f.usize_any(&["moe_intermediate_size"])?,
        shared_expert_width,
        routing: Routing::SoftmaxTopK {
            norm_topk_prob: f.opt_bool("norm_topk_prob")?.unwrap_or(false),
        },
        sparse_layers: None,
    })
}

/// `mlp_only_layers` and `decoder_sparse_step` as transformers reads them; None when neither is
/// present.
fn sparse_plan(f: &Fields, n: usize) -> Result<Option<Vec<bool>>> {
    let step = f.opt_usize(&["decoder_sparse_step"])?;
    let dense = match f.0.get("mlp_only_layers") {
        None | Some(Value::Null) => None,
        Some(Value::Array(a)) => Some(
            a.iter()
                .map(|v| {
                    v.as_u64()
                        .map(|i| i as usize)
                        .filter(|&i| i < n)
                        .ok_or_else(|| {
                            config_err(
                                "mlp_only_layers",
                                format!("entry {v} is not a layer index below {n}"),
                            )
                        })
                })
                .collect::<Result<Vec<usize>>>()?,
        ),
        Some(_) => return Err(config_err("mlp_only_layers", "is not a list")),
    };
    if step.is_none() && dense.is_none() {
        return Ok(None);
    }
    let step = step.unwrap_or(1);
    if step == 0 {
        return Err(config_err("decoder_sparse_step", "must be at least 1"));
    }
    let dense = dense.unwrap_or_default();
    Ok(Some(
        (0..n)
            .map(|i| !dense.contains(&i) && (i + 1) % step == 0)
            .collect(),
    ))
}

/// A SwiGLU MLP without biases: gate / up [F, H], down [H, F].
#[derive(Clone, Debug)]
pub struct Expert<'a> {
    pub gate: Weight<'a>,
    pub up: Weight<'a>,
    pub down: Weight<'a>,
}

/// Qwen2-MoE's shared expert and its scalar gate (`shared_expert_gate` [1, H]).
#[derive(Clone, Debug)]
pub struct SharedExpert<'a> {
    pub mlp: Expert<'a>,
    pub gate: Weight<'a>,
}

/// The weights of one MoE block.
#[derive(Clone, Debug)]
pub struct MoeWeights<'a> {
    /// `mlp.gate` [E, H]
    pub router: Weight<'a>,
    /// `mlp.experts.{e}.{gate,up,down}_proj`
    pub experts: Vec<Expert<'a>>,
    pub shared: Option<SharedExpert<'a>>,
}

/// Binds layer `p`'s MoE block (`{p}.mlp.gate`, `{p}.mlp.experts.{e}.*`, `{p}.mlp.shared_expert.*`).
pub(super) fn bind<'a>(
    b: &Binder<'_, 'a>,
    cfg: &MoeConfig,
    h: usize,
    p: &str,
) -> Result<MoeWeights<'a>> {
    let router = b.matrix(&format!("{p}.mlp.gate.weight"), cfg.num_experts, h)?;
    let expert = |base: &str, f: usize| -> Result<Expert<'a>> {
        Ok(Expert {
            gate: b.matrix(&format!("{base}.gate_proj.weight"), f, h)?,
            up: b.matrix(&format!("{base}.up_proj.weight"), f, h)?,
            down: b.matrix(&format!("{base}.down_proj.weight"), h, f)?,
        })
    };
    let experts = (0..cfg.num_experts)
        .map(|e| expert(&format!("{p}.mlp.experts.{e}"), cfg.expert_width))
        .collect::<Result<Vec<_>>>()?;
    let shared = match cfg.shared_expert_width {
        Some(f) => Some(SharedExpert {
            mlp: expert(&format!("{p}.mlp.shared_expert"), f)?,
            gate: b.matrix(&format!("{p}.mlp.shared_expert_gate.weight"), 1, h)?,
        }),
        None => None,
    };
    Ok(MoeWeights {
        router,
        experts,
        shared,
    })
}

/// Whether layer `p` carries a router (the CMF rule for a sparse layer).
pub(super) fn has_router(b: &Binder<'_, '_>, p: &str) -> bool {
    b.has(&format!("{p}.mlp.gate.weight"))
}

/// The dense MLP projections of a layer, kept as `Linear` (Llama's `mlp_bias` adds biases).
#[derive(Clone, Debug)]
pub struct Mlp<'a> {
    pub gate: Linear<'a>,
    pub up: Linear<'a>,
    pub down: Linear<'a>,
}

/// One token's chosen experts and their weights, best first.
pub fn route(routing: Routing, top_k: usize, logits: &mut [f32], out: &mut Vec<(usize, f32)>) {
    let Routing::SoftmaxTopK { norm_topk_prob } = routing;
    let e = logits.len();
    ops::softmax(logits, e);
    out.clear();
    // Partial selection sort: k is small (2–8) next to E (8–512). Ties keep the lower index.
    for _ in 0..top_k {
        let mut best: Option<usize> = None;
        for (i, &p) in logits.iter().enumerate() {
            let taken = out.iter().any(|&(j, _)| j == i);
            if !taken && best.is_none_or(|b| p > logits[b]) {
                best = Some(i);
            }
        }
        let b = best.expect("top_k <= num_experts");
        out.push((b, logits[b]));
    }
    if norm_topk_prob {
        let sum: f32 = out.iter().map(|&(_, p)| p).sum();
        out.iter_mut().for_each(|(_, p)| *p /= sum);
    }
}

/// Scratch buffers of the MoE forward, grown on demand and reused across passes.
#[derive(Default)]
pub struct Scratch {
    logits: Vec<f32>,
    routes: Vec<(usize, f32)>,
    /// rows assigned to each expert: (row, weight)
    by_expert: Vec<Vec<(usize, f32)>>,
    xs: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    y: Vec<f32>,
    shared_gate: Vec<f32>,
}

fn grow(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// out[n, H] = the MoE block of `xn` [n, H] (overwritten, not accumulated).
pub fn forward(
    w: &MoeWeights,
    cfg: &MoeConfig,
    xn: &[f32],
    n: usize,
    out: &mut [f32],
    s: &mut Scratch,
) {
    if n == 1 {
        decode_row(w, cfg, xn, out, s);
    } else {
        prefill_rows(w, cfg, xn, n, out, s);
    }
}

/// One row: router, then every selected expert's gate|up (and the shared expert's) in one
/// `matvec_multi`, then one down matvec per expert.
fn decode_row(w: &MoeWeights, cfg: &MoeConfig, xn: &[f32], out: &mut [f32], s: &mut Scratch) {
    let (h, e, k, f) = (xn.len(), cfg.num_experts, cfg.top_k, cfg.expert_width);
    let logits = grow(&mut s.logits, e);
    cmf_kernels::matvec(&w.router, xn, logits);
    route(cfg.routing, k, logits, &mut s.routes);

    let fs = w.shared.as_ref().map_or(0, |sh| sh.mlp.gate.rows);
    let gate = grow(&mut s.gate, k * f + fs);
    let up = grow(&mut s.up, k * f + fs);
    let sg = grow(&mut s.shared_gate, 1);
    {
        let mut ws: Vec<&Weight> = Vec::with_capacity(2 * k + 3);
        let mut ys: Vec<&mut [f32]> = Vec::with_capacity(2 * k + 3);
        let (ge, gs) = gate.split_at_mut(k * f);
        let (ue, us) = up.split_at_mut(k * f);
        for ((&(x, _), g), u) in s.routes.iter().zip(ge.chunks_mut(f)).zip(ue.chunks_mut(f)) {
            ws.extend([&w.experts[x].gate, &w.experts[x].up]);
            ys.extend([g, u]);
        }
        if let Some(sh) = &w.shared {
            ws.extend([&sh.mlp.gate, &sh.mlp.up, &sh.gate]);
            ys.extend([gs, us, &mut sg[..]]);
        }
        cmf_kernels::matvec_multi(&ws, xn, &mut ys);
    }
    ops::swiglu_inplace(gate, up);

    out.fill(0.0);
    let y = grow(&mut s.y, h);
    for (j, &(x, p)) in s.routes.iter().enumerate() {
        cmf_kernels::matvec(&w.experts[x].down, &gate[j * f..(j + 1) * f], y);
        ops::add_scaled(out, y, p);
    }
    if let Some(sh) = &w.shared {
        cmf_kernels::matvec(&sh.mlp.down, &gate[k * f..], y);
        ops::add_scaled(out, y, sigmoid(sg[0]));
    }
}

/// Several rows: route each, then per expert gather its rows and run gate, up and down as
/// GEMMs over them, scattering the weighted results back.
fn prefill_rows(
    w: &MoeWeights,
    cfg: &MoeConfig,
    xn: &[f32],
    n: usize,
    out: &mut [f32],
    s: &mut Scratch,
) {
    let (e, k, f) = (cfg.num_experts, cfg.top_k, cfg.expert_width);
    let h = xn.len() / n;
    let logits = grow(&mut s.logits, n * e);
    cmf_kernels::matmul(&w.router, xn, n, logits);
    s.by_expert.resize_with(e, Vec::new);
    s.by_expert.iter_mut().for_each(Vec::clear);
    for (r, row) in logits.chunks_mut(e).enumerate() {
        route(cfg.routing, k, row, &mut s.routes);
        for &(x, p) in &s.routes {
            s.by_expert[x].push((r, p));
        }
    }

    out.fill(0.0);
    for (x, rows) in s.by_expert.iter().enumerate() {
        let m = rows.len();
        if m == 0 {
            continue;
        }
        let xs = grow(&mut s.xs, m * h);
        for (j, &(r, _)) in rows.iter().enumerate() {
            xs[j * h..(j + 1) * h].copy_from_slice(&xn[r * h..(r + 1) * h]);
        }
        let (gate, up, y) = (
            grow(&mut s.gate, m * f),
            grow(&mut s.up, m * f),
            grow(&mut s.y, m * h),
        );
        let ex = &w.experts[x];
        cmf_kernels::matmul(&ex.gate, xs, m, gate);
        cmf_kernels::matmul(&ex.up, xs, m, up);
        ops::swiglu_inplace(gate, up);
        cmf_kernels::matmul(&ex.down, gate, m, y);
        for (j, &(r, p)) in rows.iter().enumerate() {
            ops::add_scaled(&mut out[r * h..(r + 1) * h], &y[j * h..(j + 1) * h], p);
        }
    }

    if let Some(sh) = &w.shared {
        let fs = sh.mlp.gate.rows;
        let (gate, up, y, sg) = (
            grow(&mut s.gate, n * fs),
            grow(&mut s.up, n * fs),
            grow(&mut s.y, n * h),
            grow(&mut s.shared_gate, n),
        );
        cmf_kernels::matmul(&sh.mlp.gate, xn, n, gate);
        cmf_kernels::matmul(&sh.mlp.up, xn, n, up);
        cmf_kernels::matmul(&sh.gate, xn, n, sg);
        ops::swiglu_inplace(gate, up);
        cmf_kernels::matmul(&sh.mlp.down, gate, n, y);
        for r in 0..n {
            ops::add_scaled(
                &mut out[r * h..(r + 1) * h],
                &y[r * h..(r + 1) * h],
                sigmoid(sg[r]),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn routing_keeps_the_k_best_and_renormalises_on_request() {
        let mut routes = Vec::new();
        let logits = [0.0f32, 2.0, 1.0, -1.0];
        let mut l = logits;
        route(
            Routing::SoftmaxTopK {
                norm_topk_prob: false,
            },
            2,
            &mut l,
            &mut routes,
        );
        let z: f32 = logits.iter().map(|v| v.exp()).sum();
        assert_eq!(routes[0].0, 1);
        assert_eq!(routes[1].0, 2);
        assert!((routes[0].1 - 2f32.exp() / z).abs() < 1e-6);
        let mut l = logits;
        route(
            Routing::SoftmaxTopK {
                norm_topk_prob: true,
            },
            2,
            &mut l,
            &mut routes,
        );
        assert!((routes[0].1 + routes[1].1 - 1.0).abs() < 1e-6);
        assert!((routes[0].1 - 1.0 / (1.0 + (-1f32).exp())).abs() < 1e-6);
    }

    #[test]
    fn sparse_plan_follows_transformers() {
        let cfg = json!({"decoder_sparse_step": 2, "mlp_only_layers": [3]});
        let plan = sparse_plan(&Fields(cfg.as_object().unwrap()), 6).unwrap();
        assert_eq!(plan, Some(vec![false, true, false, false, false, true]));
        let none = json!({});
        assert_eq!(
            sparse_plan(&Fields(none.as_object().unwrap()), 2).unwrap(),
            None
        );
        let bad = json!({"mlp_only_layers": [7]});
        let e = sparse_plan(&Fields(bad.as_object().unwrap()), 2).unwrap_err();
        assert!(e.to_string().contains("mlp_only_layers"), "{e}");
        let zero = json!({"decoder_sparse_step": 0});
        let e = sparse_plan(&Fields(zero.as_object().unwrap()), 2).unwrap_err();
        assert!(e.to_string().contains("decoder_sparse_step"), "{e}");
    }
}
