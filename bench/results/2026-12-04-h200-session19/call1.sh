#!/usr/bin/env bash
# Nineteenth run, call 1: the review mends on the H200 (every device suite), the int8 arm of
# cmf-fp8-probe, cmf-gemm-tune, steps and images of the full-size random pack (md5s against
# session 14's: bf16 c3cbb98…, fp8-fast e3b0e02…).
cd "$(dirname "$0")/../../.."
for f in .dev/bin/*.xz .dev/tests/*.xz .anchor/tok/*.xz; do [ -f "$f" ] && xz -d -f $f; done; chmod +x .dev/bin/* .dev/tests/*
export CMF_FIXTURES=$PWD/fixtures
W=/tmp/c1; mkdir -p $W/logs; L=$W/logs; B=.dev/bin; T=.dev/tests
(lscpu | head -20; nproc; nvidia-smi --query-gpu=name,power.limit,driver_version,clocks.max.sm --format=csv) > $L/machine.txt 2>&1
( XDG_CACHE_HOME=/tmp/xs nice -n 19 $B/cmf synth --preset z-image-turbo --quant q8_2f --tokenizer .anchor/tok/tokenizer.json -o /dev/shm/zt.cmf > $L/synth.log 2>&1 ) &
SYN=$!
XDG_CACHE_HOME=/tmp/xdg-p timeout 240 $B/cmf-fp8-probe --tokens 4128 --reps 20 > $L/probe.log 2>&1; echo "probe rc=$?" >> $L/rc.txt
wait $SYN
P="A red fox standing in a snowy birch forest at dawn, soft light, highly detailed photograph"
img() { local tag=$1; shift; local t0=$(date +%s.%N); XDG_CACHE_HOME=/tmp/xdg-$tag CMF_LOG=debug $B/cmf imagine /dev/shm/zt.cmf --prompt "$P" --gpu cuda -o $W/$tag.png --width 1024 --height 1024 "$@" > $L/img-$tag.log 2>&1; echo "wall $(awk "BEGIN{print $(date +%s.%N) - $t0}") s" >> $L/img-$tag.log; }
img first
img bf16-2
img fp8 --dit-precision fp8-fast
img warm --repeat 3
img warm-fp8 --repeat 3 --dit-precision fp8-fast
md5sum $W/*.png > $L/md5.txt
export XDG_CACHE_HOME=/tmp/xdg-b
for v in 0 fast 0; do CMF_DIT_FP8=$v $B/cmf-dit-bench --res 1024 --steps 20 --cap 30 >> $L/b-$v.log 2>&1; done
export XDG_CACHE_HOME=/tmp/xdg-t
for t in cuda gpu_dit gpu_vae gpu_parity parity_pipeline device_fallback; do timeout 240 $T/$t-test > $L/$t.log 2>&1; echo "$t rc=$? $(grep -h '^test result' $L/$t.log | tr '\n' ' ')" >> $L/rc.txt; done
timeout 100 $T/cmf_gpu-lib > $L/lib.log 2>&1; echo "lib rc=$? $(grep -h '^test result' $L/lib.log)" >> $L/rc.txt
XDG_CACHE_HOME=/tmp/xdg-g timeout 120 $B/cmf-gemm-tune --tokens 4128 > $L/gemm-tune.log 2>&1; echo "gemm-tune rc=$?" >> $L/rc.txt
tar czf $OUT/c1.tgz -C $W logs
cat $L/rc.txt; cat $L/probe.log; for f in $L/img-*.log; do echo "== $(basename $f) $(grep -h '^timing' $f | grep -o 'steps [0-9.]* s (median [0-9.]* s/step)\|run [0-9.]* s, process [0-9.]* s, peak RSS [0-9.]* GiB' | tr '\n' ' ') $(grep -h '^runs' $f | grep -o 'cold [0-9.]* s\|warm [0-9.]* s' | tr '\n' ' ') $(grep -h '^wall' $f)"; done; cat $L/md5.txt; grep -h '1024²' $L/b-*.log; grep -h "FAILED\|panicked" $L/*.log | head
