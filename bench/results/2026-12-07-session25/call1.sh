#!/usr/bin/env bash
# Session 25, call 1: the row-kernel overlap probe (bench/overlap_probe.py, torch + triton at the
# 1024² DiT's shapes), then the Z-Image device suites and bench (bench/device_zimage.sh, all parts).
cd "$(dirname "$0")/../../.."
git log --oneline -1
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
PYTHONUNBUFFERED=1 timeout 100 python3 bench/overlap_probe.py > $OUT/overlap.log 2>&1; echo "probe rc=$?"
cat $OUT/overlap.log | grep -v Warning | tail -16
PARTS="tests bench e2e anchor" DEADLINE=470 bash bench/device_zimage.sh 2>&1 | tail -60
