#!/usr/bin/env bash
# Rebuilds the kernel images the binary embeds (crates/cmf-gpu/cubins/, see
# crates/cmf-gpu/src/cuda/runtime/prebuilt.rs) from the current sources, with NVRTC 13.0 from
# PyPI: no GPU needed. Run it after editing a kernel; the test `prebuilt_kernels_match_the_sources` fails until
# then. Arguments go to cmf-prebuild-kernels (`--add-jobs LOG` merges the modules a run logged with
# CMF_KERNEL_JOBS_LOG=LOG; `--check` only lists missing and stale images).
set -euo pipefail
cd "$(dirname "$0")/.."
NV="${CMF_CACHE:-$HOME/.cache/cmf}/nvrtc-13.0.88"
LIB="$NV/nvidia/cu13/lib"
if [ ! -e "$LIB/libnvrtc.so.13" ]; then
  python3 -m pip install --quiet --target "$NV" nvidia-cuda-nvrtc==13.0.88
fi
ln -sf libnvrtc.so.13 "$LIB/libnvrtc.so"
cargo build --release -p cmf-gpu --bin cmf-prebuild-kernels
LD_LIBRARY_PATH="$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" target/release/cmf-prebuild-kernels "$@"
