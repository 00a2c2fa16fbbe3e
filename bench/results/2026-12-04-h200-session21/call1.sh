#!/usr/bin/env bash
# Twenty-first run, call 1: the committed code (4472b3f) beside diffusers 0.42.1 (eager and
# torch.compile) on one machine in one call. Steps at 512²/1024² in bf16 (three runs), int8 and
# fp8-fast (cmf-dit-bench), images warm and cold in each precision (cmf imagine --repeat 4),
# then ../shared/bench/zimage_diffusers.py eager and with --compile on the same geometry.
cd "$(dirname "$0")/../../.."
for f in .dev/bin/*.xz .dev/tests/*.xz .anchor/tok/*.xz; do [ -f "$f" ] && xz -d -f $f; done; chmod +x .dev/bin/* .dev/tests/*
L=$OUT/logs; mkdir -p $L; B=.dev/bin; T0=$SECONDS
(nproc; nvidia-smi --query-gpu=name,power.limit,driver_version,clocks.max.sm,temperature.gpu --format=csv) > $L/machine.txt 2>&1
XDG_CACHE_HOME=/tmp/xs $B/cmf synth --preset z-image-turbo --quant q8_2f --tokenizer .anchor/tok/tokenizer.json -o /dev/shm/zt.cmf > $L/synth.log 2>&1
echo "synth done $((SECONDS-T0)) s" >> $L/times.txt
export XDG_CACHE_HOME=/tmp/xdg-b
for r in 1024 512; do for v in 0 int8 fast; do CMF_DIT_FP8=$v $B/cmf-dit-bench --res $r --steps 20 --cap 30 > $L/b-$r-$v.log 2>&1; done; done
for i in 2 3; do CMF_DIT_FP8=0 $B/cmf-dit-bench --res 1024 --steps 20 --cap 30 >> $L/b-1024-0.log 2>&1; done
echo "bench done $((SECONDS-T0)) s" >> $L/times.txt
P="A red fox standing in a snowy birch forest at dawn, soft light, highly detailed photograph"
for s in 1024 512; do for p in bf16 int8 fp8-fast; do
  t0=$(date +%s.%N); XDG_CACHE_HOME=/tmp/xdg-i-$s-$p CMF_LOG=debug $B/cmf imagine /dev/shm/zt.cmf --prompt "$P" --gpu cuda --width $s --height $s --repeat 4 --dit-precision $p -o /tmp/$p-$s.png > $L/img-$p-$s.log 2>&1
  echo "wall $(awk "BEGIN{print $(date +%s.%N) - $t0}") s" >> $L/img-$p-$s.log
done; done
md5sum /tmp/*.png > $L/md5.txt
echo "images done $((SECONDS-T0)) s" >> $L/times.txt
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .anchor/whl/*.whl > $L/pip.log 2>&1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
timeout 200 python3 .anchor/zimage_diffusers.py .anchor/tok --sizes 512,1024 > $L/diffusers-eager.log 2>&1
echo "eager done $((SECONDS-T0)) s" >> $L/times.txt
left=$((570 - (SECONDS-T0))); [ $left -gt 60 ] && timeout $left python3 .anchor/zimage_diffusers.py .anchor/tok --sizes 1024,512 --compile > $L/diffusers-compile.log 2>&1
echo "compile done $((SECONDS-T0)) s" >> $L/times.txt
nvidia-smi --query-gpu=temperature.gpu,power.draw --format=csv >> $L/machine.txt 2>&1
cat $L/machine.txt $L/times.txt; grep -H '²' $L/b-*.log
for f in $L/img-*.log; do echo "== $(basename $f) $(grep -h '^timing' $f | head -3 | tr '\n' ' ') $(grep -h '^runs' $f) $(grep -h '^wall' $f)"; done
cat $L/md5.txt; grep -h '^{' $L/diffusers-*.log; tail -3 $L/diffusers-*.log
