#!/usr/bin/env bash
# The torch check of the hspipe package (not in CI, which has no torch): three torch drafters
# on the CPU (python/examples/torch_drafter.py, torch.from_dlpack) train from our mock targets
# through the launcher; prints the run's summary line and the leader's first and last losses.
# Usage: scripts/py/torch-check.sh PYTHON   (a Python 3.11+ with torch, numpy and maturin)
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${1:?usage: scripts/py/torch-check.sh PYTHON (with torch, numpy and maturin)}
"$py" -c "import torch, numpy" || { echo "error: $py has no torch or numpy" >&2; exit 1; }
cargo build -p launcher
scripts/py/build-wheel.sh "$py"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cat >"$dir/torch.toml" <<TOML
[model]
layers = 2
hidden = 16
[data]
synthetic_samples = 400
max_len = 512
[target]
token_budget = 2048
[drafter]
params = 64
command = ["$py", "$PWD/python/examples/torch_drafter.py"]
TOML
target/debug/launcher --targets 0-4 --drafters 5-7 --config "$dir/torch.toml" --run-dir "$dir/run" --monitor 5 | tail -3
grep '^step' "$dir/run/logs/drafter-0.log" | sed -n '1p;$p'
