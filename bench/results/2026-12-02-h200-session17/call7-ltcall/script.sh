#!/usr/bin/env bash
cd "$(dirname "$0")/.."
for f in .dev/bin/*.xz .dev/tests/*.xz; do xz -d -f $f; done; chmod +x .dev/bin/* .dev/tests/*
export CMF_FIXTURES=$PWD/fixtures XDG_CACHE_HOME=/tmp/xdg
W=/tmp/c7; mkdir -p $W/logs; L=$W/logs; B=.dev/bin; T=.dev/tests
timeout 120 $T/cuda-test fp8 capture > $L/cuda.log 2>&1; echo "cuda rc=$?" >> $L/rc.txt
timeout 150 $T/gpu_dit-test > $L/gpu_dit.log 2>&1; echo "gpu_dit rc=$?" >> $L/rc.txt
timeout 60 $B/cmf-gemm-tune --tokens 4128 --reps 5 > $L/tune.log 2>&1; echo "tune rc=$?" >> $L/rc.txt
CMF_DIT_FP8=fast timeout 60 $B/cmf-dit-bench --res 1024 --steps 10 --cap 30 > $L/b-fast.log 2>&1
tar czf $OUT/c7.tgz -C $W logs
cat $L/rc.txt; grep -h "test result" $L/*.log; grep "fastest" $L/tune.log | head -8; grep "^| 1024" $L/b-fast.log
