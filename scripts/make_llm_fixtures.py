#!/usr/bin/env python3
"""Tiny random-weight LLM fixtures with reference outputs from Hugging Face transformers.

What this is: the generator of `fixtures/llm/<name>/`, one Hugging Face model directory per fixture
(config.json, safetensors weights, tokenizer.json, tokenizer_config.json with a chat template,
generation_config.json) plus `expected.json` / `expected.safetensors` holding what transformers computes
from exactly those files: teacher-forced f32 logits for a fixed prompt, a greedy continuation with the
logits of each decode step, chat-template renderings and tokenizations.
What it is not: a test. The Rust tests read the committed outputs; CI needs no Python.

usage: /work/venv/bin/python scripts/make_llm_fixtures.py [--out fixtures/llm] [--only NAME ...]

Determinism: fixed seeds, one torch thread, eager attention, weights initialised here (not by
transformers' init), so a rerun with the same torch / transformers / tokenizers versions rewrites the same
bytes (checked on this machine: two runs, identical sha256 of every file). Another CPU or torch build may
change the last bits of the logits (matmul blocking), not the weights, tokenizer or ids.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
from pathlib import Path

import safetensors.torch
import tokenizers
import torch
import transformers
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "fixtures/text/kjv-excerpt.txt"  # public domain, committed (scripts/llamacpp_reference.sh)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_VOCAB = 512
# Qwen2's pre-tokenizer split (tokenizer.json of Qwen/Qwen2.5-*): exercises \p{L}/\p{N} classes,
# a case-insensitive group and a look-ahead, which the Rust `tokenizers` crate runs through fancy-regex.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

PROMPT_LEN = 48  # > mistral-tiny's sliding window (16), >= 40 as the tests require
MAX_NEW_TOKENS = 24
MIN_TOP2_MARGIN = 1e-3  # greedy steps must not be near-ties, or an f32 reimplementation could flip them

# ChatML as Qwen2.5 writes it (default system message, trim filter, raise_exception on unknown roles).
CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are a tiny test model.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('Unknown role: ' + message.role) }}"
    "{%- endif %}"
    "{%- if message.role == 'user' or message.role == 'assistant' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content | trim + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen3-style: tools rendered with `tojson` inside <tools></tools>, no default system message.
QWEN3_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role != 'system' %}"
    "{{- raise_exception('Unknown role: ' + message.role) }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Mistral-instruct style: bos_token, [INST] blocks, system folded into the first user turn,
# alternation enforced with raise_exception. add_generation_prompt renders nothing extra.
MISTRAL_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}"
    "{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if loop.first and system_message is defined %}"
    "{{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}"
    "{%- else %}{{- ' [INST] ' + message['content'] + ' [/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}"
    "{%- else %}{{- raise_exception('Only user and assistant roles are supported!') }}"
    "{%- endif %}"
    "{%- endfor %}"
)

TOKENIZATION_CASES = [
    "Hello world",
    " leading space",
    "trailing space ",
    "multiple   spaces    here",
    "line one\nline two\n\n\nline five",
    "tab\tseparated\tvalues",
    "digits 1234567890 and pi 3.14159",
    "Unicode: café naïve résumé Ærøskøbing",
    "combining e\u0301 becomes é under NFC",
    "中文字符测试",
    "emoji 🙂👍🏽 and flags 🇫🇷",
    "<|im_start|>user\nhi<|im_end|>",
    "text<|endoftext|>more text",
    "fn main() { println!(\"hi {}\", 1 + 2); }",
    "I'm sure they'LL say WE'RE done",
    "In the beginning God created the heaven and the earth.",
]

SYSTEM_USER = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]
USER_ONLY = [{"role": "user", "content": "  Say hi.  "}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city <with> 'quotes' & \"ampersands\", café",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]

# One entry per fixture. `hf` goes to the transformers config class; the rest drives how it is written.
FIXTURES = {
    "llama-tiny": dict(
        family="llama",
        covers=[
            "LlamaForCausalLM, GQA (4 query heads, 2 kv heads)",
            "untied embeddings (separate lm_head.weight)",
            "rope_scaling rope_type=llama3 (factor 8, low/high freq factor 1/4, original_max_position_embeddings 32):"
            " head_dim 16 gives unscaled, smoothly interpolated and fully scaled frequencies",
            "f32 weights, sharded into 2 safetensors files with model.safetensors.index.json",
            "config.json in the legacy layout (rope_theta + rope_scaling at top level, as hub checkpoints have)",
            "ChatML template with a default system message",
        ],
        hf=dict(
            model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=256,
            tie_word_embeddings=False, bos_token_id=None, eos_token_id=2,
            rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                                 high_freq_factor=4.0, original_max_position_embeddings=32),
        ),
        dtype=torch.float32, shard="250KB", legacy_rope=True, template=CHATML_TEMPLATE,
        tok=dict(bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>"),
        gen=dict(eos_token_id=[2, 0], pad_token_id=0),
        seed=1,
    ),
    "qwen2-tiny": dict(
        family="qwen2",
        covers=[
            "Qwen2ForCausalLM, GQA (4/2), q/k/v projection biases (o_proj without bias)",
            "tied embeddings (no lm_head.weight in the file)",
            "3 layers, rope_theta 1e6",
            "f32 weights, single model.safetensors; config.json in the legacy layout (rope_theta)",
            "ChatML template with a default system message",
        ],
        hf=dict(
            model_type="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=256,
            tie_word_embeddings=True, use_sliding_window=False, bos_token_id=None, eos_token_id=2,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
        dtype=torch.float32, shard=None, legacy_rope=True, template=CHATML_TEMPLATE,
        tok=dict(bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>"),
        gen=dict(eos_token_id=[2, 0], pad_token_id=0, do_sample=True, temperature=0.7, top_p=0.8, top_k=20),
        seed=5,
    ),
    "qwen3-tiny": dict(
        family="qwen3",
        covers=[
            "Qwen3ForCausalLM, GQA (4/2), per-head q_norm/k_norm (RMSNorm over head_dim before RoPE)",
            "head_dim 32 != hidden/heads (q_proj is 64->128, o_proj 128->64)",
            "tied embeddings",
            "config vocab_size 544 > tokenizer size 512 (padded embedding rows, as real Qwen checkpoints have)",
            "bf16 weights on disk (expected outputs: the bf16 weights upcast to f32, computed in f32)",
            "config.json in the transformers 5 layout (rope_parameters)",
            "Qwen3-style template: tools rendered with tojson, no default system message",
        ],
        hf=dict(
            model_type="qwen3", vocab_size=544, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
            max_position_embeddings=256, tie_word_embeddings=True, use_sliding_window=False,
            attention_bias=False, bos_token_id=None, eos_token_id=2, rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
        dtype=torch.bfloat16, shard=None, legacy_rope=False, template=QWEN3_TEMPLATE,
        tok=dict(bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>"),
        gen=dict(eos_token_id=[2, 0], pad_token_id=0, bos_token_id=0),
        seed=3,
    ),
    "mistral-tiny": dict(
        family="mistral",
        covers=[
            "MistralForCausalLM, GQA (4/2), untied embeddings",
            "sliding_window 16 < prompt length 48: logits differ from full causal attention from position 16 on"
            " (the script checks this)",
            "f32 weights, single model.safetensors; config.json in the legacy layout (rope_theta)",
            "Mistral [INST] template with bos_token and alternation check; scalar eos_token_id",
        ],
        hf=dict(
            model_type="mistral", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=256,
            tie_word_embeddings=False, sliding_window=16, bos_token_id=0, eos_token_id=2,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
        dtype=torch.float32, shard=None, legacy_rope=True, template=MISTRAL_TEMPLATE,
        tok=dict(bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token=None),
        gen=dict(eos_token_id=2, bos_token_id=0),
        seed=4,
    ),
    # Mixture-of-experts: 8 experts of width 32, top 2, hidden 64. Checkpoints are written by
    # save_pretrained in the hub layout (one tensor per expert: mlp.experts.{e}.{gate,up,down}_proj).
    "qwen3-moe-tiny": dict(
        family="qwen3_moe",
        covers=[
            "Qwen3MoeForCausalLM: 8 experts (moe_intermediate_size 32), top 2, norm_topk_prob true",
            "3 layers, layer 1 dense (mlp_only_layers [1], intermediate_size 128): dense and MoE layers mixed",
            "GQA (4/2), q_norm/k_norm, head_dim 16, untied embeddings, f32 single file",
        ],
        hf=dict(
            model_type="qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=128,
            moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
            decoder_sparse_step=1, mlp_only_layers=[1], num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=256,
            tie_word_embeddings=False, use_sliding_window=False, sliding_window=None, attention_bias=False,
            bos_token_id=None, eos_token_id=2, rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
        dtype=torch.float32, shard=None, legacy_rope=False, template=QWEN3_TEMPLATE,
        tok=dict(bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>"),
        gen=dict(eos_token_id=[2, 0], pad_token_id=0),
        seed=6,
    ),
    "qwen3-moe-unnorm-tiny": dict(
        family="qwen3_moe",
        covers=[
            "Qwen3MoeForCausalLM: 8 experts, top 2, norm_topk_prob false (the top-2 softmax weights used as they are)",
            "2 layers, both MoE (no mlp_only_layers), tied embeddings, f32 single file",
        ],
        hf=dict(
            model_type="qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=128,
            moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
            max_position_embeddings=256, tie_word_embeddings=True, use_sliding_window=False, sliding_window=None,
            attention_bias=False, bos_token_id=None, eos_token_id=2,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
        dtype=torch.float32, shard=None, legacy_rope=False, template=QWEN3_TEMPLATE,
        tok=dict(bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>"),
        gen=dict(eos_token_id=[2, 0], pad_token_id=0),
        seed=7,
    ),
    "qwen2-moe-tiny": dict(
        family="qwen2_moe",
        covers=[
            "Qwen2MoeForCausalLM: 8 experts (width 32), top 2, norm_topk_prob false",
            "shared expert (shared_expert_intermediate_size 48) scaled by sigmoid(shared_expert_gate(x))",
            "3 layers, decoder_sparse_step 1 with mlp_only_layers [0]: layer 0 is a dense MLP",
            "q/k/v biases (qkv_bias), GQA (4/2), untied embeddings, f32 single file, legacy rope layout",
        ],
        hf=dict(
            model_type="qwen2_moe", vocab_size=512, hidden_size=64, intermediate_size=128,
            moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[0], num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=256,
            tie_word_embeddings=False, use_sliding_window=False, sliding_window=None, qkv_bias=True,
            bos_token_id=None, eos_token_id=2, rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
        dtype=torch.float32, shard=None, legacy_rope=True, template=CHATML_TEMPLATE,
        tok=dict(bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>"),
        gen=dict(eos_token_id=[2, 0], pad_token_id=0),
        seed=8,
    ),
}

MIN_ROUTER_MARGIN = 1e-4  # top-k vs next expert probability gap; f32 recomputation differs by ~1e-7


# Qwen3-Next geometry shared by the two hybrid fixtures: three GatedDeltaNet layers then one gated
# full-attention layer; 2 key heads serving 4 value heads (each q/k head feeds two delta states);
# dk 16 != dv 24; head_dim 32 with partial_rotary_factor 0.25 (rotary dim 8).
QWEN3_NEXT_HF = dict(
    model_type="qwen3_next", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, max_position_embeddings=256,
    tie_word_embeddings=False, attention_bias=False, bos_token_id=None, eos_token_id=2,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=24, linear_num_key_heads=2,
    linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=48, norm_topk_prob=True, decoder_sparse_step=1,
)
QWEN3_NEXT_PROMPT_LEN = 80  # > transformers' GDN chunk (64): its chunked prefill crosses a chunk boundary

FIXTURES["qwen3next-dense-tiny"] = dict(
    family="qwen3_next",
    covers=[
        "Qwen3NextForCausalLM, layer_types linear_attention x3 + full_attention",
        "GatedDeltaNet: fused in_proj_qkvz / in_proj_ba, depthwise causal conv1d (kernel 4), A_log / dt_bias,"
        " 2 key heads for 4 value heads, dk 16 != dv 24, gated RMSNorm with z",
        "gated attention: q_proj emits query and gate, q/k norm, partial_rotary_factor 0.25 (rotary dim 8)",
        "zero-centred (1 + w) RMSNorms",
        "mlp_only_layers = every layer: dense SiLU MLP feed-forward (no experts)",
        "prompt of 80 tokens: transformers' chunked GDN prefill (chunk 64) spans two chunks",
        "f32 weights, untied embeddings; transformers' pure-torch GDN path (no fla / causal-conv1d)",
    ],
    hf=dict(QWEN3_NEXT_HF, mlp_only_layers=[0, 1, 2, 3]),
    dtype=torch.float32, shard=None, legacy_rope=False, template=QWEN3_TEMPLATE,
    tok=dict(bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>"),
    gen=dict(eos_token_id=[2, 0], pad_token_id=0),
    seed=7, prompt_len=QWEN3_NEXT_PROMPT_LEN,
)
FIXTURES["qwen3next-tiny"] = dict(
    family="qwen3_next",
    covers=[
        "Qwen3NextForCausalLM with the geometry of qwen3next-dense-tiny",
        "every layer's feed-forward is the sparse MoE block: 4 experts, top-2, norm_topk_prob,"
        " sigmoid-gated shared expert",
        "f32 weights, untied embeddings; transformers' pure-torch GDN path",
    ],
    hf=dict(QWEN3_NEXT_HF),
    dtype=torch.float32, shard=None, legacy_rope=False, template=QWEN3_TEMPLATE,
    tok=dict(bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>"),
    gen=dict(eos_token_id=[2, 0], pad_token_id=0),
    seed=8, prompt_len=QWEN3_NEXT_PROMPT_LEN,
)


def build_tokenizer() -> tokenizers.Tokenizer:
    """Byte-level BPE (Qwen2 layout: NFC, regex split, byte-level) trained on the KJV excerpt."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    lines = CORPUS.read_text(encoding="utf-8").splitlines(keepends=True)
    tok.train_from_iterator(lines, trainer=trainer, length=len(lines))
    assert tok.get_vocab_size() == TOKENIZER_VOCAB, tok.get_vocab_size()
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def init_weights(model: torch.nn.Module, seed: int, tied: bool) -> None:
    """Weights with O(1) activations and peaked logits (transformers' 0.02-std init gives near-uniform
    logits whose greedy argmax is a coin toss at f32 rounding level)."""
    g = torch.Generator().manual_seed(seed)
    zero_centred = getattr(model.config, "model_type", "") == "qwen3_next"
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if zero_centred and init_qwen3_next_param(name, p, g):
                continue
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                # Tied: a large embedding makes h . e_last dominate the logits and the model repeats its
                # input token forever, a continuation that cannot catch a broken KV cache.
                std = 0.1 if tied else 0.7
                p.copy_(std * torch.randn(p.shape, generator=g))
            elif name == "lm_head.weight":
                p.copy_(torch.randn(p.shape, generator=g) * (2.0 / math.sqrt(p.shape[1])))
            else:  # [out, in] projections; fused experts [E, out, in]
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


