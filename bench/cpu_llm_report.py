#!/usr/bin/env python3
"""Table of pp512 / tg128 from the raw outputs bench/cpu_llm.sh leaves in RAW_DIR (standard library only).

File names: <model>__<engine>__<variant>__t<threads>[.pp|.tg].r<k>.json (llama.cpp: one file holding all
repetitions). Values are tokens/second: the median over repetitions, and the best in parentheses.
usage: python3 bench/cpu_llm_report.py RAW_DIR
"""
from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def last_json(path: Path):
    """The last line of the file that parses as JSON, or the whole file."""
    text = path.read_text(errors="replace").strip()
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith(("{", "[")):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def find_number(obj, keys: tuple[str, ...]):
    """First numeric value under one of `keys`, searching nested objects (for cmf's yet-unknown schema)."""
    if isinstance(obj, dict):
        for k in keys:
            if isinstance(obj.get(k), (int, float)):
                return float(obj[k])
        for v in obj.values():
            r = find_number(v, keys)
            if r is not None:
                return r
    if isinstance(obj, list):
        for v in obj:
            r = find_number(v, keys)
            if r is not None:
                return r
    return None


def main() -> None:
    raw = Path(sys.argv[1])
    rows: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: {"pp": [], "tg": []})
    loads: dict[tuple, str] = {}
    name_re = re.compile(r"^(?P<model>[^_]+(?:_[^_]+)*?)__(?P<engine>[a-z]+)__(?P<variant>.+?)__t(?P<t>\d+)"
                         r"(?:\.(?P<test>pp|tg))?(?:\.r\d+)?\.json$")
    for f in sorted(raw.glob("*.json")):
        m = name_re.match(f.name)
        if not m:
            continue
        key = (m["model"], m["engine"], m["variant"], int(m["t"]))
        load_file = raw / (f.name.split(".")[0] + ".load")
        if not load_file.exists():
            load_file = Path(str(f) + ".load")
        if load_file.exists():
            loads[key] = load_file.read_text().strip()
        data = last_json(f)
        if data is None:
            continue
        if m["engine"] == "llamacpp" or (isinstance(data, list) and data and "n_prompt" in data[0]):
            # llama-bench -o json, and cmf bench --json, which prints the same row shape.
            for test in data:
                samples = [float(x) for x in test.get("samples_ts", [test.get("avg_ts", 0.0)])]
                if test.get("n_prompt") == 512 and test.get("n_gen") == 0:
                    rows[key]["pp"] += samples
                elif test.get("n_prompt") == 0 and test.get("n_gen") == 128:
                    rows[key]["tg"] += samples
        elif m["engine"] == "cortiq":
            if m["test"] == "pp":
                v = find_number(data, ("prefill_tok_s",))
                if v:
                    rows[key]["pp"].append(v)
            elif m["test"] == "tg":
                v = find_number(data, ("decode_tok_s_steady",))
                if v:
                    rows[key]["tg"].append(v)
        else:  # cmf bench --json: accept llama-bench-like or flat field names
            pp = find_number(data, ("pp512", "pp_tok_s", "prefill_tok_s", "pp"))
            tg = find_number(data, ("tg128", "tg_tok_s", "decode_tok_s", "tg"))
            if pp:
                rows[key]["pp"].append(pp)
            if tg:
                rows[key]["tg"].append(tg)

    def cell(v: list[float]) -> str:
        if not v:
            return "—"
        return f"{statistics.median(v):.1f} ({max(v):.1f})"

    print("| model | engine | file | threads | pp512 tok/s median (best) | tg128 tok/s median (best) | n | load before |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    order = {"llamacpp": 0, "cortiq": 1, "cmf": 2}
    for key in sorted(rows, key=lambda k: (k[0], k[3], order.get(k[1], 9), k[2])):
        model, engine, variant, t = key
        r = rows[key]
        n = max(len(r["pp"]), len(r["tg"]))
        print(f"| {model} | {engine} | {variant} | {t} | {cell(r['pp'])} | {cell(r['tg'])} | {n} | {loads.get(key, '?')} |")


if __name__ == "__main__":
    main()
