#!/bin/bash
set -uo pipefail
source scripts/cuda-env.sh
mkdir -p target/cuda/release && tar -C target/cuda/release -xJf target/cuda/carry/hspipe-cuda.tar.xz
B=target/cuda/release/bench-dflash-step
shape=(--shape scripts/shapes/qwen3-8b --device cuda --layers 5 --captured 5 --block 16 --anchors 512 --tokens 4096)
mark() { echo "$(date +%T) $*" | tee -a $OUT/marks.log; }
best=""
for sp in 67108864 16777216 4194304; do
  mark "ours sp=$sp"
  if HSPIPE_DFLASH_SCORES_PER_PART=$sp timeout 100 $B "${shape[@]}" --steps 2 --trace-memory > $OUT/ours-$sp.json 2> $OUT/trace-$sp.log; then
    mark "ok $sp: $(cat $OUT/ours-$sp.json)"; best=$sp; break
  else mark "fail $sp"; grep -v "^ *[0-9]*: \|^ *at " $OUT/trace-$sp.log | tail -8; fi
done
mark "torch"
timeout 100 python3 scripts/py/dflash_step.py bench "${shape[@]}" --steps 3 | tee -a $OUT/rounds.log
[ -n "$best" ] || exit 1
export HSPIPE_DFLASH_SCORES_PER_PART=$best
mark "round 2 ours"; echo "ours $(timeout 100 $B "${shape[@]}" --steps 3 2>/dev/null)" | tee -a $OUT/rounds.log
mark "round 2 torch"; echo "torch $(timeout 100 python3 scripts/py/dflash_step.py bench "${shape[@]}" --steps 3)" | tee -a $OUT/rounds.log
mark "per-part"; echo "ours-per-part $(timeout 120 $B "${shape[@]}" --steps 2 --per-part 2>/dev/null)" | tee -a $OUT/rounds.log
mark done
