#!/usr/bin/env bash
# The DFlash drafter on the CPU (BENCHMARKS.md, "The DFlash drafter on the CPU"): for the tiny
# trained target and a mid-size random one, ROUNDS alternating runs of the 5x3 pipeline
# (launcher, one process per worker, the ring between them) and of the same target and drafter
# code in one process without the ring (bench-dflash), on the same plan. Prints each run's
# tokens/s, the drafters' phase shares (from metrics.jsonl) and the in-process parts' medians.
# The runs do not evaluate (eval_every = 0): this measures training.
#   scripts/bench-dflash.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
cargo build --release -p launcher -p scripts --bin launcher --bin bench-dflash
bin=./target/release
out=${BENCH_OUT:-/tmp/hspipe-bench-dflash}
mkdir -p "$out"
tiny=$out/tiny
[ -f "$tiny/config.json" ] || $bin/launcher make-model "$tiny" --layers 2 --train >/dev/null
mid=${BENCH_MODEL:-/tmp/hspipe-bench-mid}
[ -f "$mid/config.json" ] || $bin/launcher make-model "$mid" --layers 8 --hidden 512 --heads 8 \
    --kv-heads 4 --head-dim 64 --intermediate 1536 --vocab 32000 --seed 1 >/dev/null
cat > "$out/tiny.toml" <<'TOML'
[model]
target_layer_ids = [0, 1]
layers = 2
[data]
synthetic_samples = 3000
min_len = 16
max_len = 64
[target]
token_budget = 256
[drafter]
checkpoint_every = 100
[dflash]
block_size = 8
num_anchors = 64
layers = 2
lr = 2e-2
eval_every = 0
TOML
cat > "$out/mid.toml" <<'TOML'
[model]
layers = 3
[data]
synthetic_samples = 240
min_len = 32
max_len = 128
[target]
token_budget = 512
[drafter]
checkpoint_every = 100
[dflash]
block_size = 8
num_anchors = 8
layers = 1
eval_every = 0
TOML
# The drafters' mean share of each phase over a run's ticks.
phases() { python3 scripts/py/phases.py "$1"; }
for m in tiny mid; do
    model=$tiny; [ $m = mid ] && model=$mid
    for r in $(seq "$rounds"); do
        rm -rf "$out/run-$m"
        $bin/launcher --targets 0-4 --drafters 5-7 --model "$model" --config "$out/$m.toml" \
            --run-dir "$out/run-$m" >/dev/null 2>&1
        tps=$(python3 -c "import json;print(round(json.load(open('$out/run-$m/summary.json'))['tokens_per_s']))")
        echo "$m round $r pipeline 5x3: $tps tokens/s; drafters' phases $(phases "$out/run-$m")"
        echo "$m round $r one process: $($bin/bench-dflash --model "$model" --config "$out/$m.toml")"
    done
done
