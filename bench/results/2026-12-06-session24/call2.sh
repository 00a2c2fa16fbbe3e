#!/usr/bin/env bash
# Session 24, call 2 (the same warm H100 as call 1): the bf16 step at 1024² in four more processes
# with its profile, and diffusers eager and compiled at 1024² alone (call 1's compiled run used its
# time at 512²).
cd "$(dirname "$0")/../../.."
PARTS="bench anchor" SIZES=1024 PRECISIONS=bf16 REPEAT=4 DEADLINE=540 bash bench/device_zimage.sh 2>&1 | tail -12
