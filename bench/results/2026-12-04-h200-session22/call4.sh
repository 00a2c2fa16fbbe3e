#!/usr/bin/env bash
# Twenty-second run, call 4: residual_norm under a 32-register cap (eight blocks an SM instead of
# six) against no cap (CMF_DIT_RN_REGS=0), k_norm_rope with 6 / 8 blocks an SM required
# (CMF_DIT_KR_MINB) against the default; ncu per kernel, steps alternating, the row kernels'
# parity tests, gpu_dit, the lib (prebuilt images match), and the bf16 PNG's md5. Logs: $OUT/c4.tgz.
cd "$(dirname "$0")/../../.."
for f in .dev/bin/*.xz .dev/tests/*.xz .anchor/tok/*.xz; do [ -f "$f" ] && xz -d -f $f; done; chmod +x .dev/bin/* .dev/tests/*
export CMF_FIXTURES=$PWD/fixtures
L=/tmp/L4; mkdir -p $L; B=.dev/bin; T=.dev/tests; T0=$SECONDS
trap 'tar -C /tmp -czf $OUT/c4.tgz L4' EXIT
(nproc; nvidia-smi --query-gpu=name,power.limit,driver_version,clocks.max.sm,temperature.gpu --format=csv) > $L/machine.txt 2>&1
( XDG_CACHE_HOME=/tmp/xs nice -n 19 $B/cmf synth --preset z-image-turbo --quant q8_2f --tokenizer .anchor/tok/tokenizer.json -o /dev/shm/zt.cmf > $L/synth.log 2>&1 ) &
SYN=$!
export XDG_CACHE_HOME=/tmp/xdg-t
timeout 120 $T/cuda-test dit_ --nocapture > $L/cuda-dit.log 2>&1; echo "cuda dit_ rc=$? $(grep -h '^test result' $L/cuda-dit.log)" >> $L/rc.txt
timeout 120 $T/gpu_dit-test --nocapture > $L/gpu_dit.log 2>&1; echo "gpu_dit rc=$? $(grep -h '^test result' $L/gpu_dit.log)" >> $L/rc.txt
timeout 100 $T/cmf_gpu-lib > $L/lib.log 2>&1; echo "lib rc=$? $(grep -h '^test result' $L/lib.log)" >> $L/rc.txt
echo "tests $((SECONDS-T0)) s" >> $L/times.txt
NCU=$(which ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
M=gpu__time_duration.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,dram__bytes_read.sum
nc() { local tag=$1; shift; XDG_CACHE_HOME=/tmp/xdg-n timeout 100 $NCU --metrics $M -k regex:"^(residual_norm|k_norm_rope)\$" --launch-skip 30 --launch-count 6 env "$@" $B/cmf-dit-bench --res 1024 --steps 2 --cap 30 > $L/ncu-$tag.log 2>&1; }
nc bf16 CMF_DIT_FP8=0; nc bf16-rn0 CMF_DIT_FP8=0 CMF_DIT_RN_REGS=0; nc int8 CMF_DIT_FP8=int8; nc int8-rn0 CMF_DIT_FP8=int8 CMF_DIT_RN_REGS=0
nc fast CMF_DIT_FP8=fast; nc bf16-kr6 CMF_DIT_FP8=0 CMF_DIT_KR_MINB=6; nc bf16-kr8 CMF_DIT_FP8=0 CMF_DIT_KR_MINB=8
echo "ncu $((SECONDS-T0)) s" >> $L/times.txt
bench() { local tag=$1; shift; env XDG_CACHE_HOME=/tmp/xdg-b "$@" $B/cmf-dit-bench --res 1024 --steps 20 --cap 30 >> $L/b-$tag.log 2>&1; }
for i in 1 2; do
  bench bf16 CMF_DIT_FP8=0; bench bf16-rn0 CMF_DIT_FP8=0 CMF_DIT_RN_REGS=0; bench int8 CMF_DIT_FP8=int8; bench int8-rn0 CMF_DIT_FP8=int8 CMF_DIT_RN_REGS=0
  bench fast CMF_DIT_FP8=fast; bench fast-rn0 CMF_DIT_FP8=fast CMF_DIT_RN_REGS=0; bench bf16-kr6 CMF_DIT_FP8=0 CMF_DIT_KR_MINB=6
done
echo "bench $((SECONDS-T0)) s" >> $L/times.txt
wait $SYN
P="A red fox standing in a snowy birch forest at dawn, soft light, highly detailed photograph"
for p in bf16 int8; do XDG_CACHE_HOME=/tmp/xdg-i-$p $B/cmf imagine /dev/shm/zt.cmf --prompt "$P" --gpu cuda --width 1024 --height 1024 --repeat 3 --dit-precision $p -o /tmp/$p-1024.png > $L/img-$p.log 2>&1; done
md5sum /tmp/*.png > $L/md5.txt
echo "images $((SECONDS-T0)) s" >> $L/times.txt
cat $L/machine.txt $L/times.txt $L/rc.txt
for f in $L/ncu-*.log; do awk -v t=$(basename $f .log) '/^  (residual_norm|k_norm_rope) \(/{k=$1} /gpu__time_duration/{d[k]+=$NF; n[k]++} /registers_per_thread/{r[k]=$NF} /warps_active/{w[k]+=$NF} END{for (k in d) printf "%s %s: %.2f us mean of %d, %s regs, warps active %.1f %%\n", t, k, d[k]/n[k], n[k], r[k], w[k]/n[k]}' $f; done
for f in $L/b-*.log; do echo "$(basename $f .log): $(grep -h '²' $f | awk -F'|' '{printf "%s ms, ", $5}')"; done
grep -h '^runs' $L/img-*.log; cat $L/md5.txt
