#!/usr/bin/env bash
# One H200 session for issue 5 (Z-Image on the device): the GPU parity tests, the DiT step
# benchmark at the real geometry (cmf-dit-bench), `cmf imagine --gpu cuda` end to end on a
# full-size random-weight pack made there (`cmf synth --preset z-image-turbo`), and diffusers
# (../shared/bench/zimage_diffusers.py) on the same card in the same session.
# Runs on the GPU machine from the repository root, with (built here, stripped, xz-compressed):
#   .dev/bin/{cmf,cmf-dit-bench}.xz, .dev/tests/{gpu_dit,gpu_vae,cuda,gpu_parity}-test.xz, cmf_gpu-lib.xz
#   .anchor/: zimage_diffusers.py, tok/ (Qwen3 tokenizer.json + tokenizer_config.json),
#             whl/ (diffusers 0.42.1, importlib_metadata, zipp wheels)
# Logs go to $OUT. Env: PARTS (default "tests bench e2e anchor"; also "vaebench", "fp8probe", "llm": the
# LLM table of bench/gpu_llm.sh while the pack is made), SIZES (default "512 1024"),
# ATTN (attention variants to time, default "base k w8"; "ws" is the Hopper default, "wg" the one before), FP8 (`--dit-precision` values to time and
# to render end to end against the bf16 image, e.g. "fp8 fp8-fast"; default none; both include the
# FP8 attention from 1024 keys, CMF_DIT_ATTN8=0 in the environment keeps the bf16 one).
set -u
cd "$(dirname "$0")/.."
export CMF_FIXTURES=$PWD/fixtures XDG_CACHE_HOME=/tmp/xdg
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for f in .dev/bin/*.xz .dev/tests/*.xz; do [ -f "$f" ] && xz -d -f "$f"; done
chmod +x .dev/bin/* .dev/tests/* 2>/dev/null
T0=$SECONDS
stamp() { echo "[$((SECONDS-T0)) s] $*"; }
has() { case " ${PARTS:-tests bench e2e anchor} " in *" $1 "*) return 0;; *) return 1;; esac; }
SIZES=${SIZES:-512 1024}
C=./.dev/bin/cmf
# The pack goes to RAM when /dev/shm has room (the machine's disk writes slowly: ~300 s for 10 GB).
PACK=/tmp/zimage-turbo-random-q8_2f.cmf
[ "$(df -BG --output=avail /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)" -gt 20 ] 2>/dev/null && PACK=/dev/shm/zimage-turbo-random-q8_2f.cmf
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if has e2e && [ ! -f $PACK ]; then
  ( nice -n 19 $C synth --preset z-image-turbo --quant q8_2f -o $PACK > $OUT/synth.log 2>&1; echo "synth rc=$?" >> $OUT/synth.log ) &
  SYNTH=$!
fi
if has vaebench; then
  # The VAE with cuDNN's convs (the default where libcudnn loads) and with im2col + cuBLAS.
  for conv in cudnn im2col; do
    echo "== CMF_VAE_CONV=$conv" | tee -a $OUT/vae-bench.log
    CMF_VAE_CONV=$conv CMF_VAE_BENCH=1 ./.dev/tests/gpu_vae-test bench_flux_geometry --nocapture 2>&1 | grep -vE "^$|running|^test result" | tee -a $OUT/vae-bench.log | tail -3
  done
fi
if has fp8probe; then
  # FP8 groundwork (branch next-fp8): cuBLASLt e4m3 GEMMs at the DiT's shapes against cuBLAS bf16.
  [ -x .dev/bin/cmf-fp8-probe ] && ./.dev/bin/cmf-fp8-probe --tokens 4128,1056 2>&1 | tee $OUT/fp8-probe.log
fi
if has tests; then
  stamp tests
  for t in gpu_dit-test gpu_vae-test cmf_gpu-lib cuda-test gpu_parity-test; do
    [ -x .dev/tests/$t ] || continue
    ./.dev/tests/$t --nocapture --test-threads 1 > $OUT/$t.log 2>&1; echo "$t rc=$?"
    grep -E "^test result|FAILED|panicked|skipped|rel err|values off" $OUT/$t.log | head -14
  done
fi
if has llm; then
  # Issue 4's LLM table on the same card while the pack is being made (bench/gpu_llm.sh), and a
  # per-stage profile at a short context.
  stamp "llm bench"
  CMF_GPU_BENCH=./.dev/bin/cmf-gpu-bench bash bench/gpu_llm.sh > $OUT/gpu_llm.log 2>&1
  ./.dev/bin/cmf-gpu-bench --preset qwen3-0.6b --quant q8 --decode-ctx 128 --prefill 512 --profile >> $OUT/gpu_llm.log 2>&1
  grep -E "decode ctx|prefill +[0-9]+:|decode layer|decode head|graph" $OUT/gpu_llm.log
fi
if has bench; then
  stamp dit bench
  for v in ${ATTN:-base k w8}; do
    echo "CMF_DIT_ATTN=$v" | tee -a $OUT/dit-bench.log
    CMF_DIT_ATTN=$v ./.dev/bin/cmf-dit-bench --res $(echo $SIZES | tr ' ' ,) --steps 10 2>&1 | tail -n +2 | tee -a $OUT/dit-bench.log
    CMF_DIT_ATTN=$v CMF_DIT_PROFILE=1 ./.dev/bin/cmf-dit-bench --res 1024 --steps 4 2>&1 | tail -1 | tee -a $OUT/dit-bench.log
  done
  for f8 in ${FP8:-}; do
    # cmf-dit-bench takes the precision from CMF_DIT_FP8 (fp8 → 1, fp8-fast → fast).
    env8=$([ "$f8" = fp8-fast ] && echo fast || echo 1)
    echo "--dit-precision $f8 (CMF_DIT_FP8=$env8)" | tee -a $OUT/dit-bench.log
    CMF_DIT_FP8=$env8 ./.dev/bin/cmf-dit-bench --res $(echo $SIZES | tr ' ' ,) --steps 10 2>&1 | tail -n +2 | tee -a $OUT/dit-bench.log
    CMF_DIT_FP8=$env8 CMF_DIT_PROFILE=1 ./.dev/bin/cmf-dit-bench --res 1024 --steps 4 2>&1 | tail -1 | tee -a $OUT/dit-bench.log
  done
fi
if has anchor; then
  stamp diffusers
  pip install --no-index --no-deps --target /tmp/site .anchor/whl/*.whl > /dev/null 2>&1
  PYTHONPATH=/tmp/site timeout ${ANCHOR_TIMEOUT:-400} python3 .anchor/zimage_diffusers.py .anchor/tok --sizes $(echo $SIZES | tr ' ' ,) 2>&1 | grep -v Warning | tee $OUT/diffusers.log | tail -4
fi
if has e2e; then
  stamp "waiting for the pack"
  [ -n "${SYNTH:-}" ] && wait $SYNTH
  tail -2 $OUT/synth.log; ls -la $PACK
  PROMPT="A red fox standing in a snowy birch forest at dawn, soft light, highly detailed photograph"
  for s in $SIZES; do
    # First process: the pack's pages come from disk (cold page cache after synth's write-back
    # may still hold them); second: warm page cache. Each: 1 cold run (uploads) + 3 warm runs.
    for run in 1 2; do
      CMF_LOG=debug /usr/bin/time -v $C imagine $PACK --prompt "$PROMPT" --width $s --height $s --gpu cuda \
        --repeat 4 -o $OUT/fox-$s.png > $OUT/imagine-$s-$run.log 2> $OUT/imagine-$s-$run.err
      echo "imagine ${s}² process $run rc=$?"; grep -E "^devices|^timing|^runs|warning|uploaded in|^text encoder|VAE stage|VAE convs" $OUT/imagine-$s-$run.log $OUT/imagine-$s-$run.err
      grep -E "Maximum resident|Elapsed" $OUT/imagine-$s-$run.err
      grep -E "refus|runs on the CPU|error" $OUT/imagine-$s-$run.err | head -5
    done
    # The im2col VAE's image against the default's (cuDNN where it loads: its bf16 conv outputs).
    CMF_VAE_CONV=im2col $C imagine $PACK --prompt "$PROMPT" --width $s --height $s --gpu cuda -o $OUT/fox-$s-im2col.png \
      > $OUT/imagine-$s-im2col.log 2>&1 < /dev/null
    echo -n "VAE im2col vs default image: "; python3 bench/psnr.py $OUT/fox-$s.png $OUT/fox-$s-im2col.png
    for f8 in ${FP8:-}; do
      # The FP8 DiT against the bf16 image just made (issue 5: kept only at PSNR >= 35 dB).
      $C imagine $PACK --prompt "$PROMPT" --width $s --height $s --gpu cuda --repeat 4 --dit-precision $f8 \
        -o $OUT/fox-$s-$f8.png > $OUT/imagine-$s-$f8.log 2>&1
      echo "imagine ${s}² --dit-precision $f8 rc=$?"; grep -E "^devices|^timing|^runs" $OUT/imagine-$s-$f8.log
      echo -n "$f8 vs bf16 image: "; python3 bench/psnr.py $OUT/fox-$s.png $OUT/fox-$s-$f8.png
    done
  done
fi
stamp done
