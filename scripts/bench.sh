#!/usr/bin/env bash
# Every benchmark of BENCHMARKS.md, in order. Takes about 40 minutes on the 2-core machine (the drafter group's runs, 22).
# Run on an otherwise idle machine: the figures are medians, but a busy neighbour still shows.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
cargo build --release -p scripts
command -v python3 >/dev/null || { echo "error: python3 is needed for the Python baseline" >&2; exit 1; }
echo "## transport";           ./target/release/bench-transport --runs 5 --sizes 4K,1M,64M,256M
echo "## pipeline balance";    ./target/release/bench-balance --runs 5
echo "## drafter group (default data, then long-heavy)"
./target/release/bench-balance --runs 3 --samples 30000 --show-tenths
./target/release/bench-balance --runs 3 --samples 40000 --long-heavy --show-tenths
echo "## Python baseline";     python3 scripts/py/baseline.py --runs 5 --sizes 4K,1M,64M
echo "## idle cost";           ./target/release/bench-idle --runs 5 --seconds 3
