#!/usr/bin/env bash
# Session 24, call 1: the Z-Image device suites and bench (bench/device_zimage.sh, all parts but the
# probes), then the LLM prefill and decode on the 8B geometry (the prefill's GEMM loop was refactored
# in c49e8c0/d76f0cf), each within the call's 600 s.
cd "$(dirname "$0")/../../.."
git log --oneline -1
PARTS="tests bench e2e anchor" DEADLINE=480 bash bench/device_zimage.sh 2>&1 | tail -70
for q in q8 bf16; do
  timeout 45 ./.dev/bin/cmf-gpu-bench --preset qwen3-8b --quant $q --prefill 512,4096 --decode-ctx 128 > $OUT/llm-8b-$q.log 2>&1
  echo "llm 8b $q rc=$?"; tail -12 $OUT/llm-8b-$q.log
done
