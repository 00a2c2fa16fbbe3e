#!/usr/bin/env bash
cd "$(dirname "$0")/.."
for f in .dev/bin/*.xz .dev/tests/*.xz; do xz -d -f $f; done; chmod +x .dev/bin/* .dev/tests/*
export CMF_FIXTURES=$PWD/fixtures XDG_CACHE_HOME=/tmp/xdg
mkdir -p $OUT/logs; L=$OUT/logs; B=.dev/bin; T=.dev/tests
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,driver_version --format=csv > $L/smi.txt
$B/cmf-gemm-tune --all > $L/tune.log 2>&1
for v in blas lt tuned; do CMF_DIT_GEMM=$v $B/cmf-dit-bench --res 1024 --steps 20 --cap 30 > $L/b-bf16-$v-1.log 2>&1; done
for v in tuned blas; do CMF_DIT_GEMM=$v $B/cmf-dit-bench --res 1024 --steps 20 --cap 30 > $L/b-bf16-$v-2.log 2>&1; done
for v in blas tuned blas tuned; do CMF_DIT_FP8=fast CMF_DIT_GEMM=$v $B/cmf-dit-bench --res 1024 --steps 20 --cap 30 >> $L/b-fast-$v.log 2>&1; done
CMF_DIT_GEMM=tuned CMF_LOG=debug $B/cmf-dit-bench --res 1024 --steps 3 --cap 30 > $L/tuned-debug.log 2>&1
CMF_DIT_GEMM=tuned CMF_DIT_FP8=fast CMF_LOG=debug $B/cmf-dit-bench --res 1024 --steps 3 --cap 30 > $L/tuned-fast-debug.log 2>&1
CMF_DIT_GEMM=tuned $B/cmf-dit-bench --res 512 --steps 20 --cap 30 > $L/b512-bf16-tuned.log 2>&1
$B/cmf-dit-bench --res 512 --steps 20 --cap 30 > $L/b512-bf16-blas.log 2>&1
$T/cuda-test fp8 > $L/cuda-fp8.log 2>&1
CMF_DIT_GEMM=tuned $T/gpu_dit-test > $L/gpu_dit-tuned.log 2>&1
tail -3 $L/*.log | head -100
