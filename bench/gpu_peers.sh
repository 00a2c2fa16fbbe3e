#!/usr/bin/env bash
# cmf beside llama.cpp CUDA on one card, on the same random-weight q8_0 GGUFs (cmf imports them):
#   moe:   Qwen3-30B-A3B per-layer geometry (LAYERS of its 48 layers, default 24 so that the GGUF
#          and its import fit /dev/shm together), batch 1: cmf bench / llama-bench, pp512 tg128
#          and pp4096
#   batch: Qwen3-8B geometry, llama-batched-bench's contract (128 prompt + 128 generated tokens
#          per sequence, 1/16/64/128 sequences): cmf bench --parallel / llama-batched-bench
#   serve: the same 8B file behind HTTP, streaming chat of 128 greedy tokens from 1/16/64 clients
#          (loadgen.py): cmf serve --gpu cuda --parallel 64 / llama-server -np 64
# Random routers spread tokens evenly over the experts, which is pessimistic for batching.
#
# Stage on the development machine (the tree travels with `.dev` and `.anchor` carried):
#   .dev/bin/cmf(.xz)                         release `cmf`, stripped
#   .anchor/llamacpp-src.tgz (or .txz)       llama.cpp source (../shared/bench/README.md)
#   .anchor/qwen3moe-template.gguf(.xz)       any Qwen3-family GGUF from llama.cpp's converter, or
#                                             bench/make_gguf_template.py's from the tokenizer
#                                             files (only its tokenizer metadata is used)
#   .anchor/loadgen.py                        ../shared/bench/loadgen.py (serve phase)
# Run on the GPU machine from the repository root; phases are idempotent (run it again on the
# same warm machine to finish what the deadline cut):
#   PHASES="moe batch serve" bench/gpu_peers.sh      summary in $OUT/summary.txt, logs beside it
set -u
cd "$(dirname "$0")/.."
T0=$SECONDS; DEADLINE=${DEADLINE:-570}
left() { echo $((DEADLINE - (SECONDS - T0))); }
OUT=${OUT:-/tmp/out}; S=$OUT/summary.txt; W=/dev/shm/peers; D=$W/done; mkdir -p "$OUT" $W $D /tmp/lc
st() { echo "[$((SECONDS - T0)) s] $*" | tee -a "$S"; }
has() { case " ${PHASES:-moe batch serve} " in *" $1 "*) return 0;; esac; return 1; }
for f in .dev/bin/*.xz .anchor/*.xz; do [ -f "$f" ] && xz -d -f "$f"; done; chmod +x .dev/bin/*
nvidia-smi --query-gpu=name,power.limit,driver_version,memory.total --format=csv,noheader | tee -a "$S"
C=./.dev/bin/cmf; A=$PWD/.anchor; LAYERS=${LAYERS:-24}
TPL=$(ls "$A"/qwen3moe-template.gguf "$A"/qwen3-template.gguf 2>/dev/null | head -1)

# llama.cpp builds in the background (CPU work, about 4 min on 16 cores) while cmf runs.
if [ ! -x /tmp/lc/llama.cpp/b/bin/llama-batched-bench ] && [ ! -f /tmp/lc/building ]; then
  [ -d /tmp/lc/llama.cpp ] || tar xf "$(ls "$A"/llamacpp-src.t*z | head -1)" -C /tmp/lc
  touch /tmp/lc/building
  G=cmake; command -v ninja >/dev/null && G="cmake -G Ninja"
  setsid nohup sh -c "cd /tmp/lc/llama.cpp && $G -B b -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF \
    > /tmp/lc/cfg.log 2>&1 && cmake --build b -j13 --target llama-bench llama-batched-bench llama-server > /tmp/lc/build.log 2>&1; rm -f /tmp/lc/building" >/dev/null 2>&1 &
fi
export PYTHONPATH=/tmp/lc/llama.cpp/gguf-py
while [ ! -d /tmp/lc/llama.cpp/gguf-py ]; do sleep 1; done
gguf() {  # name, make_qwen3_gguf.py arguments
  local n=$1; shift
  [ -f $W/$n.cmf ] && return 0
  python3 bench/make_qwen3_gguf.py "$TPL" $W/$n.gguf "$@" > "$OUT/gen-$n.log" 2>&1 || { st "$n: GGUF failed"; return 1; }
  $C import-gguf $W/$n.gguf -o $W/$n.cmf > "$OUT/import-$n.log" 2>&1 || { st "$n: import failed"; return 1; }
  st "$n: $(du -h $W/$n.gguf | cut -f1) GGUF imported"
}
has moe && gguf moe --layers $LAYERS
{ has batch || has serve; } && gguf q8b --arch qwen3 --layers 36 --hidden 4096 --kv-heads 8 --ffn 12288

if has moe && [ ! -f $D/cmf-moe ] && [ -f $W/moe.cmf ]; then
  for p in "-p 512 -n 128" "-p 4096 -n 0"; do
    timeout 150 $C bench $W/moe.cmf --gpu cuda $p -r 3 > "$OUT/cmf-moe.log" 2>&1
    st "cmf bench moe ($LAYERS layers) [$p]: $(grep -E '\| (pp|tg)' "$OUT/cmf-moe.log" | awk -F'|' '{print $7, $8}' | tr '\n' ' ')"
  done
  touch $D/cmf-moe
fi
if has batch && [ ! -f $D/cmf-batch ] && [ -f $W/q8b.cmf ]; then
  timeout 200 $C bench $W/q8b.cmf --gpu cuda -p 128 -n 128 --parallel 1,16,64,128 > "$OUT/cmf-batched.log" 2>&1
  st "cmf bench --parallel (Qwen3-8B geometry q8): rc=$?"; grep -E "^\|" "$OUT/cmf-batched.log" | tee -a "$S"
  touch $D/cmf-batch
fi

# loadgen.py PORT CLIENTS REQUESTS MAX_TOKENS TIME_LIMIT [EXTRA]: one JSON line per client count.
load() {
  local port=$1 name=$2 extra=${3:-"{}"}
  for _ in $(seq 600); do curl -sf localhost:$port/health > /dev/null && break; sleep 0.3; done
  for c in 1 16 64; do
    [ "$(left)" -lt 60 ] && break
    st "$name, $c clients: $(timeout 100 python3 "$A/loadgen.py" $port $c $((c * 2)) 128 60 "$extra")"
  done
}
if has serve && [ ! -f $D/cmf-serve ] && [ -f $W/q8b.cmf ] && [ "$(left)" -gt 150 ]; then
  $C serve $W/q8b.cmf --gpu cuda --parallel 64 --queue 256 -c 1024 --port 18080 > "$OUT/cmf-serve.log" 2>&1 &
  SP=$!
  load 18080 "cmf serve --parallel 64" '{"ignore_eos": true}'
  kill $SP; wait $SP 2>/dev/null; touch $D/cmf-serve
fi

st "waiting for the llama.cpp build"
while [ -f /tmp/lc/building ] && [ "$(left)" -gt 90 ]; do sleep 5; done
B=/tmp/lc/llama.cpp/b/bin
[ -x $B/llama-batched-bench ] || { tail -3 /tmp/lc/build.log | tee -a "$S"; st "llama.cpp not built yet: run again"; exit 3; }
if has moe && [ ! -f $D/llama-moe ] && [ "$(left)" -gt 60 ]; then
  timeout 150 $B/llama-bench -m $W/moe.gguf -ngl 99 -fa 1 -p 512,4096 -n 128 -r 3 -o md > "$OUT/llama-bench-moe.log" 2>&1
  st "llama-bench moe ($LAYERS layers):"; grep -E "pp|tg" "$OUT/llama-bench-moe.log" | tee -a "$S"
  touch $D/llama-moe
fi
if has batch && [ ! -f $D/llama-batch ] && [ "$(left)" -gt 60 ]; then
  timeout $(( $(left) - 10 )) $B/llama-batched-bench -m $W/q8b.gguf -ngl 99 -fa 1 -c 40000 -b 2048 -ub 512 \
    -npp 128 -ntg 128 -npl 1,16,64,128 > "$OUT/llama-batched-bench.log" 2>&1
  st "llama-batched-bench (Qwen3-8B geometry q8_0):"; grep -E "^\|" "$OUT/llama-batched-bench.log" | tee -a "$S"
  touch $D/llama-batch
fi
if has serve && [ ! -f $D/llama-serve ] && [ "$(left)" -gt 120 ]; then
  $B/llama-server -m $W/q8b.gguf -ngl 99 -fa on -np 64 -c 65536 --port 18081 > "$OUT/llama-server.log" 2>&1 &
  SP=$!
  load 18081 "llama-server -np 64" '{"ignore_eos": true}'
  kill $SP; wait $SP 2>/dev/null; touch $D/llama-serve
fi
st done
