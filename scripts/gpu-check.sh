#!/usr/bin/env bash
# The device check of the CUDA data path, for a machine with an NVIDIA GPU and driver:
#   scripts/gpu-check.sh [gpu-check flags, e.g. --device 1 --slot-mib 512 --json out.json]
# It builds `gpu-check` (no CUDA toolkit needed: the driver is loaded at run time) and runs it:
# the ring's arena registered as pinned memory, copy bandwidth from the ring against pageable
# and driver-pinned memory, batches intact on the device, copies overlapping compute, and the
# GPU's busy share in the drafter's double-buffered loop. Under a minute on one GPU.
# Exit status: 0 passed, 1 a check failed, 2 no driver or GPU (nothing checked).
# GPU_CHECK_BIN=path runs a binary built elsewhere (a GPU machine without cargo).
set -euo pipefail
cd "$(dirname "$0")/.."

bin=${GPU_CHECK_BIN:-}
if [ -z "$bin" ]; then
    echo "== cargo build --release -p scripts --bin gpu-check"
    cargo build --release -q -p scripts --bin gpu-check
    bin=target/release/gpu-check
fi
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader || true
fi
echo "== $bin $*"
exec "$bin" "$@"
