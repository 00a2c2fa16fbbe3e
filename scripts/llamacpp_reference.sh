#!/usr/bin/env bash
# llama.cpp reference outputs on the SmolLM2 demo GGUF -> fixtures/llamacpp/{tokenize,greedy,ppl}.json.
# Builds llama.cpp (CPU) from the llama-cpp-python 0.3.36 sdist and fetches the model, both under CACHE_DIR;
# nothing from llama.cpp enters the repository. Takes ~10 min on 2 cores once built (perplexity runs twice:
# the tool itself and a per-chunk recomputation through libllama).
#
# usage: scripts/llamacpp_reference.sh [CACHE_DIR] [tokenize|greedy|ppl ...]
# Env: PYTHON (needs numpy; default /work/venv/bin/python if present, else python3).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${1:-${CMF_CACHE:-/work/cache}}
shift || true
if [ -z "${PYTHON:-}" ]; then
  if [ -x /work/venv/bin/python ]; then PYTHON=/work/venv/bin/python; else PYTHON=$(command -v python3); fi
fi
export PYTHON

SRC=$("$ROOT/scripts/llamacpp_build.sh" "$CACHE" | tail -1)
GGUF=$("$ROOT/scripts/fetch-demo-model.sh" "$CACHE" | tail -1)
SDIST=$(dirname "$(dirname "$SRC")")        # .../llama_cpp_python-0.3.36 (holds the llama_cpp ctypes package)
TEXT="$ROOT/fixtures/text/kjv-excerpt.txt"
if [ ! -f "$TEXT" ]; then
  command -v bible >/dev/null || { echo "error: $TEXT missing and no 'bible' (apt-get install bible-kjv)" >&2; exit 2; }
  bible gen1:1-gen25:34 > "$TEXT"
fi

# llama-cpp-python's package imports diskcache at import time; keep it out of any shared venv.
PYDEPS="$CACHE/pydeps"
if ! PYTHONPATH="$PYDEPS" "$PYTHON" -c "import diskcache, numpy" 2>/dev/null; then
  "$PYTHON" -m pip install -q --target "$PYDEPS" diskcache >&2
fi

ONLY=()
[ $# -gt 0 ] && ONLY=(--only "$@")
PYTHONPATH="$PYDEPS" nice -n 5 "$PYTHON" "$ROOT/scripts/llamacpp_reference.py" --llamacpp "$SRC" --sdist "$SDIST" \
  --gguf "$GGUF" --text "$TEXT" --out "$ROOT/fixtures/llamacpp" "${ONLY[@]}"
