#!/usr/bin/env bash
# Regenerates fixtures/zimage/reference/: what the reference CLI (cortiq-cli 0.8.54) makes of the
# tiny fixture tree, for the interop tests in crates/cmf-zimage/tests/interop.rs.
#
#   tiny-cortiq.cmf     `cortiq imagine-pack` of fixtures/zimage/tiny (its defaults: q8_2f DiT and
#                       text-encoder projections, f32 VAE), committed so the cmf-side checks always run
#   turbo-cortiq.rgb    `cortiq imagine` of that pack with the turbo fixture's latents injected
#                       (CMF_INIT_LATENT), raw RGB u8 48×80×3
#
# usage: scripts/make_zimage_reference_packs.sh [CORTIQ_BIN]
# (install: cargo install cortiq-cli --version 0.8.54 --root /work/cache/cortiq)
set -euo pipefail
cd "$(dirname "$0")/.."
CORTIQ=${1:-${CORTIQ:-/work/cache/cortiq/bin/cortiq}}
OUT=fixtures/zimage/reference
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$OUT"

"$CORTIQ" imagine-pack fixtures/zimage/tiny --out "$OUT/tiny-cortiq.cmf" --no-source-sha
rm -f "$OUT/tiny-cortiq.cmf.sha256"

# The turbo recipe's initial latents as raw f32 (what CMF_INIT_LATENT reads).
/work/venv/bin/python - "$TMP/turbo.f32" <<'PY'
import sys
from safetensors.numpy import load_file
load_file("fixtures/zimage/expected/pipeline.safetensors")["turbo.latents"].astype("<f4").tofile(sys.argv[1])
PY
PROMPT=$(/work/venv/bin/python -c 'import json; print(json.load(open("fixtures/zimage/expected/cases.json"))["recipes"]["turbo"]["prompt"])')
CMF_INIT_LATENT="$TMP/turbo.f32" "$CORTIQ" imagine "$OUT/tiny-cortiq.cmf" --prompt "$PROMPT" \
    --width 80 --height 48 --steps 8 --cfg 0 --out "$TMP/turbo.ppm"
# P6 PPM → raw RGB
/work/venv/bin/python - "$TMP/turbo.ppm" "$OUT/turbo-cortiq.rgb" <<'PY'
import sys
b = open(sys.argv[1], "rb").read()
parts = b.split(b"\n", 3)
assert parts[0] == b"P6" and parts[1] == b"80 48" and parts[2] == b"255", parts[:3]
open(sys.argv[2], "wb").write(parts[3])
PY
ls -la "$OUT"
