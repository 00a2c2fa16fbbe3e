#!/usr/bin/env bash
cd "$(dirname "$0")/.."
for f in .dev/bin/*.xz .dev/tests/*.xz; do xz -d -f $f; done; chmod +x .dev/bin/* .dev/tests/*
export CMF_FIXTURES=$PWD/fixtures
W=/tmp/c9; mkdir -p $W/logs $W/png; L=$W/logs; B=.dev/bin; T=.dev/tests
XDG_CACHE_HOME=/tmp/xs $B/cmf synth --preset z-image-turbo --quant q8_2f --tokenizer .anchor/tok/tokenizer.json -o /dev/shm/zt.cmf > $L/synth.log 2>&1 &
export XDG_CACHE_HOME=/tmp/xdg-t
timeout 150 $T/cuda-test dit_fp8 > $L/cuda.log 2>&1; echo "cuda rc=$?" >> $L/rc.txt
wait
P="A red fox standing in a snowy birch forest at dawn, soft light, highly detailed photograph"
img() { local tag=$1; shift; local t0=$(date +%s.%N); XDG_CACHE_HOME=/tmp/xdg-$tag CMF_LOG=debug $B/cmf imagine /dev/shm/zt.cmf --prompt "$P" --gpu cuda -o $W/png/$tag.png "$@" > $L/img-$tag.log 2>&1; echo "wall $(awk "BEGIN{print $(date +%s.%N) - $t0}") s" >> $L/img-$tag.log; }
img fast --width 1024 --height 1024 --dit-precision fp8-fast
md5sum $W/png/*.png > $L/md5.txt
timeout 120 $T/gpu_dit-test > $L/gpu_dit.log 2>&1; echo "gpu_dit rc=$?" >> $L/rc.txt
grep -c "nvrtc: compiled" $L/img-*.log >> $L/rc.txt
tar czf $OUT/c9.tgz -C $W logs
cat $L/rc.txt $L/md5.txt; grep -h "test result" $L/*.log; grep -h "^wall\|^timing" $L/img-*.log
