#!/usr/bin/env bash
cd "$(dirname "$0")/.."
for f in .dev/bin/*.xz; do xz -d -f $f; done; chmod +x .dev/bin/*
export XDG_CACHE_HOME=/tmp/xdg CMF_FIXTURES=$PWD/fixtures
W=/tmp/c3; mkdir -p $W/logs; L=$W/logs; B=.dev/bin
nvidia-smi --query-gpu=name,power.limit,driver_version --format=csv > $L/smi.txt
{ /usr/bin/time -v $B/cmf synth --preset z-image-turbo --quant q8_2f --tokenizer .anchor/tok/tokenizer.json -o /dev/shm/zt.cmf; } > $L/synth.log 2>&1
export CMF_KERNEL_JOBS_LOG=$W/jobs.log
P="A red fox standing in a snowy birch forest at dawn, soft light, highly detailed photograph"
img() { local tag=$1; shift; { /usr/bin/time -f "wall %e s" env CMF_LOG=debug $B/cmf imagine /dev/shm/zt.cmf --prompt "$P" --gpu cuda -o $W/$tag.png "$@"; } > $L/img-$tag.log 2>&1; }
# the first GPU process on this machine: NVRTC compiles every module (the baseline)
img first-bf16 --width 1024 --height 1024
img fast --width 1024 --height 1024 --dit-precision fp8-fast
img s512 --width 512 --height 512
img s512-fast --width 512 --height 512 --dit-precision fp8-fast
img warm-bf16 --width 1024 --height 1024 --repeat 2
for m in smollm2-135m:q4 qwen3-0.6b:q8 qwen3-0.6b:bf16 qwen3-8b:q8 llama3-8b:q8; do
  p=${m%%:*}; q=${m##*:}
  $B/cmf synth --preset $p --quant $q -o /dev/shm/llm.cmf > $L/synth-$p-$q.log 2>&1
  CMF_LOG=debug $B/cmf bench /dev/shm/llm.cmf --gpu cuda -r 2 > $L/bench-$p-$q.log 2>&1
  rm -f /dev/shm/llm.cmf
done
unset CMF_KERNEL_JOBS_LOG
cp $W/jobs.log $L/jobs.log
$B/cmf-prebuild-kernels --dir crates/cmf-gpu/cubins --add-jobs $W/jobs.log > $L/prebuild.log 2>&1
cp -r crates/cmf-gpu/cubins $W/
rm -rf /tmp/xdg2; XDG_CACHE_HOME=/tmp/xdg2 img second-empty --width 1024 --height 1024
md5sum $W/*.png > $L/md5.txt
tar czf $OUT/c3.tgz -C $W .
grep -h "wall\|total" $L/img-*.log | head -20; cat $L/prebuild.log | tail -3
