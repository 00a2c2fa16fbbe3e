#!/usr/bin/env bash
# Twenty-second run, call 1: each DiT weight resident once (an 8-bit plane replaces the bf16 one
# it is made from). Device suites (gpu_dit with the new eight_bit_planes_replace_the_bf16_ones,
# device_fallback, parity_pipeline, gpu_vae, gpu_parity, cmf_gpu lib, cuda), steps at 1024² in
# each precision with the resident bytes cmf-dit-bench reports, images warm and cold with their
# md5s (the 8-bit planes' bytes are the same, so the PNGs must not change). Logs: $OUT/c1.tgz.
cd "$(dirname "$0")/../../.."
for f in .dev/bin/*.xz .dev/tests/*.xz .anchor/tok/*.xz; do [ -f "$f" ] && xz -d -f $f; done; chmod +x .dev/bin/* .dev/tests/*
export CMF_FIXTURES=$PWD/fixtures
L=/tmp/L; mkdir -p $L; B=.dev/bin; T=.dev/tests; T0=$SECONDS
pack() { tar -C /tmp -czf $OUT/c1.tgz L; }
trap pack EXIT
(nproc; nvidia-smi --query-gpu=name,power.limit,driver_version,clocks.max.sm,temperature.gpu --format=csv) > $L/machine.txt 2>&1
( XDG_CACHE_HOME=/tmp/xs nice -n 19 $B/cmf synth --preset z-image-turbo --quant q8_2f --tokenizer .anchor/tok/tokenizer.json -o /dev/shm/zt.cmf > $L/synth.log 2>&1; echo "synth done $((SECONDS-T0)) s" >> $L/times.txt ) &
SYN=$!
export XDG_CACHE_HOME=/tmp/xdg-t
for t in gpu_dit device_fallback parity_pipeline gpu_vae gpu_parity; do timeout 200 $T/$t-test --nocapture > $L/$t.log 2>&1; echo "$t rc=$? $(grep -h '^test result' $L/$t.log | tr '\n' ' ')" >> $L/rc.txt; done
timeout 100 $T/cmf_gpu-lib > $L/lib.log 2>&1; echo "lib rc=$? $(grep -h '^test result' $L/lib.log)" >> $L/rc.txt
echo "tests done $((SECONDS-T0)) s" >> $L/times.txt
wait $SYN
export XDG_CACHE_HOME=/tmp/xdg-b
for v in 0 int8 fast 0; do CMF_DIT_FP8=$v $B/cmf-dit-bench --res 1024 --steps 20 --cap 30 >> $L/b-1024-$v.log 2>&1; done
echo "bench done $((SECONDS-T0)) s" >> $L/times.txt
P="A red fox standing in a snowy birch forest at dawn, soft light, highly detailed photograph"
for p in bf16 int8 fp8-fast; do
  t0=$(date +%s.%N); XDG_CACHE_HOME=/tmp/xdg-i-$p CMF_LOG=debug $B/cmf imagine /dev/shm/zt.cmf --prompt "$P" --gpu cuda --width 1024 --height 1024 --repeat 4 --dit-precision $p -o /tmp/$p-1024.png > $L/img-$p.log 2>&1
  echo "wall $(awk "BEGIN{print $(date +%s.%N) - $t0}") s" >> $L/img-$p.log
done
md5sum /tmp/*.png > $L/md5.txt
echo "images done $((SECONDS-T0)) s" >> $L/times.txt
left=$((560 - (SECONDS-T0))); [ $left -gt 30 ] && { timeout $left $T/cuda-test --nocapture > $L/cuda.log 2>&1; echo "cuda rc=$? $(grep -h '^test result' $L/cuda.log)" >> $L/rc.txt; }
echo "cuda done $((SECONDS-T0)) s" >> $L/times.txt
nvidia-smi --query-gpu=temperature.gpu,power.draw --format=csv >> $L/machine.txt 2>&1
cat $L/machine.txt $L/times.txt $L/rc.txt; grep -h 'eight_bit\|CMF_DIT_FP8=.*weights' $L/gpu_dit.log | head; grep -h '²\|resident' $L/b-*.log
for f in $L/img-*.log; do echo "== $(basename $f) $(grep -h 'dit: resident' $f | head -1) $(grep -h '^runs' $f) $(grep -h '^wall' $f)"; done
cat $L/md5.txt
