#!/usr/bin/env bash
# CPU Z-Image benchmark: our `cmf imagine` beside the reference CLI's `cortiq imagine` (cortiq-cli
# 0.8.54) on the same full-size random-weight pack (`cmf synth --preset z-image-turbo`), same
# size, steps, prompt, seed and thread count, one after the other in the same run.
#
# usage: bench/cpu_zimage.sh [PACK]     (default PACK: /work/cache/zimage/zimage-turbo-random-q8_2f.cmf)
# Env (defaults):
#   THREADS=2       our --threads N; the reference's CMF_THREADS=N (see docs/reference-cli.md: N ≥ 2 is
#                   N pool workers plus the calling thread — the only way to give it 2 cores)
#   SIZE=512        width = height
#   STEPS=2         DiT steps (Turbo recipe otherwise: guidance 0, shift 3)
#   NICE=5          niceness of the measured processes (the machine is shared)
#   ENGINES="cmf cortiq"   which to run, in this order
#   CMF_BIN         default: target/release/cmf (build it first: cargo build --release -p cmf-cli)
#   CORTIQ_BIN      default: /work/cache/cortiq/bin/cortiq
#   WORK            raw logs and images (default: /tmp/cmf-zimage-bench)
#
# Per engine it records: the load average just before the run; the wall time of each stage as the
# engine prints it (ours: `timing:`; the reference: `CMF_ZIMAGE_PROF=1`'s `zimage stages:` and
# per-step lines); CPU seconds (user + sys, all threads) per stage — ours from its own `cpu time:`
# line (getrusage at the stage boundaries), the reference's by sampling /proc/PID/stat every 0.5 s
# beside the time each of its stage lines appeared (± 0.5 s per boundary); peak RSS and total CPU
# from /usr/bin/time -v. The table goes to stdout and $WORK/table.md.
#
# Both engines map the pack; file-backed resident pages count in RSS. The pack is read once
# before the first run (cat > /dev/null) so neither engine pays the cold disk read alone.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PACK=${1:-/work/cache/zimage/zimage-turbo-random-q8_2f.cmf}
THREADS=${THREADS:-2}
SIZE=${SIZE:-512}
STEPS=${STEPS:-2}
NICE=${NICE:-5}
ENGINES=${ENGINES:-cmf cortiq}
CMF_BIN=${CMF_BIN:-$ROOT/target/release/cmf}
CORTIQ_BIN=${CORTIQ_BIN:-/work/cache/cortiq/bin/cortiq}
WORK=${WORK:-/tmp/cmf-zimage-bench}
PROMPT="a red fox in a snowy birch forest at dawn"
SEED=7

[ -f "$PACK" ] || { echo "no pack at $PACK (make one: cmf synth --preset z-image-turbo -o $PACK)" >&2; exit 2; }
mkdir -p "$WORK"

# run NAME CMD...: runs CMD under /usr/bin/time -v at the given niceness with output to
# $WORK/NAME.log, sampling "time cpu_seconds lines_of_output" every 0.5 s to $WORK/NAME.samples.
run() {
    local name=$1; shift
    local log=$WORK/$name.log samples=$WORK/$name.samples timef=$WORK/$name.time
    : >"$samples"
    cut -d' ' -f1-3 /proc/loadavg >"$WORK/$name.load"
    echo "== $name (load $(cat "$WORK/$name.load")): $*" >&2
    /usr/bin/time -v -o "$timef" nice -n "$NICE" "$@" >"$log" 2>&1 &
    local tpid=$! pid="" tck
    tck=$(getconf CLK_TCK)
    while kill -0 "$tpid" 2>/dev/null; do
        [ -n "$pid" ] || pid=$(pgrep -P "$tpid" | head -1 || true)
        if [ -n "$pid" ] && [ -r "/proc/$pid/stat" ]; then
            # fields 14, 15: utime, stime (clock ticks, all threads); the comm field has no spaces here
            awk -v t="$(date +%s.%N)" -v n="$(wc -l <"$log")" -v hz="$tck" \
                '{printf "%s %.2f %d\n", t, ($14 + $15) / hz, n}' "/proc/$pid/stat" >>"$samples" 2>/dev/null || true
        fi
        sleep 0.5
    done
    wait "$tpid" || { echo "$name failed, see $log" >&2; tail -20 "$log" >&2; return 1; }
}

echo "reading $PACK into the page cache" >&2
nice -n "$NICE" cat "$PACK" >/dev/null

for e in $ENGINES; do
    case $e in
    cmf)
        run cmf "$CMF_BIN" imagine "$PACK" --prompt "$PROMPT" --width "$SIZE" --height "$SIZE" \
            --steps "$STEPS" --seed "$SEED" --threads "$THREADS" -o "$WORK/cmf.png"
        ;;
    cortiq)
        run cortiq env CMF_THREADS="$THREADS" CMF_ZIMAGE_PROF=1 "$CORTIQ_BIN" imagine "$PACK" \
            --prompt "$PROMPT" --width "$SIZE" --height "$SIZE" --steps "$STEPS" --seed "$SEED" \
            --out "$WORK/cortiq.png"
        ;;
    *) echo "unknown engine $e" >&2; exit 2 ;;
    esac
