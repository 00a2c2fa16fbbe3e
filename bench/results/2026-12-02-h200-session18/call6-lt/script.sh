#!/usr/bin/env bash
cd "$(dirname "$0")/.."
for f in .dev/bin/*.xz .dev/tests/*.xz; do xz -d -f $f; done; chmod +x .dev/bin/* .dev/tests/*
export CMF_FIXTURES=$PWD/fixtures
W=/tmp/c6; mkdir -p $W/logs; L=$W/logs; B=.dev/bin; T=.dev/tests
(lscpu | head -20; nproc) > $L/machine.txt 2>&1
XDG_CACHE_HOME=/tmp/xs $B/cmf synth --preset z-image-turbo --quant q8_2f --tokenizer .anchor/tok/tokenizer.json -o /dev/shm/zt.cmf > $L/synth.log 2>&1
P="A red fox standing in a snowy birch forest at dawn, soft light, highly detailed photograph"
img() { local tag=$1; shift; local t0=$(date +%s.%N); XDG_CACHE_HOME=/tmp/xdg-$tag CMF_LOG=debug $B/cmf imagine /dev/shm/zt.cmf --prompt "$P" --gpu cuda -o $W/$tag.png --width 1024 --height 1024 "$@" > $L/img-$tag.log 2>&1; echo "wall $(awk "BEGIN{print $(date +%s.%N) - $t0}") s" >> $L/img-$tag.log; }
img first
img bf16-2
img fp8-1 --dit-precision fp8-fast
img bf16-3
img fp8-2 --dit-precision fp8-fast
md5sum $W/*.png > $L/md5.txt
export XDG_CACHE_HOME=/tmp/xdg-t
timeout 100 $T/cuda-test fp8 > $L/cuda-fp8.log 2>&1; echo "cuda fp8 rc=$? $(grep -h '^test result' $L/cuda-fp8.log)" >> $L/rc.txt
timeout 100 $T/gpu_dit-test > $L/gpu_dit.log 2>&1; echo "gpu_dit rc=$? $(grep -h '^test result' $L/gpu_dit.log)" >> $L/rc.txt
tar czf $OUT/c6.tgz -C $W logs
cat $L/rc.txt; for f in $L/img-*.log; do echo "== $(basename $f) $(grep -ho 'llm: uploaded in [0-9.]* s\|uploaded in [0-9.]* s)' $f | tr '\n' ' ') $(grep -h '^timing' $f | grep -o 'median [0-9.]* s/step\|run [0-9.]* s, process [0-9.]* s, peak RSS [0-9.]* GiB' | tr '\n' ' ') $(grep -h '^wall' $f)"; done; cat $L/md5.txt
