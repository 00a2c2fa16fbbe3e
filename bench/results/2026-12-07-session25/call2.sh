#!/usr/bin/env bash
# Session 25, call 2 (lean: the session's device time was nearly spent): bf16 against fp16
# operands for the block GEMMs at the power cap (bench/gemm_dtype_probe.py), then the bf16 step
# at 1024² in four more processes.
cd "$(dirname "$0")/../../.."
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
PYTHONUNBUFFERED=1 timeout 60 python3 bench/gemm_dtype_probe.py > $OUT/gemm-dtype.log 2>&1; echo "probe rc=$?"
grep -v Warn $OUT/gemm-dtype.log | tail -6
PARTS="bench" SIZES=1024 PRECISIONS=bf16 REPEAT=4 DEADLINE=120 bash bench/device_zimage.sh 2>&1 | tail -8
