#!/usr/bin/env python3
"""Reference outputs of transformers' DeepSeek-V3 MoE block (`noaux_tc` routing), for the routing
variant of `crates/cmf-llm/src/model/moe.rs`.

usage: /work/venv/bin/python scripts/make_noaux_tc_reference.py

Writes crates/cmf-llm/tests/data/noaux_tc_moe.safetensors: the weights of one
`DeepseekV3MoE` (16 experts in 4 groups, 2 groups kept, top 4, norm_topk_prob, routed_scaling_factor
2.5, one shared expert; hidden 32, expert width 16) in the hub's per-expert names, its
`e_score_correction_bias`, an input `x` [12, 32] and the block's output `y` in f32. Fixed seed, one
thread. The script checks that no token has a near-tie at the group or expert cut (margin >= 1e-4),
so an f32 reimplementation selects the same experts.
"""
from pathlib import Path

import safetensors.torch
import torch
import transformers
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

OUT = Path(__file__).resolve().parent.parent / "crates/cmf-llm/tests/data/noaux_tc_moe.safetensors"
TOKENS = 12


def main() -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(11)
    cfg = transformers.DeepseekV3Config(
        hidden_size=32, moe_intermediate_size=16, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
        topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, n_shared_experts=1, hidden_act="silu",
    )
    block = DeepseekV3MoE(cfg).eval()
    e, f, h = 16, 16, 32
    w = {
        "router": torch.randn(e, h, generator=g) / h**0.5,
        "bias": 0.3 * torch.randn(e, generator=g),
        "gate_up": torch.randn(e, 2 * f, h, generator=g) / h**0.5,
        "down": torch.randn(e, h, f, generator=g) / f**0.5,
        "s_gate": torch.randn(f, h, generator=g) / h**0.5,
        "s_up": torch.randn(f, h, generator=g) / h**0.5,
        "s_down": torch.randn(h, f, generator=g) / f**0.5,
    }
    with torch.no_grad():
        block.gate.weight.copy_(w["router"])
        block.gate.e_score_correction_bias.copy_(w["bias"])
        block.experts.gate_up_proj.copy_(w["gate_up"])
        block.experts.down_proj.copy_(w["down"])
        block.shared_experts.gate_proj.weight.copy_(w["s_gate"])
        block.shared_experts.up_proj.weight.copy_(w["s_up"])
        block.shared_experts.down_proj.weight.copy_(w["s_down"])
        x = torch.randn(1, TOKENS, h, generator=g)
        y = block(x)[0]
        # Margins at the group cut and the expert cut (what an f32 reimplementation must not flip).
        s = torch.sigmoid(x[0] @ w["router"].T) + w["bias"]
        gs = s.view(TOKENS, 4, 4).topk(2, dim=-1)[0].sum(-1).sort(dim=-1, descending=True).values
        assert float((gs[:, 1] - gs[:, 2]).min()) >= 1e-4, "group near-tie"
        kept = gs[:, 1:2]
        grp = s.view(TOKENS, 4, 4).topk(2, dim=-1)[0].sum(-1)
        masked = s.masked_fill(~(grp >= kept).repeat_interleave(4, dim=1), float("-inf"))
        top = masked.sort(dim=-1, descending=True).values
        assert float((top[:, 3] - top[:, 4]).min()) >= 1e-4, "expert near-tie"
    t = {"x": x[0].contiguous(), "y": y.contiguous(), "mlp.gate.weight": w["router"],
         "mlp.gate.e_score_correction_bias": w["bias"],
         "mlp.shared_experts.gate_proj.weight": w["s_gate"], "mlp.shared_experts.up_proj.weight": w["s_up"],
         "mlp.shared_experts.down_proj.weight": w["s_down"]}
    for i in range(e):
        t[f"mlp.experts.{i}.gate_proj.weight"] = w["gate_up"][i, :f].contiguous()
        t[f"mlp.experts.{i}.up_proj.weight"] = w["gate_up"][i, f:].contiguous()
        t[f"mlp.experts.{i}.down_proj.weight"] = w["down"][i].contiguous()
    safetensors.torch.save_file(t, str(OUT), metadata={"transformers": transformers.__version__,
                                                        "torch": torch.__version__})
    print(OUT, OUT.stat().st_size, "bytes")


if __name__ == "__main__":
    main()
