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
    /// DeepSeek-V3's `noaux_tc` (transformers `DeepseekV3TopkRouter`): per-expert sigmoid
    /// scores; the selection adds the layer's bias (`mlp.gate.e_score_correction_bias`), keeps
    /// the `topk_group` groups (of `n_group`) whose two best biased scores sum highest, and takes
    /// the k best biased scores inside them; the weights are the unbiased scores, renormalised
    /// when `norm_topk_prob`, times `routed_scaling_factor`.
    SigmoidGroupTopK {
        n_group: usize,
        topk_group: usize,
        norm_topk_prob: bool,
        routed_scaling_factor: f32,
    },
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

/// An always-on shared expert: Qwen2-MoE's scales its output by `sigmoid(shared_expert_gate · x)`
/// (`gate` [1, H]); DeepSeek-V3's (`shared_experts`) adds it as it is (`gate` None).
#[derive(Clone, Debug)]
pub struct SharedExpert<'a> {
    pub mlp: Expert<'a>,
    pub gate: Option<Weight<'a>>,
}

/// The weights of one MoE block.
#[derive(Clone, Debug)]
pub struct MoeWeights<'a> {
    /// `mlp.gate` [E, H]
    pub router: Weight<'a>,
    /// `mlp.experts.{e}.{gate,up,down}_proj`
    pub experts: Vec<Expert<'a>>,
    pub shared: Option<SharedExpert<'a>>,
    /// [E] selection bias of `noaux_tc` routing (`mlp.gate.e_score_correction_bias`).
    pub selection_bias: Option<Vec<f32>>,
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
            gate: Some(b.matrix(&format!("{p}.mlp.shared_expert_gate.weight"), 1, h)?),
        }),
        None => None,
    };
    Ok(MoeWeights {
        router,
        experts,
        shared,
        selection_bias: None,
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

/// One token's chosen experts and their weights, best first. `logits` are the router's scores
/// (overwritten); `bias` is the layer's selection bias (`noaux_tc` only).
pub fn route(
    routing: Routing,
    top_k: usize,
    logits: &mut [f32],
    bias: Option<&[f32]>,
    out: &mut Vec<(usize, f32)>,
) {
    match routing {
        Routing::SoftmaxTopK { norm_topk_prob } => {
            let e = logits.len();
            ops::softmax(logits, e);
            top_k_of(logits, top_k, |_| true, out);
            for r in out.iter_mut() {
                r.1 = logits[r.0];
            }
            if norm_topk_prob {
                let sum: f32 = out.iter().map(|&(_, p)| p).sum();
                out.iter_mut().for_each(|(_, p)| *p /= sum);
            }
        }
        Routing::SigmoidGroupTopK {
            n_group,
            topk_group,
            norm_topk_prob,
            routed_scaling_factor,
        } => {
            logits
                .iter_mut()
                .for_each(|v| *v = 1.0 / (1.0 + (-*v).exp()));
            let choice: Vec<f32> = match bias {
                Some(b) => logits.iter().zip(b).map(|(s, b)| s + b).collect(),
                None => logits.to_vec(),
            };
            // A group's score: the sum of its two best biased scores.
            let per = logits.len() / n_group;
            let group_scores: Vec<f32> = choice
                .chunks(per)
                .map(|g| {
                    let mut best = [f32::NEG_INFINITY; 2];
                    for &v in g {
                        if v > best[0] {
                            best = [v, best[0]];
                        } else if v > best[1] {
                            best[1] = v;
                        }
                    }
                    best[0] + if per > 1 { best[1] } else { 0.0 }
                })
                .collect();
            let mut groups = Vec::with_capacity(topk_group);
            top_k_of(&group_scores, topk_group, |_| true, &mut groups);
            let kept = |i: usize| groups.iter().any(|&(g, _)| g == i / per);
            top_k_of(&choice, top_k, kept, out);
            for r in out.iter_mut() {
                r.1 = logits[r.0];
            }
            let sum: f32 = out.iter().map(|&(_, p)| p).sum();
            let scale = match norm_topk_prob {
                true => routed_scaling_factor / (sum + 1e-20),
                false => routed_scaling_factor,
            };
            out.iter_mut().for_each(|(_, p)| *p *= scale);
        }
    }
}

/// The indices of the `k` largest `v[i]` among those `allowed`, best first (weights left 0).
/// A partial selection sort: k is small (2–8) next to E (8–512). Ties keep the lower index.
fn top_k_of(v: &[f32], k: usize, allowed: impl Fn(usize) -> bool, out: &mut Vec<(usize, f32)>) {
    out.clear();
    for _ in 0..k {
        let mut best: Option<usize> = None;
        for (i, &p) in v.iter().enumerate() {
            let taken = out.iter().any(|&(j, _)| j == i);
            if !taken && allowed(i) && best.is_none_or(|b| p > v[b]) {
                best = Some(i);
            }
        }
        let b = best.expect("k is at most the number of allowed entries");
        out.push((b, 0.0));
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
    route(
        cfg.routing,
        k,
        logits,
        w.selection_bias.as_deref(),
        &mut s.routes,
    );

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
            ws.extend([&sh.mlp.gate, &sh.mlp.up]);
            ys.extend([gs, us]);
            if let Some(g) = &sh.gate {
                ws.push(g);
                ys.push(&mut sg[..]);
            }
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
        ops::add_scaled(out, y, sh.gate.as_ref().map_or(1.0, |_| sigmoid(sg[0])));
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
        route(
            cfg.routing,
            k,
            row,
            w.selection_bias.as_deref(),
            &mut s.routes,
        );
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
        match &sh.gate {
            Some(g) => {
                cmf_kernels::matmul(g, xn, n, sg);
                sg.iter_mut().for_each(|v| *v = sigmoid(*v));
            }
            None => sg.fill(1.0),
        }
        ops::swiglu_inplace(gate, up);
        cmf_kernels::matmul(&sh.mlp.down, gate, n, y);
        for r in 0..n {
            ops::add_scaled(&mut out[r * h..(r + 1) * h], &y[r * h..(r + 1) * h], sg[r]);
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
            None,
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
            None,
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

    /// transformers' `DeepseekV3MoE` block (scripts/make_noaux_tc_reference.py: 16 experts in
    /// 4 groups, 2 kept, top 4, renormalised, ×2.5, one ungated shared expert) on 12 tokens:
    /// prefill (grouped GEMMs) and per-token decode within 1e-5 of its f32 output (max |Δ| /
    /// max |y| per row). The reference checks every group and expert cut has a margin ≥ 1e-4.
    #[test]
    fn noaux_tc_block_matches_transformers_deepseek_v3() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/data/noaux_tc_moe.safetensors"
        );
        let bytes = std::fs::read(path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let f32s = |name: &str| -> Vec<f32> {
            st.tensor(name)
                .unwrap()
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        };
        let weight = |name: &str| {
            let t = st.tensor(name).unwrap();
            Weight {
                dtype: cmf_format::Dtype::F32,
                rows: t.shape()[0],
                cols: t.shape()[1],
                data: t.data(),
            }
        };
        let expert = |base: &str| Expert {
            gate: weight(&format!("{base}.gate_proj.weight")),
            up: weight(&format!("{base}.up_proj.weight")),
            down: weight(&format!("{base}.down_proj.weight")),
        };
        let (e, h, n) = (16, 32, 12);
        let w = MoeWeights {
            router: weight("mlp.gate.weight"),
            experts: (0..e)
                .map(|i| expert(&format!("mlp.experts.{i}")))
                .collect(),
            shared: Some(SharedExpert {
                mlp: expert("mlp.shared_experts"),
                gate: None,
            }),
            selection_bias: Some(f32s("mlp.gate.e_score_correction_bias")),
        };
        let cfg = MoeConfig {
            num_experts: e,
            top_k: 4,
            expert_width: 16,
            shared_expert_width: Some(16),
            routing: Routing::SigmoidGroupTopK {
                n_group: 4,
                topk_group: 2,
                norm_topk_prob: true,
                routed_scaling_factor: 2.5,
            },
            sparse_layers: None,
        };
        let (x, want) = (f32s("x"), f32s("y"));
        let err = |got: &[f32], want: &[f32]| {
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = got
                .iter()
                .zip(want)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            d / scale
        };
        let mut s = Scratch::default();
        let mut out = vec![0f32; n * h];
        forward(&w, &cfg, &x, n, &mut out, &mut s);
        for r in 0..n {
            let (got, want) = (&out[r * h..(r + 1) * h], &want[r * h..(r + 1) * h]);
            assert!(err(got, want) < 1e-5, "prefill row {r}: {}", err(got, want));
        }
        let mut one = vec![0f32; h];
        for r in 0..n {
            forward(&w, &cfg, &x[r * h..(r + 1) * h], 1, &mut one, &mut s);
            let want = &want[r * h..(r + 1) * h];
            assert!(
                err(&one, want) < 1e-5,
                "decode row {r}: {}",
                err(&one, want)
            );
        }
    }
}
