#!/usr/bin/env python3
"""SentencePiece (llama-style BPE with byte fallback) tokenizer fixture for the GGUF tokenizer rebuild.

usage: scripts/make_spm_tokenizer_fixture.py LLAMA_CPP_DIR
  LLAMA_CPP_DIR: llama.cpp source tree with convert_hf_to_gguf.py, built so that build/bin/llama-tokenize
  exists (scripts/llamacpp_reference.sh builds the one vendored in the llama-cpp-python==0.3.36 sdist).

1. trains a 600-piece SentencePiece BPE model (byte_fallback) on fixtures/text/kjv-excerpt.txt;
2. writes a vocab-only GGUF with llama.cpp's own converter (`--vocab-only`, tokenizer.model path:
   real scores and token types) → crates/cmf-convert/tests/fixtures/gguf/spm-vocab.gguf;
3. asks llama.cpp's `llama-tokenize` (special tokens parsed, BOS added as the GGUF says) for the ids of
   a list of strings → crates/cmf-convert/tests/fixtures/gguf/spm-tokenize.json.
Needs sentencepiece, torch and transformers (the converter imports them).
"""
import json
import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

import sentencepiece as spm

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "crates/cmf-convert/tests/fixtures/gguf"
TEXTS = [
    "Hello world", "In the beginning God created the heaven and the earth.", " leading space",
    "trailing space ", "multiple   spaces    here", "line one\nline two\n\nline", "tab\tseparated",
    "digits 1234567890", "café naïve", "中文 😀 emoji", "<s>inside</s> text", "And God said, Let there be light",
    "   ", "a", "zzzz qqqq xxxx",
]


def main():
    llama_cpp = Path(sys.argv[1]).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        spm.SentencePieceTrainer.train(
            input=str(REPO / "fixtures/text/kjv-excerpt.txt"), model_prefix=str(tmp / "tokenizer"),
            model_type="bpe", vocab_size=600, byte_fallback=True, character_coverage=1.0,
            split_digits=True, allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
            normalization_rule_name="identity", bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
        )
        d = tmp / "model"
        d.mkdir()
        (tmp / "tokenizer.model").rename(d / "tokenizer.model")
        (d / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 600,
            "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2}))
        gguf_path = OUT / "spm-vocab.gguf"
        sys.path.insert(0, str(llama_cpp))
        sys.path.insert(1, str(llama_cpp / "gguf-py"))
        sys.argv = ["convert_hf_to_gguf.py", str(d), "--vocab-only", "--outfile", str(gguf_path)]
        runpy.run_path(str(llama_cpp / "convert_hf_to_gguf.py"), run_name="__main__")
        bin_dir = llama_cpp / "build/bin"
        cases = []
        for text in TEXTS:
            f = tmp / "s.txt"
            f.write_text(text)
            out = subprocess.run(
                [str(bin_dir / "llama-tokenize"), "-m", str(gguf_path), "-f", str(f), "--ids", "--no-escape", "--log-disable"],
                capture_output=True, text=True, check=True, env={**os.environ, "LD_LIBRARY_PATH": str(bin_dir)})
            cases.append({"text": text, "ids": json.loads(out.stdout.strip().splitlines()[-1])})
    (OUT / "spm-tokenize.json").write_text(json.dumps({
        "tool": "llama-tokenize (llama.cpp from llama-cpp-python==0.3.36), special tokens parsed",
        "cases": cases}, ensure_ascii=False, indent=1))
    print(gguf_path, gguf_path.stat().st_size, "bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
