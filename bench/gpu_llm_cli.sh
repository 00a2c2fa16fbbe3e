#!/usr/bin/env bash
# The LLM commands a user runs, on the GPU, beside the engine's own decode rate and llama.cpp:
#   cmf-gpu-bench decode at context 128 (the engine: graph replay, decode ahead, device arg-max)
#   cmf bench --gpu cuda -p 512 -n 128     (llama-bench's contract)
#   cmf run --gpu cuda, greedy and sampled (--temp 0.7 --top-p 0.9), 256 tokens
#   llama-bench -p 512 -n 128 on a q8_0 GGUF of the same geometry
# on random-weight Qwen3-0.6B and Qwen3-8B geometry, q8 (`cmf synth`), plus the device test
# binaries and `cmf run` text identity between --gpu off and --gpu cuda on the fixtures.
#
# Build and stage on the development machine:
#   ../shared/tools/stage-for-device && xz -T2 -6 .dev/bin/* .dev/tests/*
#   .anchor/: llamacpp-src.tgz, tok.tar.xz (tok/ of ../shared/bench/README.md), make_qwen3_random.py
# Run on the GPU machine from the repository root (phases are idempotent; run it again on the same
# warm machine to finish what the deadline cut):
#   PHASES="tests cmf llama" bench/gpu_llm_cli.sh       logs and a summary go to $OUT
set -u
cd "$(dirname "$0")/.."
T0=$SECONDS; DEADLINE=${DEADLINE:-560}
left() { echo $((DEADLINE - (SECONDS - T0))); }
stamp() { echo "[$((SECONDS-T0)) s] $*"; }
OUT=${OUT:-/tmp/out}; W=/dev/shm/cli; D=$W/done; L=$W/logs; mkdir -p "$OUT" "$W" "$D" "$L" /tmp/lc
PHASES=${PHASES:-tests cmf llama}
export CMF_FIXTURES=$PWD/fixtures XDG_CACHE_HOME=/tmp/xdg CMF_REQUIRE_GPU=1
for f in .dev/bin/*.xz .dev/tests/*.xz; do [ -f "$f" ] && xz -d "$f"; done
chmod +x .dev/bin/* .dev/tests/* 2>/dev/null
[ -d .anchor/tok ] || tar xJf .anchor/tok.tar.xz -C .anchor 2>/dev/null
C=./.dev/bin/cmf
nvidia-smi --query-gpu=name,power.limit,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/summary.txt"
has() { case " $PHASES " in *" $1 "*) return 0;; esac; return 1; }

# llama.cpp builds in the background (CPU work) while ours run.
if has llama && [ ! -x /tmp/lc/llama.cpp/b/bin/llama-bench ] && [ ! -f /tmp/lc/building ]; then
  touch /tmp/lc/building
  [ -d /tmp/lc/llama.cpp ] || tar xzf .anchor/llamacpp-src.tgz -C /tmp/lc
  G=cmake; command -v ninja >/dev/null && G="cmake -G Ninja"
  setsid nohup sh -c "cd /tmp/lc/llama.cpp && $G -B b -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF \
    > /tmp/lc/cfg.log 2>&1 && cmake --build b -j12 --target llama-bench > /tmp/lc/build.log 2>&1; rm -f /tmp/lc/building" >/dev/null 2>&1 &
fi

if has tests && [ ! -f "$D/tests" ]; then
  stamp tests
  for t in .dev/tests/*; do
    n=$(basename "$t")
    timeout 240 "$t" --test-threads 1 > "$L/test-$n.log" 2>&1; rc=$?
    echo "$n rc=$rc $(grep -E '^test result' "$L/test-$n.log" | tail -1)" | tee -a "$OUT/summary.txt"
    grep -E "FAILED|panicked" "$L/test-$n.log" | head -5
  done
  stamp "cmf run: --gpu off against --gpu cuda"
  $C convert --model fixtures/llm/qwen3-tiny --quant f32 -o $W/q3t.cmf > /dev/null 2>&1
  $C convert --model fixtures/llm/llama-tiny --quant f32 -o $W/llt.cmf > /dev/null 2>&1
  for m in $W/q3t.cmf $W/llt.cmf; do
    for s in "--temp 0" "--temp 0.8 --top-p 0.9 --seed 7" "--temp 1.0 --top-k 20 --min-p 0.05 --repeat-penalty 1.2 --seed 3"; do
      for g in off cuda; do
        $C run $m --raw -p "The quick brown fox" --max-tokens 32 $s --gpu $g > $W/run-$g.txt 2> $W/run-$g.err
      done
      if cmp -s $W/run-off.txt $W/run-cuda.txt; then r=identical; else r=DIFFERS; fi
      echo "$(basename $m) [$s]: text $r off vs cuda" | tee -a "$OUT/summary.txt"
    done
  done
  touch "$D/tests"
fi

if has cmf; then
  for p in qwen3-0.6b qwen3-8b; do
    [ $(left) -lt 60 ] && break
    [ -f "$D/cmf-$p" ] && continue
    [ -f $W/$p.cmf ] || { stamp "synth $p"; $C synth --preset $p --quant q8 -o $W/$p.cmf > /dev/null 2>&1; }
    stamp "$p: engine, cmf bench, cmf run"
    ./.dev/bin/cmf-gpu-bench --preset $p --quant q8 --decode-ctx 128 --prefill 512 2>&1 | grep -E "decode|prefill" | sed "s/^/engine: /" | tee -a "$OUT/summary.txt"
    $C bench $W/$p.cmf --gpu cuda -p 512 -n 128 -r 5 2>/dev/null | sed "s/^/cmf bench: /" | tee -a "$OUT/summary.txt"
    for s in "--temp 0" "--temp 0.7 --top-p 0.9 --seed 1"; do
      for rep in 1 2; do
        $C run $W/$p.cmf --gpu cuda --raw -p "Once upon a time" --max-tokens 256 $s > /dev/null 2> $W/run.err
        echo "cmf run $p [$s]: $(tail -1 $W/run.err)" | tee -a "$OUT/summary.txt"
      done
    done
    touch "$D/cmf-$p"
  done
fi

if has llama; then
  for p in qwen3-0.6b qwen3-8b; do
    GGUF=$W/$p-q8_0.gguf
    [ $(left) -lt 90 ] && break
    if [ ! -f $GGUF ]; then
      stamp "random $p checkpoint -> GGUF q8_0"
      python3 .anchor/make_qwen3_random.py $p $W/hf .anchor/tok > "$L/gen-$p.log" 2>&1
      while [ ! -f /tmp/lc/llama.cpp/convert_hf_to_gguf.py ]; do sleep 2; done
      python3 /tmp/lc/llama.cpp/convert_hf_to_gguf.py $W/hf --outtype q8_0 --outfile $GGUF > "$L/conv-$p.log" 2>&1 || tail -3 "$L/conv-$p.log"
      rm -rf $W/hf
    fi
  done
  stamp "waiting for the llama.cpp build"
  while [ -f /tmp/lc/building ] && [ $(left) -gt 60 ]; do sleep 5; done
  B=/tmp/lc/llama.cpp/b/bin
  if [ -x $B/llama-bench ]; then
    for p in qwen3-0.6b qwen3-8b; do
      [ -f $W/$p-q8_0.gguf ] && [ ! -f "$D/llama-$p" ] && [ $(left) -gt 40 ] || continue
      timeout 120 $B/llama-bench -m $W/$p-q8_0.gguf -ngl 99 -fa 1 -p 512 -n 128 -r 5 -o md 2>/dev/null | grep -E "pp|tg" | sed "s/^/llama-bench $p: /" | tee -a "$OUT/summary.txt"
      touch "$D/llama-$p"
    done
  else
    echo "llama.cpp not built yet: call again" | tee -a "$OUT/summary.txt"
  fi
fi
tar czf "$OUT/logs.tgz" -C "$W" logs 2>/dev/null
stamp done
