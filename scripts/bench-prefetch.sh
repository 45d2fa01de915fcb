#!/usr/bin/env bash
# The drafter's prefetch (BENCHMARKS.md, "The drafter's prefetch"): ROUNDS alternating mock runs
# with `[drafter] prefetch` on and off, on batches big enough for their checksum to matter
# (hidden 4096 x 3 captured layers in bf16, 4096 tokens: 96 MiB a batch), the drafter the
# bottleneck (two fast targets, one drafter). Prints each run's tokens/s and the drafter's share
# of time in copy_in (waiting for its batch to be verified) and compute.
#   scripts/bench-prefetch.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
cargo build --release -p launcher --bin launcher
bin=./target/release
out=${BENCH_OUT:-/tmp/hspipe-bench-prefetch}
mkdir -p "$out"
for p in true false; do
    cat >"$out/prefetch-$p.toml" <<TOML
[ring]
slots = 12
min_ready = 2
[model]
layers = 3
hidden = 4096
[data]
synthetic_samples = 600
min_len = 512
max_len = 1024
[target]
token_budget = 4096
tokens_per_s = 400000.0
[drafter]
tokens_per_s = 58000.0
checkpoint_every = 1000
prefetch = $p
TOML
done
# The drafter's mean share of copy_in and compute over the run's ticks.
phases() { python3 scripts/py/phases.py "$1" copy_in compute wait_empty; }
for r in $(seq "$rounds"); do
    for p in true false; do
        rm -rf "$out/run"
        $bin/launcher --targets 0-1 --drafters 2 --backend mock --config "$out/prefetch-$p.toml" \
            --run-dir "$out/run" --monitor 0.5 >/dev/null 2>&1
        tps=$(python3 -c "import json;print(round(json.load(open('$out/run/summary.json'))['tokens_per_s']))")
        echo "round $r prefetch=$p: $tps tokens/s; drafter: $(phases "$out/run")"
    done
done
