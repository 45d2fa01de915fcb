#!/usr/bin/env bash
# Every benchmark of BENCHMARKS.md, in order. Takes about 45 minutes on the 2-core machine (the
# drafter group's runs take 22; more with BASELINE_LAUNCHER: the old JSONL path takes a minute a
# launch at 600 MB).
# Run on an otherwise idle machine: the figures are medians, but a busy neighbour still shows.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p scripts
command -v python3 >/dev/null || { echo "error: python3 is needed for the Python baseline" >&2; exit 1; }
echo "## transport";           ./target/release/bench-transport --runs 5 --sizes 4K,1M,64M,256M
echo "## pipeline balance";    ./target/release/bench-balance --runs 5
echo "## drafter group (default data, then long-heavy)"
./target/release/bench-balance --runs 3 --samples 30000 --show-tenths
./target/release/bench-balance --runs 3 --samples 40000 --long-heavy --show-tenths
echo "## Python baseline";     python3 scripts/py/baseline.py --runs 5 --sizes 4K,1M,64M
echo "## idle cost";           ./target/release/bench-idle --runs 5 --seconds 3
# Data at scale: prepare and launch on generated JSONL of 60 and 600 MB (3 GB by hand, see
# BENCHMARKS.md). BASELINE_LAUNCHER=path/to/launcher compares with another build (the figures
# compare with commit cc08f19, before the prepared data).
cargo build --release -p launcher
for mb in 60 600; do
    echo "## data at scale: $mb MB"
    ./target/release/bench-data gen --mb "$mb" --out "/tmp/hspipe-bench-$mb.jsonl"
    ./target/release/bench-data run --data "/tmp/hspipe-bench-$mb.jsonl" --runs 3 \
        ${BASELINE_LAUNCHER:+--baseline "$BASELINE_LAUNCHER"}
    rm -f "/tmp/hspipe-bench-$mb.jsonl"
done
echo "## the synthetic data made when read"
./target/release/bench-data synthetic --samples 400000 --runs 3 \
    ${BASELINE_LAUNCHER:+--baseline "$BASELINE_LAUNCHER"}
echo "## a week of metrics: launcher report"
cargo build --release -p launcher
./target/release/bench-report --runs 5
echo "## the DFlash drafter on the CPU"; scripts/bench-dflash.sh 3
echo "## conversations against transformers"; scripts/bench-chat.sh 5000 5
