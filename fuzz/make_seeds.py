#!/usr/bin/env python3
"""Writes the committed seed corpora of the `gguf`, `safetensors_config` and `text_assets` fuzz
targets (fuzz/corpus/<target>/): small valid inputs from the test fixtures and one reproducer per
hostile-input class the importers and loaders refuse. `model_loader` seeds are written by
`cargo test --release -p cmf-llm --test fuzz_corpus -- --ignored` (they need the CMF writer).

Run from the repository root: python3 fuzz/make_seeds.py
"""
import json
import shutil
import struct
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "fuzz" / "corpus"
GGUF_FIXTURES = ROOT / "crates/cmf-convert/tests/fixtures/gguf"
LLM_FIXTURES = ROOT / "fixtures/llm"

# GGUF value type ids
U32, I32, F32, BOOL, STRING, ARRAY = 4, 5, 6, 7, 8, 9


def gstr(s):
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def gval(ty, v):
    if ty == U32:
        return struct.pack("<I", v)
    if ty == I32:
        return struct.pack("<i", v)
    if ty == F32:
        return struct.pack("<f", v)
    if ty == BOOL:
        return struct.pack("<B", v)
    if ty == STRING:
        return gstr(v)
    elem, items = v
    return struct.pack("<IQ", elem, len(items)) + b"".join(gval(elem, x) for x in items)


def gguf(kv, tensors=()):
    """kv: [(key, type, value)]; tensors: [(name, dims, f32 values)] stored as F32."""
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv))
    for k, ty, v in kv:
        out += gstr(k) + struct.pack("<I", ty) + gval(ty, v)
    data, infos = b"", b""
    for name, dims, vals in tensors:
        infos += gstr(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        infos += struct.pack("<IQ", 0, len(data))
        data += struct.pack(f"<{len(vals)}f", *vals)
        data += b"\0" * (-len(data) % 32)
    out += infos
    out += b"\0" * (-len(out) % 32)
    return out + data


def llama_meta(**over):
    meta = {
        "general.architecture": (STRING, "llama"),
        "llama.embedding_length": (U32, 8),
        "llama.feed_forward_length": (U32, 16),
        "llama.attention.head_count": (U32, 2),
        "llama.attention.head_count_kv": (U32, 2),
        "llama.block_count": (U32, 1),
        "llama.context_length": (U32, 64),
        "llama.attention.layer_norm_rms_epsilon": (F32, 1e-5),
        "llama.rope.freq_base": (F32, 10000.0),
        "tokenizer.ggml.model": (STRING, "gpt2"),
        "tokenizer.ggml.pre": (STRING, "default"),
        "tokenizer.ggml.tokens": (ARRAY, (STRING, ["a", "b", "ab"])),
        "tokenizer.ggml.merges": (ARRAY, (STRING, ["a b"])),
    }
    meta.update(over)
    return [(k, t, v) for k, (t, v) in meta.items()]


def gguf_seeds(d):
    for f in ["metadata.gguf", "spm-vocab.gguf", "dequant.gguf", "qwen2-tiny-q8_0.gguf"]:
        shutil.copy(GGUF_FIXTURES / f, d / f)
    embd = [("token_embd.weight", [8, 3], [0.0] * 24)]
    nan = float("nan")
    cases = {
        "minimal-llama.gguf": llama_meta(),
        "block-count-2e32.gguf": llama_meta(**{"llama.block_count": (U32, 2**32 - 1)}),
        "rms-eps-nan.gguf": llama_meta(**{"llama.attention.layer_norm_rms_epsilon": (F32, nan)}),
        "rms-eps-negative.gguf": llama_meta(**{"llama.attention.layer_norm_rms_epsilon": (F32, -1e-5)}),
        "rope-base-nan.gguf": llama_meta(**{"llama.rope.freq_base": (F32, nan)}),
        "head-count-zero.gguf": llama_meta(**{"llama.attention.head_count": (U32, 0)}),
        "merges-unknown-token.gguf": llama_meta(**{"tokenizer.ggml.merges": (ARRAY, (STRING, ["a z"]))}),
        "long-spm-token.gguf": llama_meta(**{
            "tokenizer.ggml.model": (STRING, "llama"),
            "tokenizer.ggml.tokens": (ARRAY, (STRING, ["a", "b" * 2000])),
            "tokenizer.ggml.scores": (ARRAY, (F32, [0.0, 0.0])),
        }),
        "chat-template-nested-loops.gguf": llama_meta(**{
            "tokenizer.chat_template": (STRING, "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"),
        }),
    }
    for name, kv in cases.items():
        (d / name).write_bytes(gguf(kv, embd))
    # A uint8 array claiming more elements than the file holds.
    (d / "array-count-lies.gguf").write_bytes(
        b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + gstr("big") + struct.pack("<IIQ", ARRAY, 0, 2**40) + b"\0" * 64)


def safetensors(tensors):
    header, data = {}, b""
    for name, shape, vals in tensors:
        b = struct.pack(f"<{len(vals)}f", *vals)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [len(data), len(data) + len(b)]}
        data += b
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


