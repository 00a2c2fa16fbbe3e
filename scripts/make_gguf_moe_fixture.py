#!/usr/bin/env python3
"""A `qwen3moe` GGUF of the tiny Qwen3-MoE fixture, for the `cmf import-gguf` MoE test.

usage: /work/venv/bin/python scripts/make_gguf_moe_fixture.py

Writes crates/cmf-convert/tests/fixtures/gguf/qwen3-moe-tiny-f32.gguf from fixtures/llm/qwen3-moe-tiny.
Written with the `gguf` Python package (gguf-py, llama.cpp's own writer), not by
`convert_hf_to_gguf.py`, in the layout that converter gives Qwen3-MoE checkpoints
(`conversion` `Qwen3MoeModel` / `Qwen2MoeModel.modify_tensors`):
- metadata: `qwen3moe.*` keys as `gguf.GGUFWriter.add_*` name them (block_count, context_length,
  embedding_length, feed_forward_length, attention.head_count / head_count_kv / key_length /
  value_length / layer_norm_rms_epsilon, rope.freq_base, expert_count, expert_used_count,
  expert_feed_forward_length);
- tensors: llama.cpp's names (`blk.N.attn_q`, `attn_q_norm`, `ffn_gate_inp`, ...), each layer's
  experts stacked per projection into one 3-D tensor (`blk.N.ffn_{gate,up,down}_exps.weight`,
  numpy shape [experts, rows, cols], i.e. `torch.stack` over the expert index), no Q/K
  permutation (Qwen), f32;
- the fixture's dense layer (mlp_only_layers [1]) keeps `blk.1.ffn_{gate,up,down}` (llama.cpp's
  own qwen3moe graph has no dense layers; the importer follows the tensors, as the CMF rule does);
- tokenizer keys copied from qwen2-tiny-q8_0.gguf, which llama.cpp's converter wrote from the
  same tokenizer files (every fixture shares one tokenizer), with this fixture's chat template.
llama.cpp's qwen3moe graph always renormalises the top-k weights, so the fixture is the
`norm_topk_prob: true` one.
"""
import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "fixtures/llm/qwen3-moe-tiny"
TOK_SRC = REPO / "crates/cmf-convert/tests/fixtures/gguf/qwen2-tiny-q8_0.gguf"
OUT = REPO / "crates/cmf-convert/tests/fixtures/gguf/qwen3-moe-tiny-f32.gguf"
ARCH = "qwen3moe"

LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
EXPERT_NAMES = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def tensors(cfg: dict) -> dict[str, np.ndarray]:
    st = load_file(str(SRC / "model.safetensors"))
    out = {
        "token_embd.weight": st.pop("model.embed_tokens.weight"),
        "output_norm.weight": st.pop("model.norm.weight"),
        "output.weight": st.pop("lm_head.weight"),
    }
    n_exp = cfg["num_local_experts"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for hf, gg in LAYER_NAMES.items():
            if p + hf in st:
                out[f"blk.{i}.{gg}"] = st.pop(p + hf)
        for leaf, gg in EXPERT_NAMES.items():
            names = [f"{p}mlp.experts.{e}.{leaf}.weight" for e in range(n_exp)]
            if names[0] in st:
                out[f"blk.{i}.{gg}.weight"] = np.stack([st.pop(n) for n in names])
    assert not st, f"unmapped tensors: {sorted(st)}"
    return out


def add_tokenizer(w: gguf.GGUFWriter, tok: gguf.GGUFReader, src: Path) -> None:
    """The tokenizer metadata of `tok` (a GGUF of the same vocabulary) and `src`'s chat template."""
    field = lambda k: tok.fields[k]
    w.add_tokenizer_model(str(field("tokenizer.ggml.model").contents()))
    w.add_tokenizer_pre(str(field("tokenizer.ggml.pre").contents()))
    w.add_token_list(field("tokenizer.ggml.tokens").contents())
    w.add_token_types(field("tokenizer.ggml.token_type").contents())
    w.add_token_merges(field("tokenizer.ggml.merges").contents())
    w.add_eos_token_id(int(field("tokenizer.ggml.eos_token_id").contents()))
    w.add_pad_token_id(int(field("tokenizer.ggml.padding_token_id").contents()))
    w.add_add_bos_token(bool(field("tokenizer.ggml.add_bos_token").contents()))
    w.add_add_eos_token(bool(field("tokenizer.ggml.add_eos_token").contents()))
    template = json.loads((src / "tokenizer_config.json").read_text())["chat_template"]
    w.add_chat_template(template)


def main() -> None:
    cfg = json.loads((SRC / "config.json").read_text())
    tok = gguf.GGUFReader(str(TOK_SRC))

    w = gguf.GGUFWriter(str(OUT), ARCH)
    w.add_name("qwen3-moe-tiny")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    add_tokenizer(w, tok, SRC)

    for name, t in tensors(cfg).items():
        w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(OUT, OUT.stat().st_size, "bytes")


if __name__ == "__main__":
    main()
