#!/usr/bin/env bash
cd "$(dirname "$0")/.."
for f in .dev/bin/*.xz .dev/tests/*.xz; do xz -d -f $f; done; chmod +x .dev/bin/* .dev/tests/*
export CMF_FIXTURES=$PWD/fixtures XDG_CACHE_HOME=/tmp/xdg
W=/tmp/c10; mkdir -p $W/logs; L=$W/logs; B=.dev/bin; T=.dev/tests
timeout 60 $B/cmf-gemm-tune --tokens 4128 --reps 5 > $L/tune.log 2>&1; echo "tune rc=$?" >> $L/rc.txt
timeout 60 $B/cmf-fp8-probe --tokens 4128 --reps 5 > $L/fp8-probe.log 2>&1; echo "probe rc=$?" >> $L/rc.txt
timeout 100 $T/cuda-test fp8 capture > $L/cuda.log 2>&1; echo "cuda rc=$?" >> $L/rc.txt
tar czf $OUT/c10.tgz -C $W logs
cat $L/rc.txt; grep -h "test result" $L/cuda.log; grep "fastest\|one layer" -A2 $L/tune.log | head -12; grep "^| 4128" $L/fp8-probe.log
