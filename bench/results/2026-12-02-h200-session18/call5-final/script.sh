#!/usr/bin/env bash
cd "$(dirname "$0")/.."
for f in .dev/bin/*.xz .dev/tests/*.xz; do xz -d -f $f; done; chmod +x .dev/bin/* .dev/tests/*
export CMF_FIXTURES=$PWD/fixtures
W=/tmp/c5; mkdir -p $W/logs; L=$W/logs; B=.dev/bin; T=.dev/tests
(lscpu | head -20; nproc; nvidia-smi --query-gpu=name,power.limit,driver_version --format=csv) > $L/machine.txt 2>&1
XDG_CACHE_HOME=/tmp/xs $B/cmf synth --preset z-image-turbo --quant q8_2f --tokenizer .anchor/tok/tokenizer.json -o /dev/shm/zt.cmf > $L/synth.log 2>&1
P="A red fox standing in a snowy birch forest at dawn, soft light, highly detailed photograph"
img() { local tag=$1; shift; local t0=$(date +%s.%N); XDG_CACHE_HOME=/tmp/xdg-$tag CMF_LOG=debug $B/cmf imagine /dev/shm/zt.cmf --prompt "$P" --gpu cuda -o $W/$tag.png --width 1024 --height 1024 "$@" > $L/img-$tag.log 2>&1; echo "wall $(awk "BEGIN{print $(date +%s.%N) - $t0}") s" >> $L/img-$tag.log; }
img first
for i in 1 2 3; do CMF_EXIT_FAST=0 img slow-$i; img fast-$i; done
img fp8 --dit-precision fp8-fast
CMF_EXIT_FAST=0 img fp8-slow --dit-precision fp8-fast
img warm --repeat 3
img warm-fp8 --repeat 3 --dit-precision fp8-fast
md5sum $W/*.png > $L/md5.txt
export XDG_CACHE_HOME=/tmp/xdg-b
for v in 0 fast; do CMF_DIT_FP8=$v $B/cmf-dit-bench --res 1024 --steps 20 --cap 30 > $L/b-$v.log 2>&1; done
XDG_CACHE_HOME=/tmp/xs $B/cmf synth --preset qwen3-0.6b --quant q8 -o /dev/shm/q.cmf > $L/synth-q.log 2>&1
XDG_CACHE_HOME=/tmp/xdg-llm CMF_LOG=debug $B/cmf bench /dev/shm/q.cmf --gpu cuda -r 3 > $L/bench-q.log 2>&1
export XDG_CACHE_HOME=/tmp/xdg-t
for t in cuda gpu_dit gpu_vae gpu_parity parity_pipeline device_fallback; do timeout 200 $T/$t-test > $L/$t.log 2>&1; echo "$t rc=$? $(grep -h '^test result' $L/$t.log | tr '\n' ' ')" >> $L/rc.txt; done
timeout 100 $T/cmf_gpu-lib > $L/lib.log 2>&1; echo "lib rc=$? $(grep -h '^test result' $L/lib.log)" >> $L/rc.txt
tar czf $OUT/c5.tgz -C $W logs
cat $L/rc.txt; for f in $L/img-*.log; do echo "== $(basename $f) $(grep -ho 'llm: uploaded in [0-9.]* s\|uploaded in [0-9.]* s)' $f | tr '\n' ' ') $(grep -h '^timing' $f | grep -o 'steps [0-9.]* s (median [0-9.]* s/step)\|run [0-9.]* s, process [0-9.]* s, peak RSS [0-9.]* GiB' | tr '\n' ' ') $(grep -h '^runs' $f | grep -o 'cold [0-9.]* s\|warm [0-9.]* s' | tr '\n' ' ') $(grep -h '^wall' $f)"; done; cat $L/md5.txt; grep -h 'ms/step\|step' $L/b-*.log | tail -6; grep -h 'uploaded in\|pp512 |\|tg128 |' $L/bench-q.log | tail -3
