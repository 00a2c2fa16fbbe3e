#!/usr/bin/env python3
"""A random-weight Qwen3 or Qwen3-MoE GGUF (q8_0 matrices) of any geometry, written tensor by
tensor, for llama.cpp's side of the GPU benchmarks when a random Hugging Face checkpoint of the
geometry is too large or too slow to convert on the GPU machine (a 30B bf16 checkpoint does not fit
beside its GGUF).

usage: make_qwen3_gguf.py TEMPLATE.gguf OUT.gguf [--arch qwen3moe|qwen3] [--layers 48]
       [--hidden 2048] [--heads 32] [--kv-heads 4] [--head-dim 128] [--experts 128] [--top-k 8]
       [--expert-width 768] [--ffn 6144] [--tied] [--seed 0]
  Defaults: Qwen3-30B-A3B. Qwen3-8B: --arch qwen3 --layers 36 --hidden 4096 --kv-heads 8 --ffn 12288.
  TEMPLATE.gguf: a Qwen3-family GGUF written by llama.cpp's convert_hf_to_gguf.py (any size; only
  its tokenizer.* metadata is copied, so the vocabulary and chat template are the real
  converter's). Geometry keys are written as that converter names them; tensors use its names
  and layouts (experts stacked per projection, [E, rows, cols]).
Needs llama.cpp's gguf-py on PYTHONPATH and numpy. Matrices: q8_0 blocks with int8 values uniform
in [-127, 127] and a scale giving a std of about 0.02 (norms 1, router f32 std 0.02): speed only.
"""
import argparse

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

Q8 = GGMLQuantizationType.Q8_0


def q8_0_bytes(rng, shape):
    """Raw q8_0 bytes of a matrix `shape` (last dim = columns, a multiple of 32)."""
    *lead, cols = shape
    nblk = int(np.prod(lead)) * (cols // 32)
    out = np.empty((nblk, 34), dtype=np.uint8)
    out[:, :2] = np.frombuffer(np.float16(0.02 / 73.0).tobytes(), dtype=np.uint8)
    out[:, 2:] = rng.integers(0, 256, size=(nblk, 32), dtype=np.uint8)
    return out.reshape(*lead, cols // 32 * 34)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("template")
    p.add_argument("out")
    for name, default in [("layers", 48), ("hidden", 2048), ("heads", 32), ("kv-heads", 4),
                          ("head-dim", 128), ("experts", 128), ("top-k", 8), ("expert-width", 768),
                          ("seed", 0)]:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--ffn", type=int, default=6144)
    p.add_argument("--arch", choices=["qwen3moe", "qwen3"], default="qwen3moe")
    p.add_argument("--tied", action="store_true")
    a = p.parse_args()
    rng = np.random.default_rng(a.seed)
    tpl = GGUFReader(a.template)
    vocab = len(tpl.fields["tokenizer.ggml.tokens"].data)

    moe = a.arch == "qwen3moe"
    w = GGUFWriter(a.out, a.arch)
    for key, field in tpl.fields.items():
        if key.startswith("tokenizer."):
            vt = field.types[0]
            sub = field.types[-1] if len(field.types) > 1 else None
            w.add_key_value(key, field.contents(), vt, sub_type=sub)
    w.add_name("random qwen3moe")
    h, nh, nkv, d, e, k, wd = a.hidden, a.heads, a.kv_heads, a.head_dim, a.experts, a.top_k, a.expert_width
    w.add_block_count(a.layers)
    w.add_context_length(40960)
    w.add_embedding_length(h)
    w.add_feed_forward_length(a.ffn)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    if moe:
        w.add_expert_count(e)
        w.add_expert_used_count(k)
    w.add_key_length(d)
    w.add_value_length(d)
    w.add_file_type(7)  # MOSTLY_Q8_0
    if moe:
        w.add_expert_feed_forward_length(wd)
    w.add_quantization_version(2)

    plan = [("token_embd.weight", "q8", (vocab, h)), ("output_norm.weight", "one", (h,))]
    if not a.tied:
        plan.append(("output.weight", "q8", (vocab, h)))
    for l in range(a.layers):
        b = f"blk.{l}."
        plan += [
            (b + "attn_norm.weight", "one", (h,)),
            (b + "attn_q.weight", "q8", (nh * d, h)),
            (b + "attn_k.weight", "q8", (nkv * d, h)),
            (b + "attn_v.weight", "q8", (nkv * d, h)),
            (b + "attn_output.weight", "q8", (h, nh * d)),
            (b + "attn_q_norm.weight", "one", (d,)),
            (b + "attn_k_norm.weight", "one", (d,)),
            (b + "ffn_norm.weight", "one", (h,)),
        ]
        if moe:
            plan += [
                (b + "ffn_gate_inp.weight", "f32", (e, h)),
                (b + "ffn_gate_exps.weight", "q8", (e, wd, h)),
                (b + "ffn_up_exps.weight", "q8", (e, wd, h)),
                (b + "ffn_down_exps.weight", "q8", (e, h, wd)),
            ]
        else:
            plan += [
                (b + "ffn_gate.weight", "q8", (a.ffn, h)),
                (b + "ffn_up.weight", "q8", (a.ffn, h)),
                (b + "ffn_down.weight", "q8", (h, a.ffn)),
            ]

    def make(kind, shape):
        if kind == "q8":
            return q8_0_bytes(rng, shape)
        if kind == "one":
            return np.ones(shape, dtype=np.float32)
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)

    for name, kind, shape in plan:
        if kind == "q8":
            *lead, cols = shape
            byte_shape = (*lead, cols // 32 * 34)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=Q8)
        else:
            w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, kind, shape in plan:
        w.write_tensor_data(make(kind, shape))
    w.close()
    print(f"wrote {a.out}: {len(plan)} tensors")


if __name__ == "__main__":
    main()
