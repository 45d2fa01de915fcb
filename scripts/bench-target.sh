#!/usr/bin/env bash
# The real target's forward + capture on the CPU, hspipe (candle) beside PyTorch (HF
# transformers, eager and sdpa), same weights and threads (BENCHMARKS.md, "Real target on the
# CPU"). Makes a benchmark venv with torch and transformers from PyPI (several GB; never needed
# by CI) and a mid-size random model (8 layers, hidden 512, vocabulary 32000).
#   scripts/bench-target.sh [THREADS] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${1:-2}
rounds=${2:-5}
venv=.venv-bench
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check torch transformers safetensors
fi
cargo build --release -p launcher -p scripts --bin launcher --bin bench-target
model=${BENCH_MODEL:-/tmp/hspipe-bench-mid}
if [ ! -f "$model/config.json" ]; then
    ./target/release/launcher make-model "$model" --layers 8 --hidden 512 --heads 8 --kv-heads 4 \
        --head-dim 64 --intermediate 1536 --vocab 32000 --seed 1
fi
"$venv/bin/python" scripts/py/bench_target.py --model "$model" --threads "$threads" --rounds "$rounds"
