#!/usr/bin/env bash
# The GPU build: the launcher (and so every worker: they are its own binary) and the device
# check's programs with `--features cuda`, candle's CUDA device included, built on a machine
# with no CUDA and no GPU.
#   scripts/build-cuda.sh            -> target/cuda/release/{launcher,gpu-check,bench-target,bench-dflash,bench-dflash-step}
#                                       and target/cuda/carry/hspipe-cuda.tar.xz
#
# The tarball holds launcher, gpu-check, bench-target and bench-dflash-step stripped (about 28 MB; the binaries
# are 200-250 MB with debug info, each holding candle's kernels): what a GPU machine without
# Rust needs, small enough to travel with a working tree. scripts/gpu-check.sh unpacks it into
# target/cuda/release when the binaries are not there.
#
# Build time: nvcc 13.0 and CUDA's headers from PyPI (scripts/cuda-toolkit.sh, ~45 MB, cached in
# target/cuda-13.0). The kernels are compiled for the H200's architecture (CUDA_COMPUTE_CAP=90;
# candle's build makes it sm_90a, so the binary runs on Hopper GPUs only: set it for another
# GPU), and candle's PTX is made by CUDA 13.0, which the GPU machines' driver (580) loads.
#
# Run time, on the GPU machine (no Rust there): the launcher, bench-target and bench-dflash-step need libcuda.so.1
# (the driver), libcudart.so.13, libcublas.so.13 and libcurand.so.10, the launcher also
# libnccl.so.2 (its drafters' NCCL group); gpu-check needs
# libcuda.so.1, libcudart.so.13 and libnccl.so.2 (the linker keeps only the libraries a binary
# calls; cuBLASLt and NVRTC are linked by candle but not kept). Without the driver none of them
# starts. PyTorch's CUDA 13 wheels install every one but the driver's under
# site-packages/nvidia/*/lib; `source scripts/cuda-env.sh` puts those directories on
# LD_LIBRARY_PATH (and says which library is missing, if one is). `ldd` on a binary lists them.
set -euo pipefail
cd "$(dirname "$0")/.."

home=$(scripts/cuda-toolkit.sh | tail -1)
export CUDA_HOME=$home PATH=$home/bin:$PATH
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/cuda}
bins=(--bin launcher --bin gpu-check --bin bench-target --bin bench-dflash --bin bench-dflash-step)
echo "== cargo build --release --features cuda ${bins[*]} (CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP, into $CARGO_TARGET_DIR)"
cargo build --release -p launcher -p scripts --features launcher/cuda,scripts/cuda "${bins[@]}"
echo "== built; run-time libraries of launcher:"
ldd "$CARGO_TARGET_DIR/release/launcher" | grep -E 'cuda|cublas|curand|nvrtc|nccl' || true
carry=$CARGO_TARGET_DIR/carry
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
carried=(launcher gpu-check bench-target bench-dflash-step)
for b in "${carried[@]}"; do
    strip -o "$stage/$b" "$CARGO_TARGET_DIR/release/$b"
done
mkdir -p "$carry"
echo "== $carry/hspipe-cuda.tar.xz (stripped; a minute or two of xz)"
tar -C "$stage" -cJf "$carry/hspipe-cuda.tar.xz.tmp" "${carried[@]}"
mv "$carry/hspipe-cuda.tar.xz.tmp" "$carry/hspipe-cuda.tar.xz"
ls -l "$carry/hspipe-cuda.tar.xz"