def safetensors_seeds(d):
    cfg = json.loads((LLM_FIXTURES / "qwen3-tiny/config.json").read_text())
    (d / "qwen3-tiny.bin").write_bytes(json.dumps(cfg).encode() + b"\0" + (LLM_FIXTURES / "qwen3-tiny/model.safetensors").read_bytes())
    small = safetensors([("model.norm.weight", [4], [1.0] * 4)])
    for key, val in [("num_hidden_layers", 2**40), ("vocab_size", 2**40), ("hidden_size", 2**40),
                     ("rms_norm_eps", -1e-6), ("rope_theta", -1.0), ("rope_theta", 0.0),
                     ("partial_rotary_factor", 0.0), ("head_dim", 2**40), ("num_key_value_heads", 0),
                     ("max_position_embeddings", 2**62)]:
        c = dict(cfg)
        c[key] = val
        (d / f"config-{key}-{val}.bin").write_bytes(json.dumps(c).encode() + b"\0" + small)
    good = json.dumps(cfg).encode() + b"\0"
    (d / "st-header-len-huge.bin").write_bytes(good + struct.pack("<Q", 2**63) + b"{}")
    (d / "st-header-not-json.bin").write_bytes(good + struct.pack("<Q", 4) + b"nope")
    (d / "st-offsets-outside.bin").write_bytes(good + struct.pack("<Q", 80) +
        b'{"model.norm.weight":{"dtype":"F32","shape":[4],"data_offsets":[0,1000000]}}   ')
    (d / "config-not-object.bin").write_bytes(b"[1,2,3]\0" + small)


def text_assets_seeds(d):
    tok = json.dumps({"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
                      "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None,
                      "decoder": None, "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hello": 1}, "unk_token": "[UNK]"}})
    panic_tok = json.loads(tok)
    panic_tok["normalizer"] = {"type": "Precompiled", "precompiled_charsmap": "BAAAAP////8="}
    qwen_tok = (LLM_FIXTURES / "qwen3-tiny/tokenizer.json").read_bytes()
    qwen_tmpl = json.loads((LLM_FIXTURES / "qwen3-tiny/tokenizer_config.json").read_text())["chat_template"]
    templates = {
        "chatml": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}",
        "nested-loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "output-6gb": "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}",
        "tojson-indent-1e11": "{{ messages | tojson(indent=100000000000) }}",
        "indent-filter-huge": "{{ 'a\nb' | indent(100000000000) }}",
        "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        "string-doubling": "{% set ns = namespace(s='x' * 1000) %}{% for i in range(12) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
        "tojson-separators": "{{ messages | tojson(separators=('x' * 1000000, ':')) }}",
        "raise": "{{ raise_exception('no') }}",
        "syntax-error": "{% for %}",
    }
    (d / "ok-no-template.bin").write_bytes(tok.encode())
    (d / "precompiled-panic.bin").write_bytes(json.dumps(panic_tok).encode() + b"\0" + templates["chatml"].encode())
    (d / "qwen3-tiny.bin").write_bytes(qwen_tok + b"\0" + qwen_tmpl.encode())
    (d / "not-json.bin").write_bytes(b"{\"model\": 1\0{{ 1 }}")
    for name, t in templates.items():
        (d / f"template-{name}.bin").write_bytes(tok.encode() + b"\0" + t.encode())


def main():
    for target, make in [("gguf", gguf_seeds), ("safetensors_config", safetensors_seeds),
                         ("text_assets", text_assets_seeds)]:
        d = CORPUS / target
        d.mkdir(parents=True, exist_ok=True)
        make(d)
        print(f"{d}: {len(list(d.iterdir()))} files")


if __name__ == "__main__":
    main()
