#!/usr/bin/env bash
# Twentieth run, call 4: the final code (int8 sums read by swiglu and residual_norm; swiglu_r16 with
# strided groups and its register cap). Device suites touched by it, steps at
# 512²/1024² in bf16 (three runs: the machine's spread), int8 and fp8-fast, profiles, images of
# two prompts in each precision with PSNR against bf16, warm and cold runs.
cd "$(dirname "$0")/../../.."
for f in .dev/bin/*.xz .dev/tests/*.xz .anchor/tok/*.xz; do [ -f "$f" ] && xz -d -f $f; done; chmod +x .dev/bin/* .dev/tests/*
export CMF_FIXTURES=$PWD/fixtures
W=/tmp/c4; mkdir -p $W/logs; L=$W/logs; B=.dev/bin; T=.dev/tests
(nproc; nvidia-smi --query-gpu=name,power.limit,driver_version,clocks.max.sm,temperature.gpu --format=csv) > $L/machine.txt 2>&1
( XDG_CACHE_HOME=/tmp/xs nice -n 19 $B/cmf synth --preset z-image-turbo --quant q8_2f --tokenizer .anchor/tok/tokenizer.json -o /dev/shm/zt.cmf > $L/synth.log 2>&1 ) &
SYN=$!
export XDG_CACHE_HOME=/tmp/xdg-t
for t in cuda gpu_dit gpu_vae gpu_parity; do timeout 240 $T/$t-test --nocapture > $L/$t.log 2>&1; echo "$t rc=$? $(grep -h '^test result' $L/$t.log | tr '\n' ' ')" >> $L/rc.txt; done
wait $SYN
export XDG_CACHE_HOME=/tmp/xdg-b
for r in 1024 512; do for v in 0 int8 fast; do CMF_DIT_FP8=$v $B/cmf-dit-bench --res $r --steps 20 --cap 30 > $L/b-$r-$v.log 2>&1; done; done
for i in 2 3; do CMF_DIT_FP8=0 $B/cmf-dit-bench --res 1024 --steps 20 --cap 30 >> $L/b-1024-0.log 2>&1; done
CMF_DIT_FP8=int8 $B/cmf-dit-bench --res 1024 --steps 20 --cap 30 >> $L/b-1024-int8.log 2>&1
CMF_DIT_PROFILE=1 CMF_DIT_FP8=int8 $B/cmf-dit-bench --res 1024 --steps 10 --cap 30 > $L/prof-int8.log 2>&1
CMF_DIT_PROFILE=1 CMF_DIT_FP8=0 $B/cmf-dit-bench --res 1024 --steps 10 --cap 30 > $L/prof-bf16.log 2>&1
for i in 1 2; do CMF_DIT_FP8=int8 CMF_DIT_INT8_SUMS=0 $B/cmf-dit-bench --res 1024 --steps 20 --cap 30 >> $L/b-1024-int8-nosums.log 2>&1; done
P1="A red fox standing in a snowy birch forest at dawn, soft light, highly detailed photograph"
P2="An old lighthouse on a rocky coast under a stormy sky, waves crashing, oil painting"
# img TAG SIZE PROMPT [imagine args]
img() { local tag=$1 s=$2 p=$3; shift 3; local t0=$(date +%s.%N); XDG_CACHE_HOME=/tmp/xdg-i CMF_LOG=debug $B/cmf imagine /dev/shm/zt.cmf --prompt "$p" --gpu cuda -o $W/$tag.png --width $s --height $s "$@" > $L/img-$tag.log 2>&1; echo "wall $(awk "BEGIN{print $(date +%s.%N) - $t0}") s" >> $L/img-$tag.log; }
img cold-int8 1024 "$P1" --dit-precision int8
for pr in 1 2; do eval p=\$P$pr; img bf16-p$pr 1024 "$p"; img int8-p$pr 1024 "$p" --dit-precision int8; img fp8f-p$pr 1024 "$p" --dit-precision fp8-fast; done
img int8-512 512 "$P1" --dit-precision int8; img bf16-512 512 "$P1"
img warm-int8 1024 "$P1" --repeat 3 --dit-precision int8
img warm-bf16 1024 "$P1" --repeat 3
md5sum $W/*.png > $L/md5.txt
for pr in p1 p2; do for m in int8 fp8f; do echo "$m-$pr vs bf16-$pr: $(python3 bench/psnr.py $W/$m-$pr.png $W/bf16-$pr.png)" >> $L/psnr.txt; done; done
echo "int8-512 vs bf16-512: $(python3 bench/psnr.py $W/int8-512.png $W/bf16-512.png)" >> $L/psnr.txt
for t in device_fallback parity_pipeline; do timeout 200 $T/$t-test > $L/$t.log 2>&1; echo "$t rc=$? $(grep -h '^test result' $L/$t.log | tr '\n' ' ')" >> $L/rc.txt; done
timeout 100 $T/cmf_gpu-lib > $L/lib.log 2>&1; echo "lib rc=$? $(grep -h '^test result' $L/lib.log)" >> $L/rc.txt
nvidia-smi --query-gpu=temperature.gpu,power.draw --format=csv >> $L/machine.txt 2>&1
cp $W/int8-p1.png $W/bf16-p1.png $OUT/ 2>/dev/null
tar czf $OUT/c4.tgz -C $W logs
cat $L/machine.txt $L/rc.txt $L/psnr.txt; for f in $L/img-*.log; do echo "== $(basename $f) $(grep -h '^devices' $f) $(grep -h '^timing' $f | grep -o 'steps [0-9.]* s (median [0-9.]* s/step)\|run [0-9.]* s' | tr '\n' ' ') $(grep -h '^runs' $f | grep -o 'cold [0-9.]* s\|warm [0-9.]* s' | tr '\n' ' ') $(grep -h '^wall' $f)"; done; cat $L/md5.txt; grep -H '²' $L/b-*.log; grep -h 'ms\b' $L/prof-*.log | tail -6; grep -h "FAILED\|panicked\|int8 GEMM\|S8: worst\|int8:" $L/*.log | head -30
