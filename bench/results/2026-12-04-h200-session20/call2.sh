#!/usr/bin/env bash
# Twentieth run, call 2: same-machine A/B of the int8 path with and without the s32 sums read by
# the row kernels (CMF_DIT_INT8_SUMS), beside bf16 and fp8-fast; per-kernel times of the row
# kernels and the scaling pass (ncu), and a whole step's kernel table (nsys) where they run.
cd "$(dirname "$0")/../../.."
for f in .dev/bin/*.xz .dev/tests/*.xz; do [ -f "$f" ] && xz -d -f $f; done; chmod +x .dev/bin/* .dev/tests/*
W=/tmp/c2; mkdir -p $W/logs; L=$W/logs; B=.dev/bin
export XDG_CACHE_HOME=/tmp/xdg-b
(nproc; nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,temperature.gpu --format=csv; which ncu nsys) > $L/machine.txt 2>&1
bench() { local tag=$1; shift; env "$@" $B/cmf-dit-bench --res 1024 --steps 20 --cap 30 >> $L/b-$tag.log 2>&1; }
for i in 1 2; do bench int8-sums CMF_DIT_FP8=int8; bench int8-nosums CMF_DIT_FP8=int8 CMF_DIT_INT8_SUMS=0; bench bf16 CMF_DIT_FP8=0; bench fast CMF_DIT_FP8=fast; done
bench int8-sums CMF_DIT_FP8=int8; bench int8-nosums CMF_DIT_FP8=int8 CMF_DIT_INT8_SUMS=0
NCU=$(which ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum
for s in 1 0; do timeout 150 $NCU --metrics $M -k regex:"swiglu|residual_norm|dequant_s32" --launch-skip 60 --launch-count 16 env CMF_DIT_FP8=int8 CMF_DIT_INT8_SUMS=$s $B/cmf-dit-bench --res 1024 --steps 2 --cap 30 > $L/ncu-int8-sums$s.log 2>&1; done
timeout 150 $NCU --metrics $M -k regex:"swiglu|residual_norm|qk_norm|k_norm|rms" --launch-skip 60 --launch-count 16 env CMF_DIT_FP8=0 $B/cmf-dit-bench --res 1024 --steps 2 --cap 30 > $L/ncu-bf16.log 2>&1
NSYS=$(which nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems*/bin/nsys 2>/dev/null | head -1)
if [ -n "$NSYS" ]; then for v in 0 int8; do timeout 120 $NSYS profile --cuda-graph-trace=node -o $W/ns-$v env CMF_DIT_FP8=$v $B/cmf-dit-bench --res 1024 --steps 4 --cap 30 > $L/nsys-$v.log 2>&1; $NSYS stats --report cuda_gpu_kern_sum --format csv $W/ns-$v.nsys-rep > $L/kern-$v.csv 2>>$L/nsys-$v.log; done; fi
tar czf $OUT/c2.tgz -C $W logs
cat $L/machine.txt; grep -H '²' $L/b-*.log
for f in $L/ncu-*.log; do echo "== $f"; grep -E "^  [a-z_0-9]+.*\(|gpu__time|dram__bytes" $f | head -60 | awk '{$1=$1};1' | paste -sd' ' | sed 's/ \([a-z_0-9]*\) (/\n\1 (/g' | cut -c1-200 | head -20; grep -i "error\|==PROF==" $f | head -3; done
for f in $L/kern-*.csv; do echo "== $f"; head -25 $f | cut -c1-220; done
