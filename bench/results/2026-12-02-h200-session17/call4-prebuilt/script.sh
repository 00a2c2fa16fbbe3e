#!/usr/bin/env bash
cd "$(dirname "$0")/.."
for f in .dev/bin/*.xz .dev/tests/*.xz; do xz -d -f $f; done; chmod +x .dev/bin/* .dev/tests/*
export CMF_FIXTURES=$PWD/fixtures
W=/tmp/c4; mkdir -p $W/logs; L=$W/logs; B=.dev/bin; T=.dev/tests
nvidia-smi --query-gpu=name,power.limit,driver_version --format=csv > $L/smi.txt
XDG_CACHE_HOME=/tmp/xs $B/cmf synth --preset z-image-turbo --quant q8_2f --tokenizer .anchor/tok/tokenizer.json -o /dev/shm/zt.cmf > $L/synth.log 2>&1
P="A red fox standing in a snowy birch forest at dawn, soft light, highly detailed photograph"
img() { local tag=$1; shift; local t0=$(date +%s.%N); XDG_CACHE_HOME=/tmp/xdg-$tag CMF_LOG=debug $B/cmf imagine /dev/shm/zt.cmf --prompt "$P" --gpu cuda -o $W/$tag.png "$@" > $L/img-$tag.log 2>&1; echo "wall $(awk "BEGIN{print $(date +%s.%N) - $t0}") s" >> $L/img-$tag.log; }
img first-prebuilt --width 1024 --height 1024
CMF_PREBUILT_KERNELS=0 img nvrtc-first --width 1024 --height 1024
img prebuilt-2 --width 1024 --height 1024
CMF_PREBUILT_KERNELS=0 img nvrtc-2 --width 1024 --height 1024
img prebuilt-3 --width 1024 --height 1024
img fast-prebuilt --width 1024 --height 1024 --dit-precision fp8-fast
img warm --width 1024 --height 1024 --repeat 2
img warm-fast --width 1024 --height 1024 --repeat 2 --dit-precision fp8-fast
XDG_CACHE_HOME=/tmp/xs $B/cmf synth --preset qwen3-0.6b --quant q8 -o /dev/shm/q.cmf > $L/synth-q.log 2>&1
XDG_CACHE_HOME=/tmp/xdg-llm CMF_LOG=debug $B/cmf bench /dev/shm/q.cmf --gpu cuda -r 2 > $L/bench-q.log 2>&1
export XDG_CACHE_HOME=/tmp/xdg-b
for v in 0 fast; do CMF_DIT_FP8=$v $B/cmf-dit-bench --res 1024 --steps 20 --cap 30 > $L/b-$v.log 2>&1; done
md5sum $W/*.png > $L/md5.txt
export XDG_CACHE_HOME=/tmp/xdg-t
for t in cuda gpu_dit gpu_vae gpu_parity parity_pipeline device_fallback; do timeout 200 $T/$t-test > $L/$t.log 2>&1; echo "$t rc=$?" >> $L/rc.txt; done
timeout 100 $T/cmf_gpu-lib > $L/lib.log 2>&1; echo "lib rc=$?" >> $L/rc.txt
tar czf $OUT/c4.tgz -C $W .
cat $L/rc.txt; grep -h "^wall\|^timing" $L/img-*.log; cat $L/md5.txt
