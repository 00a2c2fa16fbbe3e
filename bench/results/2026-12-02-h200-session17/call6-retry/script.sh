#!/usr/bin/env bash
cd "$(dirname "$0")/.."
for f in .dev/bin/*.xz .dev/tests/*.xz; do xz -d -f $f; done; chmod +x .dev/bin/* .dev/tests/*
export CMF_FIXTURES=$PWD/fixtures
W=/tmp/c6; mkdir -p $W/logs $W/png; L=$W/logs; B=.dev/bin; T=.dev/tests
XDG_CACHE_HOME=/tmp/xs $B/cmf synth --preset z-image-turbo --quant q8_2f --tokenizer .anchor/tok/tokenizer.json -o /dev/shm/zt.cmf > $L/synth.log 2>&1
P="A red fox standing in a snowy birch forest at dawn, soft light, highly detailed photograph"
img() { local tag=$1; shift; local t0=$(date +%s.%N); XDG_CACHE_HOME=/tmp/xdg-$tag CMF_LOG=debug $B/cmf imagine /dev/shm/zt.cmf --prompt "$P" --gpu cuda -o $W/png/$tag.png "$@" > $L/img-$tag.log 2>&1; echo "wall $(awk "BEGIN{print $(date +%s.%N) - $t0}") s" >> $L/img-$tag.log; }
img first-prebuilt --width 1024 --height 1024
CMF_PREBUILT_KERNELS=0 img nvrtc-first --width 1024 --height 1024
img prebuilt-2 --width 1024 --height 1024
md5sum $W/png/*.png > $L/md5.txt
export XDG_CACHE_HOME=/tmp/xdg-t
for i in 1 2 3 4 5 6; do timeout 120 $T/gpu_parity-test > $L/gpu_parity-$i.log 2>&1; echo "gpu_parity $i rc=$?" >> $L/rc.txt; done
timeout 200 $T/cuda-test capture staged whole_model hybrid chunked fp8 > $L/cuda.log 2>&1; echo "cuda rc=$?" >> $L/rc.txt
timeout 200 $T/gpu_dit-test > $L/gpu_dit.log 2>&1; echo "gpu_dit rc=$?" >> $L/rc.txt
timeout 100 $T/parity_pipeline-test > $L/parity_pipeline.log 2>&1; echo "parity_pipeline rc=$?" >> $L/rc.txt
timeout 100 $T/device_fallback-test > $L/device_fallback.log 2>&1; echo "device_fallback rc=$?" >> $L/rc.txt
tar czf $OUT/c6.tgz -C $W logs
cat $L/rc.txt; grep -h "^wall\|^timing" $L/img-*.log; cat $L/md5.txt; grep -h "test result" $L/*.log