def init_qwen3_next_param(name: str, p: torch.Tensor, g: torch.Generator) -> bool:
    """Qwen3-Next parameters the generic init gets wrong; returns False for the rest.
    Its RMSNorms scale by (1 + w) (w near 0), except the GDN's gated norm (plain w, near 1). The decay
    exp(-exp(A_log)·softplus(a + dt_bias)) is kept near 1 (A in [0.02, 0.5]), so the delta state carries
    information across many tokens instead of forgetting it each step."""
    if name.endswith("linear_attn.norm.weight"):
        p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
    elif name.endswith("norm.weight") or "layernorm" in name:
        p.copy_(0.2 * torch.randn(p.shape, generator=g))
    elif name.endswith("A_log"):
        p.copy_(torch.log(0.02 + 0.48 * torch.rand(p.shape, generator=g)))
    elif name.endswith("dt_bias"):
        p.copy_(0.5 * torch.randn(p.shape, generator=g))
    elif name.endswith("conv1d.weight"):  # [channels, 1, kernel]
        p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    elif p.dim() == 3:  # stacked experts [E, out, in]
        p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    else:
        return False
    return True


def to_legacy_rope(cfg: dict) -> dict:
    """transformers 5 writes `rope_parameters`; most hub checkpoints still carry `rope_theta` and
    `rope_scaling` at the top level. Rewrite to that layout (transformers reads both)."""
    rp = cfg.pop("rope_parameters")
    out = {}
    for k, v in cfg.items():
        out[k] = v
        if k == "rms_norm_eps":
            out["rope_theta"] = rp["rope_theta"]
            scaling = {k2: v2 for k2, v2 in rp.items() if k2 != "rope_theta"}
            out["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" else scaling
    assert "rope_theta" in out
    return out


def write_tokenizer_files(d: Path, tok: tokenizers.Tokenizer, spec: dict) -> None:
    tok.save(str(d / "tokenizer.json"))
    added = {str(tok.token_to_id(s)): dict(content=s, lstrip=False, normalized=False, rstrip=False,
                                           single_word=False, special=True) for s in SPECIAL_TOKENS}
    cfg = dict(
        add_bos_token=False, add_prefix_space=False, added_tokens_decoder=added,
        bos_token=spec["tok"]["bos_token"], chat_template=spec["template"], clean_up_tokenization_spaces=False,
        eos_token=spec["tok"]["eos_token"], errors="replace", model_max_length=4096,
        pad_token=spec["tok"]["pad_token"], split_special_tokens=False,
        tokenizer_class="PreTrainedTokenizerFast", unk_token=None,
    )
    write_json(d / "tokenizer_config.json", cfg)


def write_model(d: Path, name: str, spec: dict) -> None:
    hf = dict(spec["hf"])
    cfg = transformers.AutoConfig.for_model(**hf)
    cfg.architectures = [type(transformers.AutoModelForCausalLM.from_config(cfg)).__name__]
    torch.manual_seed(spec["seed"])
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    init_weights(model, spec["seed"], cfg.tie_word_embeddings)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model = model.to(spec["dtype"])
    kw = dict(safe_serialization=True)
    if spec["shard"]:
        kw["max_shard_size"] = spec["shard"]
    model.save_pretrained(d, **kw)
    c = json.loads((d / "config.json").read_text())
    if spec["legacy_rope"]:
        c = to_legacy_rope(c)
    write_json(d / "config.json", c)
    gen = dict(spec["gen"])
    gen["transformers_version"] = transformers.__version__
    write_json(d / "generation_config.json", gen)
    if spec["shard"]:
        assert (d / "model.safetensors.index.json").exists(), f"{name}: expected a sharded checkpoint"
        assert len(list(d.glob("model-*-of-*.safetensors"))) >= 2
    else:
        assert (d / "model.safetensors").exists()


def prompt_ids(seed: int, vocab: int, n: int = PROMPT_LEN) -> list[int]:
    """Random ordinary (non-special) ids: the models are random, meaningful text buys nothing."""
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(len(SPECIAL_TOKENS), vocab, (n,), generator=g).tolist()


def chat_case(hf_tok, messages, **kw) -> dict:
    rendered = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    ids = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False, **kw)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    ids = list(map(int, ids))
    assert ids == hf_tok(rendered, add_special_tokens=False)["input_ids"], "render+encode != apply_chat_template"
    case = dict(messages=messages, add_generation_prompt=True, rendered=rendered, ids=ids)
    if kw.get("tools"):
        case["tools"] = kw["tools"]
    return case


