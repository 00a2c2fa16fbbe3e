#!/usr/bin/env bash
# On the GPU machine (binaries staged in .dev/bin, see docs/gpu.md): the OpenAI API features over
# HTTP with `cmf serve --gpu off` and `--gpu cuda` on the qwen3-tiny fixture (f32): greedy, seeded
# sampling, logprobs, logit_bias, n = 2, tool_choice "required", a json_schema response format and
# completions echo. Prints whether the two answers are identical; both go to $OUT.
set -u
cd "$(dirname "$0")/.."
T0=$SECONDS
OUT=${OUT:-/tmp/out}; W=/dev/shm/api; mkdir -p $W $OUT; S=$OUT/summary.txt
[ -f .dev/bin/cmf.xz ] && xz -d -f .dev/bin/cmf.xz; chmod +x .dev/bin/cmf
export XDG_CACHE_HOME=/tmp/xdg
st() { echo "[$((SECONDS-T0)) s] $*" | tee -a $S; }
C=${CMF:-.dev/bin/cmf}
$C convert --model fixtures/llm/qwen3-tiny --quant f32 -o $W/qwen3-tiny.cmf > /dev/null 2>&1 || st "convert failed"
# The API features over HTTP, --gpu off vs --gpu cuda, on the qwen3-tiny fixture (f32).
for g in off ${GPU:-cuda}; do
  $C serve $W/qwen3-tiny.cmf --port 0 --gpu $g > /dev/null 2> $W/serve-$g.err &
  pid=$!
  for _ in $(seq 150); do grep -q "serving" $W/serve-$g.err && break; sleep 0.2; done
  port=$(sed -n 's|.*http://127\.0\.0\.1:\([0-9]*\)/v1.*|\1|p' $W/serve-$g.err | head -1)
  python3 - "$port" > $W/api-$g.txt 2>&1 <<'PY'
import json, sys, urllib.request
port = sys.argv[1]
def post(path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        return json.load(urllib.request.urlopen(req, timeout=60))
    except urllib.error.HTTPError as e:
        return {"error": e.code, "body": e.read().decode()[:200]}
msg = [{"role": "user", "content": "Hello there"}]
tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
cases = {
  "greedy": {"messages": msg, "max_tokens": 24, "temperature": 0},
  "seeded": {"messages": msg, "max_tokens": 24, "temperature": 0.9, "top_p": 0.9, "seed": 5},
  "logprobs": {"messages": msg, "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 3},
  "bias": {"messages": msg, "max_tokens": 8, "temperature": 0, "logit_bias": {"10": 100}},
  "n2": {"messages": msg, "max_tokens": 8, "temperature": 0.8, "seed": 3, "n": 2},
  "tool_required": {"messages": msg, "max_tokens": 20, "temperature": 0, "tools": tools, "tool_choice": "required"},
  "json_schema": {"messages": msg, "max_tokens": 48, "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}},
}
for name, body in cases.items():
    r = post("/v1/chat/completions", body)
    if "choices" not in r:
        print(name, "ERROR", r); continue
    out = []
    for c in r["choices"]:
        m = c["message"]
        lp = c.get("logprobs")
        lps = [(t["token"], round(t["logprob"], 3)) for t in lp["content"]] if lp else None
        out.append((m.get("content"), m.get("tool_calls") and [(t["function"]["name"], t["function"]["arguments"]) for t in m["tool_calls"]], c["finish_reason"], lps))
    print(name, out)
b = post("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 2})
print("echo", b.get("choices", [{}])[0].get("text"), [round(x, 3) if x is not None else None for x in (b.get("choices", [{}])[0].get("logprobs") or {}).get("token_logprobs", [])])
PY
  kill $pid; wait $pid 2>/dev/null
done
cmp -s $W/api-off.txt $W/api-cuda.txt && st "API off vs cuda: identical" || { st "API off vs cuda: DIFFER"; diff $W/api-off.txt $W/api-cuda.txt | head -20 | tee -a $S; }
cp $W/api-*.txt $OUT/
st done
