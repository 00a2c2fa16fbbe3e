#!/usr/bin/env python3
"""A tensor-free GGUF holding a Qwen3 tokenizer's metadata, written as llama.cpp's
convert_hf_to_gguf.py writes it for Qwen3 (gpt2 BPE, pre-tokenizer "qwen2", token types, merges,
special ids, chat template), for make_qwen3_gguf.py's TEMPLATE argument. Needs transformers (no
torch) and llama.cpp's gguf-py on PYTHONPATH.

usage: make_gguf_template.py TOKDIR OUT.gguf [--vocab 151936]
  TOKDIR: tokenizer.json and tokenizer_config.json (../shared/bench/README.md says where from).
"""
import argparse

import gguf
from transformers import AutoTokenizer


def main():
    p = argparse.ArgumentParser()
    p.add_argument("tokdir")
    p.add_argument("out")
    p.add_argument("--vocab", type=int, default=151936, help="the model's vocabulary (padded)")
    a = p.parse_args()
    tok = AutoTokenizer.from_pretrained(a.tokdir)
    reverse = {i: t for t, i in tok.get_vocab().items()}
    added = tok.get_added_vocab()
    special = set(tok.all_special_tokens)
    tokens, types = [], []
    for i in range(a.vocab):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif reverse[i] in added:
            tokens.append(reverse[i])
            control = reverse[i] in special or tok.added_tokens_decoder[i].special
            types.append(gguf.TokenType.CONTROL if control else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.NORMAL)
    w = gguf.GGUFWriter(a.out, "qwen3")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(a.tokdir, load_merges=True, n_vocab=len(tokens)).add_to_gguf(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    print(f"wrote {a.out}: {len(tokens)} tokens")


if __name__ == "__main__":
    main()
