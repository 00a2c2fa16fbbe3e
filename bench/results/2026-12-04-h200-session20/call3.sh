#!/usr/bin/env bash
# Twentieth run, call 3: swiglu_r16 variants. A = as committed (thread t holds columns
# [16t, 16t + 16), 56 registers: one 640-thread block an SM); B = groups strided across the warp
# (each load instruction of a warp reads one span), 48 registers: two blocks an SM; C = B with
# __maxnreg__(32): three blocks an SM, a 16-byte spill. Row-kernel tests of B and C, steps A/B/C
# alternating in int8, bf16, fp8-fast, and ncu's times of swiglu_r16 in each.
cd "$(dirname "$0")/../../.."
for f in .dev/bin/*.xz .dev/tests/*.xz; do [ -f "$f" ] && xz -d -f $f; done; chmod +x .dev/bin/* .dev/tests/*
W=/tmp/c3; mkdir -p $W/logs; L=$W/logs; B=.dev/bin; T=.dev/tests
export CMF_FIXTURES=$PWD/fixtures XDG_CACHE_HOME=/tmp/xdg-b
(nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,temperature.gpu --format=csv) > $L/machine.txt 2>&1
for v in B C; do timeout 120 $T/cuda-test-$v dit_ --nocapture > $L/cuda-$v.log 2>&1; echo "cuda-$v dit_ rc=$? $(grep -h '^test result' $L/cuda-$v.log)" >> $L/rc.txt; done
cp $B/cmf-dit-bench $B/cmf-dit-bench-A
bench() { local v=$1 tag=$2; shift 2; env "$@" $B/cmf-dit-bench-$v --res 1024 --steps 20 --cap 30 >> $L/b-$tag-$v.log 2>&1; }
for v in A B C; do bench $v warm CMF_DIT_FP8=int8; done   # first process of each compiles its kernels
for i in 1 2; do for v in A B C; do bench $v int8 CMF_DIT_FP8=int8; bench $v bf16 CMF_DIT_FP8=0; bench $v fast CMF_DIT_FP8=fast; done; done
NCU=/usr/local/cuda/bin/ncu; M=gpu__time_duration.sum,dram__bytes_read.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active
for v in A B C; do for p in int8 0 fast; do timeout 100 $NCU --metrics $M -k regex:"swiglu" --launch-skip 20 --launch-count 6 env CMF_DIT_FP8=$p $B/cmf-dit-bench-$v --res 1024 --steps 2 --cap 30 > $L/ncu-$v-$p.log 2>&1; done; done
tar czf $OUT/c3.tgz -C $W logs
cat $L/machine.txt $L/rc.txt; grep -h "FAILED\|panicked" $L/cuda-*.log | head
for t in int8 bf16 fast; do for v in A B C; do echo "$t $v: $(grep -h '²' $L/b-$t-$v.log | awk -F'|' '{print $6}' | tr '\n' ' ')"; done; done
for f in $L/ncu-*.log; do echo "$(basename $f): $(grep -E 'gpu__time_duration|launch__registers|warps_active' $f | awk '{print $NF}' | paste -sd' ' | cut -c1-160)"; done
