#!/usr/bin/env bash
# GPU LLM benchmark: the CUDA backend on random-weight models of Qwen3-0.6B and
# Qwen3-8B geometry, q8 (q8_row) and bf16, generated in memory on the GPU machine (the same
# codec payloads `cmf synth` writes; no file round trip).
#
# Per model it prints: prefill tok/s and TFLOP/s at 512 and 4096 tokens (median of 3 after a
# warm-up; against the ~790 TFLOP/s bf16 ceiling), and decode tok/s at batch 1 from contexts
# 128 and 4096 (128 greedy steps after 4 warm-up steps, each step one graph replay, launched
# one token ahead, and one token read from a pinned ring);
# against the floor weight_bytes_per_token / 4.3 TB/s), with the bytes uploaded during the
# timed decode window (must be 0).
#
# usage, on the GPU machine from the repository root, with the binaries staged in .dev/:
#   bench/gpu_llm.sh [--profile]         # --profile adds per-stage device times of one layer
# Build and stage here first: ../shared/tools/stage-for-device -p cmf-gpu (see docs/gpu.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bench=${CMF_GPU_BENCH:-./.dev/bin/cmf-gpu-bench}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true
for preset in qwen3-0.6b qwen3-8b; do
  for quant in q8 bf16; do
    "$bench" --preset "$preset" --quant "$quant" "$@"
  done
done
