#!/usr/bin/env bash
# Session 25, call 3: the sustained bf16 / fp16 GEMM rate at the power cap, on the usual peak shape
# (8192³) and on a layer's four block GEMMs, 5 s per dtype and round.
cd "$(dirname "$0")/../../.."
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
PYTHONUNBUFFERED=1 timeout 40 python3 bench/gemm_dtype_probe.py --square 8192 --seconds 5 > $OUT/gemm-square.log 2>&1; echo "rc=$?"
PYTHONUNBUFFERED=1 timeout 40 python3 bench/gemm_dtype_probe.py --seconds 5 > $OUT/gemm-layer.log 2>&1; echo "rc=$?"
grep -hv Warn $OUT/gemm-square.log $OUT/gemm-layer.log
