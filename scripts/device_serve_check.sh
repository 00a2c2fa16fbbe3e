#!/usr/bin/env bash
# On the GPU machine (binaries staged in .dev/bin, see docs/gpu.md): `cmf serve --gpu off` vs `--gpu cuda`
# on the qwen3-tiny fixture (f32 and q8): the same greedy answers over HTTP (2026-11-30, commit 4935aa2:
# identical for both codecs).
set -u
cd "$(dirname "$0")/.."
[ -f .dev/bin/cmf.xz ] && xz -d .dev/bin/cmf.xz; chmod +x .dev/bin/cmf
export XDG_CACHE_HOME=/tmp/xdg
C=.dev/bin/cmf
for q in f32 q8; do
  $C convert --model fixtures/llm/qwen3-tiny --quant $q -o /tmp/t-$q.cmf > /dev/null 2>&1 || echo "convert $q failed"
  for g in off cuda; do
    CMF_LOG=debug $C serve /tmp/t-$q.cmf --port 0 --gpu $g > /dev/null 2> /tmp/serve-$q-$g.err &
    pid=$!
    for _ in $(seq 150); do grep -q "serving" /tmp/serve-$q-$g.err && break; sleep 0.2; done
    port=$(sed -n 's|.*http://127\.0\.0\.1:\([0-9]*\)/v1.*|\1|p' /tmp/serve-$q-$g.err | head -1)
    python3 - "$port" > /tmp/resp-$q-$g.txt <<'PY'
import json, sys, urllib.request
port = sys.argv[1]
def post(path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"content-type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=60))
a = post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 24, "temperature": 0})
b = post("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0})
print(repr(a["choices"][0]["message"]["content"]), a["usage"])
print(repr(b["choices"][0]["text"]), b["usage"])
PY
    echo "q=$q gpu=$g port=$port rc=$?"; grep -E "cmf-gpu|serving|error" /tmp/serve-$q-$g.err | head -4
    kill $pid; wait $pid 2>/dev/null
  done
  cmp -s /tmp/resp-$q-off.txt /tmp/resp-$q-cuda.txt && echo "q=$q: answers identical off vs cuda" || { echo "q=$q: ANSWERS DIFFER"; cat /tmp/resp-$q-off.txt /tmp/resp-$q-cuda.txt; }
done