def reference_outputs(d: Path, name: str, spec: dict, tok: tokenizers.Tokenizer) -> None:
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    cfg = model.config
    vocab = cfg.vocab_size
    ids = prompt_ids(spec["seed"], TOKENIZER_VOCAB, spec.get("prompt_len", PROMPT_LEN))
    x = torch.tensor([ids])
    router_scores, hooks = [], []
    for mod_name, mod in model.named_modules():
        if mod_name.endswith("mlp.gate") and hasattr(mod, "top_k"):  # the MoE routers
            hooks.append(mod.register_forward_hook(lambda m, i, o: router_scores.append((m.top_k, o[0]))))
    with torch.no_grad():
        logits = model(x).logits[0].float().contiguous()  # [T, V]
        if getattr(cfg, "sliding_window", None):
            # The window must change the result, or the fixture would not test it.
            full = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager",
                                                        sliding_window=None).eval()
            lf = full(x).logits[0]
            w = cfg.sliding_window
            assert torch.allclose(lf[:w], logits[:w], atol=1e-5), "window must not matter before it fills"
            assert (lf[w + 1:] - logits[w + 1:]).abs().max() > 1e-2, "sliding window has no effect"
        out = model.generate(
            x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=MAX_NEW_TOKENS,
            min_new_tokens=MAX_NEW_TOKENS, repetition_penalty=1.0, output_logits=True,
            return_dict_in_generate=True,
        )
    for h in hooks:
        h.remove()
    router_margin = None
    if router_scores:
        # Every token's k-th and (k+1)-th router probabilities, in every MoE layer, prompt and decode.
        gaps = []
        for k, rl in router_scores:
            top = torch.softmax(rl.float(), dim=-1).topk(k + 1, dim=-1).values
            gaps.append((top[:, k - 1] - top[:, k]).min())
        router_margin = float(torch.stack(gaps).min())
        assert router_margin >= MIN_ROUTER_MARGIN, f"{name}: router near-tie ({router_margin}), pick another seed"
    gen = out.sequences[0, len(ids):].tolist()
    decode_logits = torch.stack([l[0].float() for l in out.logits]).contiguous()  # [N, V]
    assert len(gen) == MAX_NEW_TOKENS
    eos = spec["gen"]["eos_token_id"]
    eos = eos if isinstance(eos, list) else [eos]
    # min_new_tokens masks EOS; a stop in the middle would make "identical greedy continuation" ambiguous.
    assert not set(gen) & set(eos), f"{name}: greedy continuation hits EOS, pick another seed"
    top2 = decode_logits.topk(2, dim=-1).values
    margin = float((top2[:, 0] - top2[:, 1]).min())
    assert margin >= MIN_TOP2_MARGIN, f"{name}: greedy near-tie (margin {margin}), pick another seed"
    assert decode_logits.argmax(-1).tolist() == gen
    # The KV-cache decode path must agree with one teacher-forced pass over prompt + continuation.
    with torch.no_grad():
        tf = model(out.sequences).logits[0, len(ids) - 1:-1].float()
    assert torch.allclose(tf, decode_logits, atol=1e-4, rtol=1e-4), (tf - decode_logits).abs().max()
    assert torch.allclose(tf[0], logits[-1], atol=1e-5)

    hf_tok = AutoTokenizer.from_pretrained(d)
    chats = {"system_user": chat_case(hf_tok, SYSTEM_USER)}
    if spec["template"] is not MISTRAL_TEMPLATE:
        chats["user_only"] = chat_case(hf_tok, USER_ONLY)
    if spec["template"] is QWEN3_TEMPLATE:
        chats["system_user_tools"] = chat_case(hf_tok, SYSTEM_USER, tools=TOOLS)
    toks = []
    for text in TOKENIZATION_CASES:
        enc = tok.encode(text)  # add_special_tokens=True: the post-processor adds nothing here
        assert enc.ids == hf_tok(text)["input_ids"], f"tokenizers vs transformers differ on {text!r}"
        toks.append(dict(text=text, ids=enc.ids, tokens=enc.tokens, decoded=tok.decode(enc.ids, skip_special_tokens=False)))

    tensors = {"logits": logits, "decode_logits": decode_logits}
    module_refs = None
    if spec["family"] == "qwen3_next":
        module_refs = qwen3_next_module_refs(model, x, tensors)
    safetensors.torch.save_file(tensors, str(d / "expected.safetensors"))
    expected = dict(
        fixture=name,
        family=spec["family"],
        covers=spec["covers"],
        generated_by=dict(script="scripts/make_llm_fixtures.py", torch=torch.__version__,
                          transformers=transformers.__version__, tokenizers=tokenizers.__version__),
        weights_dtype=str(spec["dtype"]).removeprefix("torch."),
        reference_compute="transformers AutoModelForCausalLM, weights upcast to float32, eager attention, 1 thread",
        vocab_size=vocab,
        tokenizer_vocab_size=TOKENIZER_VOCAB,
        prompt_ids=ids,
        logits=dict(file="expected.safetensors", tensor="logits", shape=list(logits.shape), dtype="F32",
                    meaning="teacher-forced logits; row t predicts token t+1 of prompt_ids"),
        greedy=dict(
            command="model.generate(prompt, do_sample=False, max_new_tokens=%d, min_new_tokens=%d, repetition_penalty=1.0)"
            % (MAX_NEW_TOKENS, MAX_NEW_TOKENS),
            generated_ids=gen,
            min_top2_logit_margin=margin,
            decode_logits=dict(file="expected.safetensors", tensor="decode_logits", shape=list(decode_logits.shape),
                               dtype="F32", meaning="row i: logits from which generated_ids[i] was picked (KV-cache path)"),
        ),
        **({"min_router_topk_margin": router_margin} if router_margin is not None else {}),
        chat_template_cases=chats,
        **({"module_references": module_refs} if module_refs else {}),
        tokenization=dict(note="tokenizer.json encode with add_special_tokens=True (adds nothing: no BOS)",
                          cases=toks),
    )
    write_json(d / "expected.json", expected)


