#!/bin/bash
set -uo pipefail
source scripts/cuda-env.sh
mkdir -p target/cuda/release && tar -C target/cuda/release -xJf target/cuda/carry/hspipe-cuda.tar.xz && touch target/cuda/release/*
B=target/cuda/release/bench-dflash-step
shape=(--shape scripts/shapes/qwen3-8b --device cuda --layers 5 --captured 5 --block 16 --anchors 512 --tokens 4096)
nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader -lms 200 > $OUT/mem.log &
smi=$!
mark() { echo "$(date +%T.%N) $*" | tee -a $OUT/marks.log; }
best=""
for sp in 268435456 134217728 67108864; do
  mark "ours sp=$sp"
  if HSPIPE_DFLASH_SCORES_PER_PART=$sp timeout 90 $B "${shape[@]}" --steps 1 >>$OUT/probe.log 2>&1; then mark "ok $sp"; best=$sp; break; else mark "fail $sp"; fi
  tail -4 $OUT/probe.log
done
mark "probe done"
kill $smi
[ -n "$best" ] || exit 1
export HSPIPE_DFLASH_SCORES_PER_PART=$best
GPU_CHECK_OUT=$OUT GPU_CHECK_STEPS=dflash timeout 330 bash scripts/gpu-check.sh 2>&1 | tee $OUT/gpu-check.log
