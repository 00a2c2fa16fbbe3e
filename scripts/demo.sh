#!/usr/bin/env bash
# The newcomer's first command: fetch the demo model once, import it into CMF, ask it a question.
# usage: scripts/demo.sh ["prompt"]
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${CMF_CACHE:-$HOME/.cache/cmf}
GGUF=$(scripts/fetch-demo-model.sh)
MODEL=$CACHE/smollm2-135m-instruct.cmf
cargo build --release --quiet -p cmf-cli
CMF=${CARGO_TARGET_DIR:-target}/release/cmf
[ -f "$MODEL" ] || "$CMF" import-gguf "$GGUF" --output "$MODEL"
"$CMF" run "$MODEL" --prompt "${1:-What is the capital of France?}" --max-tokens 64 --temp 0