def qwen3_next_module_refs(model, x: torch.Tensor, tensors: dict) -> dict:
    """Per-layer residual streams and each GDN layer's state after the prompt, for checking the mixers
    one at a time. Also asserts the pure-torch GDN path ran (no fla / causal-conv1d kernels)."""
    import importlib.util
    # transformers picks fla / causal_conv1d when importable, else its torch functions.
    for pkg in ("fla", "causal_conv1d"):
        assert importlib.util.find_spec(pkg) is None, f"{pkg} is installed: the reference would not be the torch path"
    cfg = model.config
    with torch.no_grad():
        out = model(x, use_cache=True, output_hidden_states=True)
    tensors["hidden_states"] = torch.stack([h[0] for h in out.hidden_states]).float().contiguous()
    k = cfg.linear_conv_kernel_dim
    for i, t in enumerate(cfg.layer_types):
        if t != "linear_attention":
            continue
        layer = out.cache.layers[i] if hasattr(out, "cache") else out.past_key_values.layers[i]
        tensors[f"gdn_state.{i}"] = layer.recurrent_states[0][0].float().contiguous()
        # transformers keeps the last `kernel` conv inputs; the last kernel - 1 are the state.
        tensors[f"conv_state.{i}"] = layer.conv_states[0][0, :, -(k - 1):].float().contiguous()
    return dict(
        file="expected.safetensors",
        hidden_states="[layers + 1, prompt, hidden]: output_hidden_states of the teacher-forced prompt pass"
        " (row 0 the embeddings, row l the residual after layer l; the last has the final norm applied)",
        **{"gdn_state.L": "[value heads, dk, dv] delta-rule state of GDN layer L after the prompt",
           "conv_state.L": "[conv channels (q|k|v), kernel - 1] last conv inputs of GDN layer L after the prompt,"
           " oldest first"},
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(REPO / "fixtures/llm"))
    ap.add_argument("--only", nargs="*")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    tok = build_tokenizer()
    out = Path(args.out)
    for name, spec in FIXTURES.items():
        if args.only and name not in args.only:
            continue
        d = out / name
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        write_model(d, name, spec)
        write_tokenizer_files(d, tok, spec)
        reference_outputs(d, name, spec, tok)
        size = sum(f.stat().st_size for f in d.iterdir())
        digest = hashlib.sha256(b"".join(f.read_bytes() for f in sorted(d.iterdir()))).hexdigest()[:16]
        print(f"{name}: {size / 1024:.0f} KiB, sha256(all files) {digest}")


if __name__ == "__main__":
    main()
