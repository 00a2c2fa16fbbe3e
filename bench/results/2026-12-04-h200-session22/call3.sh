#!/usr/bin/env bash
# Twenty-second run, call 3: where residual_norm's time goes (ncu's full set on one launch each of
# residual_norm, swiglu_r16 and k_norm_rope in the bf16 step at 1024²). Logs: $OUT/c3.tgz.
cd "$(dirname "$0")/../../.."
for f in .dev/bin/*.xz; do [ -f "$f" ] && xz -d -f $f; done; chmod +x .dev/bin/*
L=/tmp/L3; mkdir -p $L; B=.dev/bin
trap 'tar -C /tmp -czf $OUT/c3.tgz L3' EXIT
export XDG_CACHE_HOME=/tmp/xdg
NCU=$(which ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
$B/cmf-dit-bench --res 1024 --steps 2 --cap 30 > $L/warm.log 2>&1
for k in residual_norm swiglu_r16 k_norm_rope; do
  timeout 150 $NCU --set full -k regex:"^$k\$" --launch-skip 20 --launch-count 1 env CMF_DIT_FP8=0 $B/cmf-dit-bench --res 1024 --steps 2 --cap 30 > $L/ncu-$k.log 2>&1
done
for k in residual_norm swiglu_r16 k_norm_rope; do echo "== $k"; grep -E 'Duration|Memory Throughput|DRAM Throughput|L1/TEX Hit|L2 Hit|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Compute \(SM\) Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|Warp Cycles Per Issued|Stall|One or More|Issued Warp' $L/ncu-$k.log | head -40; done
grep -A3 -i 'est. speedup\|bottleneck\|OPT ' $L/ncu-residual_norm.log | head -80
