#!/usr/bin/env bash
# One run on the GPU machine (staged by scripts/stage_device.sh; run from the repository root with
# .dev and .anchor carried): unpack, start the llama.cpp build, make the Qwen3-8B-geometry q8_0
# GGUF (bench/make_qwen3_gguf.py) and import it, then the phases in PHASES (default
# "tests bench peer"): tests (every GPU test binary, CMF_REQUIRE_GPU=1, then once more with
# CMF_GPU_BATCH_KERNELS=next), bench (cmf bench --parallel with each kernel set), peer
# (llama-batched-bench), serve / lserve (cmf serve --parallel 64 / llama-server -np 64 under
# loadgen.py), prof (ncu per-kernel times of a short batched run), moe (bench/gpu_peers.sh's MoE
# peers), profmoe (ncu of MoE decode). DL: seconds to finish within.
# Phases are idempotent on a warm machine (the GGUF, its import and the llama.cpp build stay).
# GEOM: make_qwen3_gguf.py geometry arguments of the dense file (default Qwen3-8B).
set -u
T0=$SECONDS; DL=${DL:-560}
left() { echo $((DL - (SECONDS - T0))); }
# $OUT gets summary.txt and logs.tgz (every log, from /tmp/logs).
O=${OUT:-/tmp/out}; L=/tmp/logs; mkdir -p $O $L; S=$O/summary.txt
st() { echo "[$((SECONDS - T0)) s] $*" | tee -a $S; }
nvidia-smi --query-gpu=name,power.limit,driver_version,memory.total --format=csv,noheader | tee -a $S
[ -x .dev/bin/cmf ] || tar xJf .dev/all.txz -C .dev
chmod +x .dev/bin/* .dev/tests/*
W=/dev/shm/peers; mkdir -p $W /tmp/lc
if [ ! -x /tmp/lc/llama.cpp/b/bin/llama-batched-bench ] && [ ! -f /tmp/lc/building ]; then
  [ -d /tmp/lc/llama.cpp ] || tar xJf .anchor/llamacpp-src.txz -C /tmp/lc
  touch /tmp/lc/building
  setsid nohup sh -c "cd /tmp/lc/llama.cpp && cmake -G Ninja -B b -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF \
    > /tmp/lc/cfg.log 2>&1 && cmake --build b -j12 --target llama-bench llama-batched-bench llama-server > /tmp/lc/build.log 2>&1; rm -f /tmp/lc/building" >/dev/null 2>&1 &
fi
if [ ! -f $W/q8b.cmf ] && [ ! -f $W/gen.started ]; then
  touch $W/gen.started
  xz -dc .anchor/qwen3-template.gguf.xz > $W/tpl.gguf 2>/dev/null || cp .anchor/qwen3-template.gguf $W/tpl.gguf
  setsid nohup sh -c "PYTHONPATH=/tmp/lc/llama.cpp/gguf-py python3 bench/make_qwen3_gguf.py $W/tpl.gguf $W/q8b.gguf ${GEOM:---arch qwen3 --layers 36 --hidden 4096 --kv-heads 8 --ffn 12288} \
    && .dev/bin/cmf import-gguf $W/q8b.gguf -o $W/q8b.tmp && mv $W/q8b.tmp $W/q8b.cmf" > $W/gen.log 2>&1 &
fi
export CMF_REQUIRE_GPU=1
has() { case " ${PHASES:-tests bench peer} " in *" $1 "*) return 0;; esac; return 1; }
if has tests; then
  for t in cuda batched device_sampling gpu_parity device_fallback device_contention moe_placement cmf_gpu; do
    [ -x .dev/tests/$t ] || continue
    timeout 240 .dev/tests/$t --test-threads 1 > $L/test-$t.log 2>&1; rc=$?
    st "test $t rc=$rc: $(grep -E '^test result' $L/test-$t.log | tail -1)"
    grep -E "^test .* FAILED|panicked" $L/test-$t.log | head -5 | tee -a $S
  done
  # cmf-llm's device batch tests once more on the other kernel set (cuda's batched tests run both).
  CMF_GPU_BATCH_KERNELS=next timeout 240 .dev/tests/batched --test-threads 1 > $L/test-batched-next.log 2>&1
  st "test batched (CMF_GPU_BATCH_KERNELS=next) rc=$?: $(grep -E '^test result' $L/test-batched-next.log | tail -1)"
  cat $L/test-*.log > $L/tests.log; rm -f $L/test-*.log
  grep -E -A14 "rel err|^hybrid" $L/tests.log | head -80
fi
if has bench || has serve || has prof || has peer || has lserve; then
  while [ ! -f $W/q8b.cmf ] && [ $(left) -gt 200 ]; do sleep 2; done
  [ -f $W/q8b.cmf ] && st "q8b ready" || { tail -3 $W/gen.log; st "q8b not made"; }
fi
B=$L/bench.log
run_bench() {  # label, env...
  local label=$1; shift
  st "cmf bench --parallel [$label]"
  env "$@" timeout 150 .dev/bin/cmf bench $W/q8b.cmf --gpu cuda -p 128 -n 128 --parallel ${NPL:-1,16,64,128} >> $B 2>&1
  grep -E "^\|" $B | tail -6 | tee -a $S
}
if has bench; then
  [ $(left) -gt 150 ] && run_bench "verified kernels" CMF_GPU_BATCH_KERNELS=
  [ $(left) -gt 150 ] && run_bench "CMF_GPU_BATCH_KERNELS=next" CMF_GPU_BATCH_KERNELS=next
fi
load() {  # port, name, server pid
  for _ in $(seq 600); do
    curl -sf localhost:$1/health > /dev/null && break
    kill -0 $3 2>/dev/null || { st "$2: the server exited"; return; }
    sleep 0.3
  done
  for c in ${CLIENTS:-1 16 64}; do
    [ "$(left)" -lt 50 ] && break
    st "$2, $c clients: $(timeout 100 python3 .anchor/loadgen.py $1 $c $((c * 2)) 128 60 '{"ignore_eos": true}')"
  done
}
if has serve && [ -f $W/q8b.cmf ] && [ $(left) -gt 120 ]; then
  CMF_GPU_BATCH_KERNELS=${SERVE_KERNELS:-next} .dev/bin/cmf serve $W/q8b.cmf --gpu cuda --parallel 64 --queue 256 -c 1024 --port 18080 > $L/serve.log 2>&1 &
  SP=$!
  load 18080 "cmf serve --gpu cuda --parallel 64 (CMF_GPU_BATCH_KERNELS=${SERVE_KERNELS:-next})" $SP
  kill $SP; wait $SP 2>/dev/null
fi
st "waiting for llama.cpp"
while [ -f /tmp/lc/building ] && [ $(left) -gt 100 ]; do sleep 3; done
LB=/tmp/lc/llama.cpp/b/bin
if has peer && [ -x $LB/llama-batched-bench ] && [ $(left) -gt 60 ]; then
  st "llama-batched-bench"
  timeout $(( $(left) - 10 )) $LB/llama-batched-bench -m $W/q8b.gguf -ngl 99 -fa 1 -c 40000 -b 2048 -ub 512 -npp 128 -ntg 128 -npl ${NPL:-1,16,64,128} > $L/peer.log 2>&1
  grep -E "^\|" $L/peer.log | tee -a $S
else
  tail -3 /tmp/lc/build.log; st "llama.cpp not built"
fi
# ncu per-kernel device times of one cmf bench run: label, cmf bench arguments.
profile() {
  local label=$1; shift
  st "ncu: $label"
  CMF_GPU_BATCH_KERNELS=${PROF_KERNELS:-next} timeout $(( $(left) - 20 )) ncu --clock-control none \
    --metrics gpu__time_duration.sum --print-summary per-kernel --csv .dev/bin/cmf bench "$@" \
    > $L/prof.csv 2> $L/prof.err
  python3 - $L/prof.csv <<'PY' | tee -a $S
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if rows:
    ix = {h: i for i, h in enumerate(rows[0])}
    tot = {}
    for r in rows[1:]:
        try:
            name, n = r[ix["Kernel Name"]], int(r[ix["Invocations"]])
            avg = float(r[ix["Average"]].replace(",", ""))
        except (KeyError, ValueError):
            continue
        tot[name[:60]] = (n, avg, n * avg)
    for k, (n, avg, t) in sorted(tot.items(), key=lambda kv: -kv[1][2])[:25]:
        print(f"{t:12.1f} total {n:6d} x {avg:10.2f}  {k}")
PY
  head -c 600 $L/prof.csv | tee -a $S; tail -c 300 $L/prof.err
}
if has prof && [ -f $W/q8b.cmf ] && [ $(left) -gt 90 ]; then
  profile "batched, ${PROF_B:-16} sequences, prompt 16, 2 decode steps" \
    $W/q8b.cmf --gpu cuda -p 16 -n 2 --parallel ${PROF_B:-16}
fi
# Qwen3-30B-A3B geometry (LAYERS of 48): cmf bench / llama-bench (bench/gpu_peers.sh phase moe),
# then where its decode time goes.
if has moe && [ $(left) -gt 200 ]; then
  PHASES=moe DEADLINE=$(( $(left) - 10 )) OUT=$L/moe bench/gpu_peers.sh > $L/moe.log 2>&1
  cat $L/moe/summary.txt >> $S; tail -4 $L/moe.log
fi
if has profmoe && [ -f $W/moe.cmf ] && [ $(left) -gt 90 ]; then
  profile "MoE decode, 16 tokens" $W/moe.cmf --gpu cuda -p 16 -n 16 -r 1
fi
if has lserve && [ -x $LB/llama-server ] && [ $(left) -gt 100 ]; then
  $LB/llama-server -m $W/q8b.gguf -ngl 99 -fa on -np 64 -c 65536 --port 18081 > $L/llama-server.log 2>&1 &
  SP=$!
  load 18081 "llama-server -np 64" $SP
  kill $SP; wait $SP 2>/dev/null
fi
st done
tar czf $O/logs.tgz -C /tmp logs
