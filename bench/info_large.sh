#!/usr/bin/env bash
# Measures that `cmf info` is O(directory), not O(file): writes a ~4 GB CMF file with our
# writer (q4_tiled 4096×4096 tensors, the same encoded payload repeated), then times
#   - cmf info with the file's pages evicted from the page cache (posix_fadvise DONTNEED on
#     this file only: "cold-ish", no root needed, other users' cache untouched),
#   - cmf info warm (best and median of RUNS),
#   - cmf verify once (reads and hashes every byte, for contrast).
# The file is deleted at the end (also on failure).
#
# usage: bench/info_large.sh [BYTES=4000000000] [DIR=${TMPDIR:-/tmp}] [RUNS=7]
set -euo pipefail
cd "$(dirname "$0")/.."
BYTES=${1:-4000000000}
DIR=${2:-${TMPDIR:-/tmp}}
RUNS=${3:-7}
FILE="$DIR/cmf-info-bench-$$.cmf"
trap 'rm -f "$FILE" "$FILE.tmp"' EXIT

cargo build --release -q -p cmf-cli
cargo build --release -q -p cmf-format --example write_synthetic
CMF=target/release/cmf
test -x "$CMF"

start=$(date +%s.%N)
target/release/examples/write_synthetic "$FILE" "$BYTES"
end=$(date +%s.%N)
size=$(stat -c %s "$FILE")
echo "wrote $size bytes in $(echo "$end - $start" | bc) s"

evict() { python3 -c 'import os,sys; fd=os.open(sys.argv[1], os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)' "$1"; }
secs() { local s e; s=$(date +%s.%N); "$@" > /dev/null || exit 1; e=$(date +%s.%N); echo "$e - $s" | bc; }

evict "$FILE"
echo "info cold-ish: $(secs "$CMF" info "$FILE") s"
times=()
for _ in $(seq "$RUNS"); do times+=("$(secs "$CMF" info "$FILE")"); done
sorted=$(printf '%s\n' "${times[@]}" | sort -n)
echo "info warm ($RUNS runs): best $(echo "$sorted" | head -1) s, median $(echo "$sorted" | sed -n "$(( (RUNS + 1) / 2 ))p") s"
echo "info --json --tensors (all $(
  "$CMF" info "$FILE" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["tensor_count"])'
) tensors) warm: $(secs "$CMF" info "$FILE" --json --tensors=) s"
evict "$FILE"
echo "verify (reads all $size bytes, cold-ish): $(secs "$CMF" verify "$FILE") s"
