"""Inverse RoPE frequencies and attention scaling of each rope type, as transformers computes them
(`modeling_rope_utils.ROPE_INIT_FUNCTIONS`), for cmf-llm's `rope_parameters_match_transformers`.

usage: python scripts/make_rope_reference.py      writes crates/cmf-llm/tests/data/rope_reference.json
"""
import json, os
import torch, transformers
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
cases = [
    ("default", dict(rope_type="default", rope_theta=10000.0), None),
    ("linear", dict(rope_type="linear", rope_theta=10000.0, factor=4.0), None),
    ("dynamic_short", dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0), 100),
    ("dynamic_long", dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0), 300),
    ("llama3", dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                    high_freq_factor=4.0, original_max_position_embeddings=32), None),
    ("yarn", dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32), None),
    ("yarn_mscale", dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32,
                         mscale=0.707, mscale_all_dim=1.0, beta_fast=16.0, beta_slow=2.0), None),
    ("yarn_attention_factor", dict(rope_type="yarn", rope_theta=1e6, factor=2.0, original_max_position_embeddings=64,
                                   attention_factor=1.25, truncate=False), None),
]
out = {"generated_by": {"script": "scripts/make_rope_reference.py", "transformers": transformers.__version__,
                        "torch": torch.__version__}, "cases": []}
for name, rope, seq_len in cases:
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, max_position_embeddings=128,
                      rope_parameters=dict(rope))
    if rope["rope_type"] == "default":
        inv, scale = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    else:
        inv, scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, "cpu", **({"seq_len": seq_len} if seq_len else {}))
    out["cases"].append({"name": name, "config": {"head_dim": 64, "max_position_embeddings": 128,
                                                   "rope_parameters": rope}, "seq_len": seq_len,
                         "inv_freq": [float(x) for x in inv], "attention_scaling": float(scale)})
path = os.path.join(root, "crates/cmf-llm/tests/data/rope_reference.json")
json.dump(out, open(path, "w"), indent=1)
print("wrote", path)
