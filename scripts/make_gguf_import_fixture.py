#!/usr/bin/env python3
"""Converts the tiny Hugging Face llama fixture to GGUF with llama.cpp's own converter, for the
`cmf import-gguf` tests (Q/K un-permutation, name mapping, tokenizer rebuild, tied/untied).

usage: scripts/make_gguf_import_fixture.py LLAMA_CPP_DIR
  LLAMA_CPP_DIR: a llama.cpp source tree with convert_hf_to_gguf.py and gguf-py/ (e.g. the one
  vendored in the llama-cpp-python==0.3.36 sdist: llama_cpp_python-0.3.36/vendor/llama.cpp).

Writes crates/cmf-convert/tests/fixtures/gguf/llama-tiny-f32.gguf from fixtures/llm/llama-tiny,
qwen2-tiny-q8_0.gguf from fixtures/llm/qwen2-tiny (q/k/v biases, tied embeddings, no permutation,
Q8_0 matrices) and qwen3-moe-sparse-tiny-f32.gguf from fixtures/llm/qwen3-moe-unnorm-tiny (every
layer sparse, experts stacked by the converter) with `norm_topk_prob` set to true: llama.cpp's
qwen3moe always renormalises the top-k weights, and it has no dense layers, so this is the MoE
fixture its converter takes. Edits to temporary copies of the directories, all recorded here:
- `rope_scaling` is removed: llama.cpp turns llama3 scaling into a `rope_freqs` tensor, which the
  importer maps only for the standard Llama 3 parameters (the fixture uses original context 32);
  the permutation test does not depend on RoPE.
- the tokenizer's pre-tokenizer hash is unknown to llama.cpp (the fixture tokenizer is trained by
  scripts/make_llm_fixtures.py), so `get_vocab_base_pre` is patched to answer "qwen2", the regex the
  fixture tokenizer.json uses.
"""
import json
import runpy
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "fixtures/llm"
OUT_DIR = REPO / "crates/cmf-convert/tests/fixtures/gguf"
# (fixture, outtype, output name, config edits)
JOBS = [
    ("llama-tiny", "f32", "llama-tiny-f32", {}),
    ("qwen2-tiny", "q8_0", "qwen2-tiny-q8_0", {}),
    ("qwen3-moe-unnorm-tiny", "f32", "qwen3-moe-sparse-tiny-f32", {"norm_topk_prob": True}),
]


def main():
    llama_cpp = Path(sys.argv[1]).resolve()
    sys.path.insert(0, str(llama_cpp))
    sys.path.insert(1, str(llama_cpp / "gguf-py"))
    import conversion.base as base  # noqa: E402  (llama.cpp's converter package)

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
    for name, outtype, out_name, edits in JOBS:
        out = OUT_DIR / f"{out_name}.gguf"
        with tempfile.TemporaryDirectory() as tmp:
            d = Path(tmp) / name
            shutil.copytree(FIXTURES / name, d)
            cfg = json.loads((d / "config.json").read_text())
            cfg.pop("rope_scaling", None)
            cfg.update(edits)
            (d / "config.json").write_text(json.dumps(cfg, indent=2))
            sys.argv = ["convert_hf_to_gguf.py", str(d), "--outtype", outtype, "--outfile", str(out)]
            runpy.run_path(str(llama_cpp / "convert_hf_to_gguf.py"), run_name="__main__")
        print(out, out.stat().st_size, "bytes", file=sys.stderr)

if __name__ == "__main__":
    main()
