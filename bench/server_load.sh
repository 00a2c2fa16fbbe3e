#!/usr/bin/env bash
# `cmf serve` under a small bounded load on loopback: requests/s, generated tokens/s, time to
# first token and latency with 1 and 4 concurrent streaming chat clients (greedy, MAX_TOKENS each),
# via crates/cmf-server/examples/loadgen.rs. One JSON line per run on stdout.
#
# usage: bench/server_load.sh [MODEL.cmf]   (default: $CMF_CACHE/smollm2-135m-instruct.cmf)
# Env (defaults): THREADS=2 (inference threads)  CLIENTS="1 4"  REQUESTS=12 (per run)  MAX_TOKENS=64
#                 REPS=2  TIME_LIMIT=240 (s per run)  NICE=10  CMF_BIN (default target/release/cmf)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
MODEL=${1:-${CMF_CACHE:-$HOME/.cache/cmf}/smollm2-135m-instruct.cmf}
THREADS=${THREADS:-2}; CLIENTS=${CLIENTS:-"1 4"}; REQUESTS=${REQUESTS:-12}; MAX_TOKENS=${MAX_TOKENS:-64}
REPS=${REPS:-2}; TIME_LIMIT=${TIME_LIMIT:-240}; NICE=${NICE:-10}
CMF_BIN=${CMF_BIN:-$ROOT/target/release/cmf}
(cd "$ROOT" && cargo build --release -q -p cmf-server --example loadgen)
LOADGEN=$ROOT/target/release/examples/loadgen

LOG=$(mktemp)
nice -n "$NICE" "$CMF_BIN" serve "$MODEL" --port 0 --threads "$THREADS" --queue 8 2>"$LOG" &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null; rm -f "$LOG"' EXIT
for _ in $(seq 100); do grep -q "serving" "$LOG" && break; sleep 0.2; done
PORT=$(sed -n 's|.*http://127\.0\.0\.1:\([0-9]*\)/v1.*|\1|p' "$LOG" | head -1)
[ -n "$PORT" ] || { cat "$LOG" >&2; echo "the server did not start" >&2; exit 1; }
echo "# $(date -u +%FT%TZ) commit $(git -C "$ROOT" rev-parse --short HEAD) model $(basename "$MODEL") threads $THREADS load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
# One warm-up request (page cache, thread pool), not reported.
"$LOADGEN" --port "$PORT" --clients 1 --requests 1 --max-tokens 8 > /dev/null
for c in $CLIENTS; do
  for _ in $(seq "$REPS"); do
    "$LOADGEN" --port "$PORT" --clients "$c" --requests "$REQUESTS" --max-tokens "$MAX_TOKENS" --time-limit "$TIME_LIMIT"
  done
done
