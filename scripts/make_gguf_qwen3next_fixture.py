#!/usr/bin/env python3
"""A `qwen3next` GGUF of the tiny Qwen3-Next fixture, for the `cmf import-gguf` hybrid test.

usage: /work/venv/bin/python scripts/make_gguf_qwen3next_fixture.py

Writes crates/cmf-convert/tests/fixtures/gguf/qwen3next-tiny-f32.gguf from fixtures/llm/qwen3next-tiny
with the `gguf` Python package (gguf-py, llama.cpp's own writer and tensor-name map), mirroring what
llama.cpp's converter does to a Qwen3NextForCausalLM checkpoint at revision
03173d5e78f8ccd7ccbb385f1f7b4a21266377dc (`conversion/qwen.py`: `Qwen3NextModel`, on top of
`Qwen2MoeModel` and `TextModel`), with `--outtype f32`:
- metadata: the Qwen2-MoE keys (block_count, context_length, embedding_length, feed_forward_length,
  attention.head_count / head_count_kv / key_length / value_length / layer_norm_rms_epsilon,
  rope.freq_base, expert_count, expert_used_count, expert_feed_forward_length,
  expert_shared_feed_forward_length), then ssm.conv_kernel = linear_conv_kernel_dim,
  ssm.state_size = linear_key_head_dim, ssm.group_count = linear_num_key_heads,
  ssm.time_step_rank = linear_num_value_heads, ssm.inner_size = linear_value_head_dim ·
  linear_num_value_heads, full_attention_interval (config value, default 4) and
  rope.dimension_count = head_dim · partial_rotary_factor;
- tensors (`Qwen3NextModel.modify_tensors`), named by gguf-py's tensor map for MODEL_ARCH.QWEN3NEXT:
  `A_log` → `ssm_a` = −exp(A_log); `dt_bias` → `ssm_dt.bias`; `conv1d.weight` squeezed to
  [channels, kernel]; every `*norm.weight` except the GDN's gated `linear_attn.norm` gets + 1 (the
  zero-centred RMSNorms become plain ones); `in_proj_qkvz` (rows grouped per key head:
  q, k, v, z) is regrouped into `attn_qkv` (all q rows, all k rows, all v rows) and `attn_gate`
  (all z rows); the gated attention's q_proj (query and gate rows interleaved per head), `in_proj_ba`
  and `out_proj` are copied; each layer's experts are stacked per projection
  (`ffn_{gate,up,down}_exps`, numpy shape [experts, rows, cols]); the shared expert and its
  sigmoid gate become `ffn_*_shexp` / `ffn_gate_inp_shexp`;
- tokenizer keys copied from qwen2-tiny-q8_0.gguf, which llama.cpp's converter wrote from the
  same tokenizer files (every fixture shares one tokenizer), with this fixture's chat template.
"""
import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

from make_gguf_moe_fixture import add_tokenizer  # same directory

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "fixtures/llm/qwen3next-tiny"
TOK_SRC = REPO / "crates/cmf-convert/tests/fixtures/gguf/qwen2-tiny-q8_0.gguf"
OUT = REPO / "crates/cmf-convert/tests/fixtures/gguf/qwen3next-tiny-f32.gguf"
ARCH = gguf.MODEL_ARCH.QWEN3NEXT


def regroup_qkvz(w: torch.Tensor, cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """in_proj_qkvz → (attn_qkv, attn_gate), as the converter splits it."""
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    hidden = cfg["hidden_size"]
    split = [dk, dk, nv // nk * dv, nv // nk * dv]
    t = w.permute(1, 0).contiguous().view(-1, nk, sum(split))
    q, k, v, z = torch.split(t, split, dim=-1)
    q, k, v, z = (x.contiguous().view(hidden, -1) for x in (q, k, v, z))
    return torch.cat([q, k, v], dim=-1).permute(1, 0).contiguous(), z.permute(1, 0).contiguous()


def tensors(cfg: dict) -> dict[str, torch.Tensor]:
    st = load_file(str(SRC / "model.safetensors"))
    names = gguf.get_tensor_name_map(ARCH, cfg["num_hidden_layers"])
    n_exp = cfg["num_experts"]
    out: dict[str, torch.Tensor] = {}

    def emit(name: str, t: torch.Tensor) -> None:
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, f"no GGUF name for {name}"
        out[new] = t

    experts: dict[str, torch.Tensor] = {}
    for name, t in st.items():
        if name.endswith(".A_log"):
            t = -torch.exp(t)
        elif name.endswith(".dt_bias"):
            name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
        elif "conv1d" in name:
            t = t.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1
        if "in_proj_qkvz.weight" in name:
            bid = int(name.split(".")[2])
            qkv, z = regroup_qkvz(t, cfg)
            out[f"blk.{bid}.attn_qkv.weight"] = qkv
            out[f"blk.{bid}.attn_gate.weight"] = z
        elif ".mlp.experts." in name:
            experts[name] = t
        else:
            emit(name, t)
    for i in range(cfg["num_hidden_layers"]):
        for leaf in ("down_proj", "gate_proj", "up_proj"):
            keys = [f"model.layers.{i}.mlp.experts.{e}.{leaf}.weight" for e in range(n_exp)]
            if keys[0] in experts:
                emit(f"model.layers.{i}.mlp.experts.{leaf}.weight",
                     torch.stack([experts.pop(k) for k in keys], dim=0))
    assert not experts, f"unmapped experts: {sorted(experts)}"
    return out


def main() -> None:
    cfg = json.loads((SRC / "config.json").read_text())
    rope = cfg["rope_parameters"]
    tok = gguf.GGUFReader(str(TOK_SRC))

    w = gguf.GGUFWriter(str(OUT), gguf.MODEL_ARCH_NAMES[ARCH])
    w.add_name("qwen3next-tiny")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg["num_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    w.add_ssm_state_size(cfg["linear_key_head_dim"])
    w.add_ssm_group_count(cfg["linear_num_key_heads"])
    w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    w.add_full_attention_interval(cfg.get("full_attention_interval", 4))
    w.add_rope_dimension_count(int(cfg["head_dim"] * rope.get("partial_rotary_factor", 0.25)))

    add_tokenizer(w, tok, SRC)

    for name, t in tensors(cfg).items():
        w.add_tensor(name, np.ascontiguousarray(t.numpy(), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(OUT, OUT.stat().st_size, "bytes")


if __name__ == "__main__":
    main()
