#!/usr/bin/env bash
# Build llama.cpp for the CPU from the tree vendored in the llama-cpp-python sdist on PyPI.
# Nothing from llama.cpp enters this repository: the source and binaries live under CACHE_DIR.
#
# usage: scripts/llamacpp_build.sh [CACHE_DIR]     (default: /work/cache, or $CMF_CACHE)
# prints the llama.cpp source directory on its last line; binaries are in <that dir>/build/bin.
# Env: LLAMACPP_PY_VERSION (default 0.3.36), JOBS (default 2), PYTHON (for pip download).
# Idempotent: reuses the download, the unpacked tree and the build directory.
set -euo pipefail
CACHE=${1:-${CMF_CACHE:-/work/cache}}
VER=${LLAMACPP_PY_VERSION:-0.3.36}
JOBS=${JOBS:-2}
PY=${PYTHON:-$(command -v python3)}
mkdir -p "$CACHE"
SDIST="$CACHE/llama_cpp_python-$VER.tar.gz"
SRC="$CACHE/llama_cpp_python-$VER/vendor/llama.cpp"
# In this llama.cpp (vendored in llama-cpp-python 0.3.36) `llama-cli` is the server-backed interactive chat
# (it needs LLAMA_BUILD_SERVER); the scriptable one-shot generator that used to be llama-cli is `llama-completion`.
TARGETS="llama-completion llama-simple llama-tokenize llama-perplexity llama-bench"

if [ ! -f "$SDIST" ]; then
  echo "downloading llama-cpp-python==$VER sdist from PyPI" >&2
  "$PY" -m pip download --no-deps --no-binary :all: --no-build-isolation "llama-cpp-python==$VER" -d "$CACHE" >&2
fi
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  tar xzf "$SDIST" -C "$CACHE"
fi
command -v cmake >/dev/null || { echo "error: cmake not found (apt-get install cmake, or pip install cmake)" >&2; exit 2; }

missing=0
for t in $TARGETS; do [ -x "$SRC/build/bin/$t" ] || missing=1; done
if [ $missing = 1 ]; then
  # CPU only, native ISA (AVX2/AVX-512 as the host has them), no curl/server/tests: only the tools we time.
  cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_CUDA=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF >&2
  nice -n 10 cmake --build "$SRC/build" --config Release -j "$JOBS" --target $TARGETS >&2
fi
for t in $TARGETS; do [ -x "$SRC/build/bin/$t" ] || { echo "error: $t was not built" >&2; exit 1; }; done
echo "$SRC"