done

python3 - "$WORK" "$ENGINES" "$THREADS" "$SIZE" "$STEPS" "$PACK" <<'PY' | tee "$WORK/table.md"
import re, sys, statistics, os
work, engines, threads, size, steps, pack = sys.argv[1:7]

def timev(name):
    t = open(f"{work}/{name}.time").read()
    g = lambda k: float(re.search(re.escape(k) + r":\s*([\d.]+)", t).group(1))
    return {"rss_gib": g("Maximum resident set size (kbytes)") / 2**20,
            "cpu": g("User time (seconds)") + g("System time (seconds)")}

def samples(name):
    rows = []
    for line in open(f"{work}/{name}.samples"):
        t, c, n = line.split()
        rows.append((float(t), float(c), int(n)))
    return rows

def cpu_when_line_appeared(rows, line_no):
    """CPU seconds at the first sample that saw output line `line_no` (1-based)."""
    for t, c, n in rows:
        if n >= line_no:
            return c
    return rows[-1][1] if rows else float("nan")

res = {}
for e in engines.split():
    log = open(f"{work}/{e}.log", errors="replace").read().splitlines()
    r = {"load": open(f"{work}/{e}.load").read().strip(), **timev(e)}
    if e == "cmf":
        tl = next(l for l in log if l.startswith("timing:"))
        cl = next(l for l in log if l.startswith("cpu time:"))
        f = lambda pat, s: float(re.search(pat, s).group(1))
        r["te"] = f(r"text encoder ([\d.]+) s", tl)
        r["step"] = f(r"median ([\d.]+) s/step", tl)
        r["vae"] = f(r"VAE ([\d.]+) s", tl)
        r["total"] = f(r"process ([\d.]+) s", tl)
        r["te_cpu"] = f(r"text encoder ([\d.]+) s", cl)
        r["step_cpu"] = f(r"\(([\d.]+) s/step\)", cl)
        r["vae_cpu"] = f(r"VAE ([\d.]+) s", cl)
    else:
        rows = samples(e)
        idx = {i + 1: l for i, l in enumerate(log)}
        st = next(l for l in log if l.startswith("zimage stages:"))
        f = lambda pat: float(re.search(pat, st).group(1))
        r["te"], r["vae"], r["total"] = f(r"text-encode ([\d.]+)s"), f(r"vae ([\d.]+)s"), f(r"total ([\d.]+)s")
        r["step"] = f(r"median ([\d.]+)s")
        # CPU per stage from the samples: the boundaries are the lines that end each stage.
        te_end = next(i for i, l in idx.items() if l.startswith("zimage: text-encode"))
        prep = next(i for i, l in idx.items() if l.startswith("zimage prepare:"))
        step_lines = [i for i, l in idx.items() if re.match(r"zimage: image 1 step \d+/\d+", l)]
        end = next(i for i, l in idx.items() if l.startswith("zimage stages:"))
        c = lambda i: cpu_when_line_appeared(rows, i)
        r["te_cpu"] = c(te_end)
        bounds = [prep] + step_lines
        per = [c(b) - c(a) for a, b in zip(bounds, bounds[1:])]
        r["step_cpu"] = statistics.median(per) if per else float("nan")
        r["vae_cpu"] = c(end) - c(step_lines[-1]) if step_lines else float("nan")
    res[e] = r

cols = [("load avg (1/5/15 min) before", lambda r: r["load"]),
        ("text encoder s (CPU s)", lambda r: f"{r['te']:.1f} ({r['te_cpu']:.1f})"),
        ("DiT s/step, median (CPU s)", lambda r: f"{r['step']:.1f} ({r['step_cpu']:.1f})"),
        ("VAE s (CPU s)", lambda r: f"{r['vae']:.1f} ({r['vae_cpu']:.1f})"),
        ("total s (CPU s)", lambda r: f"{r['total']:.1f} ({r['cpu']:.1f})"),
        ("peak RSS GiB", lambda r: f"{r['rss_gib']:.2f}")]
print(f"Z-Image-Turbo, {size}x{size}, {steps} steps, {threads} threads, pack {os.path.basename(pack)}\n")
print("| engine | " + " | ".join(c for c, _ in cols) + " |")
print("| --- " * (len(cols) + 1) + "|")
for e, r in res.items():
    print(f"| {e} | " + " | ".join(fn(r) for _, fn in cols) + " |")
if "cmf" in res and "cortiq" in res:
    a, b = res["cmf"], res["cortiq"]
    q = lambda k: b[k] / a[k] if a[k] > 0 else float("nan")
    print(f"\nspeed-up cmf vs cortiq (wall): DiT step {q('step'):.2f}x, total {q('total'):.2f}x;"
          f" (CPU s): DiT step {q('step_cpu'):.2f}x, total {q('cpu'):.2f}x;"
          f" peak RSS {a['rss_gib']:.2f} vs {b['rss_gib']:.2f} GiB")
PY
