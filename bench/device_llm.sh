#!/usr/bin/env bash
# LLMs on the GPU machine: GPU tests, `cmf run/ppl/bench --gpu` end to end against `--gpu off`,
# bench/gpu_llm.sh, and llama.cpp CUDA (../shared/bench/llamacpp_cuda.sh) on the same geometries in
# the same machine. Runs on the GPU machine from the repository root, with (built here):
#   .dev/bin/{cmf,cmf-gpu-bench}.xz, .dev/tests/{cmf_gpu-lib,cuda-test,gpu_parity-test,device_contention-test}.xz
#     (release builds, stripped, xz-compressed to fit the 64 MiB transfer), this script as .dev/device-run.sh;
#   .anchor/: llamacpp-src.tgz, tok/ (Qwen3 tokenizer), make_qwen3_random.py, llamacpp_cuda.sh
# Logs go to $OUT; those of 2026-11-30 are in bench/results/2026-11-30-h200-llm/.
# Env: SKIP_ANCHOR=1, SKIP_TESTS=1, SKIP_OURS=1, DEADLINE (s, default 570).
set -u
cd "$(dirname "$0")/.."
# CMF_REQUIRE_GPU: a GPU test that cannot open the device fails here instead of printing SKIPPED.
export CMF_FIXTURES=$PWD/fixtures XDG_CACHE_HOME=/tmp/xdg CMF_REQUIRE_GPU=1
for f in .dev/bin/*.xz .dev/tests/*.xz; do [ -f "$f" ] && xz -d "$f"; done
chmod +x .dev/bin/* .dev/tests/*
T0=$SECONDS
stamp() { echo "[$((SECONDS-T0)) s] $*"; }
# llama.cpp anchor in the background (its build is CPU work; its GPU runs come after ours)
if [ "${SKIP_ANCHOR:-0}" != 1 ]; then
  (ANCHOR_WAIT=1500 setsid nohup bash .anchor/llamacpp_cuda.sh > /tmp/anchor-phase.log 2>&1 &)
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  stamp tests
  for t in cmf_gpu-lib cuda-test gpu_parity-test device_contention-test; do
    [ -x .dev/tests/$t ] || { echo "$t: not built"; continue; }
    ./.dev/tests/$t --nocapture --test-threads 1 > $OUT/$t.log 2>&1; echo "$t rc=$?"
    grep -E "^test result|FAILED|panicked|SKIP" $OUT/$t.log | head -8
  done
  stamp cli
  C=./.dev/bin/cmf
  $C convert --model fixtures/llm/qwen3-tiny --quant f32 -o /tmp/q3t.cmf > /dev/null 2>&1
  $C convert --model fixtures/llm/qwen3-tiny --quant q8 -o /tmp/q3t8.cmf > /dev/null 2>&1
  for m in /tmp/q3t.cmf /tmp/q3t8.cmf; do
    for g in off cuda; do
      CMF_LOG=debug $C run $m --raw -p "The quick brown fox" --max-tokens 24 --temp 0 --gpu $g > /tmp/run-$g.txt 2> /tmp/run-$g.err
      echo "$m gpu=$g rc=$? $(tail -1 /tmp/run-$g.err)"
    done
    cmp -s /tmp/run-off.txt /tmp/run-cuda.txt && echo "$m: text identical off vs cuda" || { echo "$m: TEXT DIFFERS"; cat /tmp/run-off.txt /tmp/run-cuda.txt; }
  done
  cat /tmp/run-cuda.err | head -20
  $C ppl /tmp/q3t.cmf --file fixtures/text/kjv-excerpt.txt --ctx 128 --chunks 4 --gpu off 2>&1 | tail -1
  $C ppl /tmp/q3t.cmf --file fixtures/text/kjv-excerpt.txt --ctx 128 --chunks 4 --gpu cuda 2>&1 | tail -1
  stamp synth
  $C synth --preset qwen3-0.6b --quant q8 -o /tmp/q06.cmf > /dev/null 2>&1; echo synth rc=$?
  $C bench /tmp/q06.cmf -p 512 -n 128 -r 3 --gpu cuda 2>&1 | tail -6
fi
if [ "${SKIP_OURS:-0}" != 1 ]; then
  stamp our bench
  bash bench/gpu_llm.sh > $OUT/gpu_llm.log 2>&1; echo "gpu_llm rc=$?"
  grep -v "^\s*$" $OUT/gpu_llm.log | tail -40
fi
stamp waiting for llama.cpp
while [ $SECONDS -lt ${DEADLINE:-570} ]; do
  grep -q "qwen3-8b-bf16.*tg128" /tmp/anchor-phase.log 2>/dev/null && break
  pgrep -f llamacpp_cuda.sh > /dev/null || break
  sleep 5
done
cp /tmp/anchor-phase.log $OUT/llamacpp.log 2>/dev/null
stamp llama.cpp log; tail -25 /tmp/anchor-phase.log
