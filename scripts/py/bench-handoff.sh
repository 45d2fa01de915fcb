#!/usr/bin/env bash
# BENCHMARKS.md, "Python workers": the hand-off of a 64 MiB batch seen from a Python drafter
# (take, views, release), against the same take and release without views (the path our own
# drafters run). Needs the hspipe package in .venv (scripts/py/build-wheel.sh) and a built
# launcher (cargo build --release -p launcher; set LAUNCHER to use another).
# Usage: scripts/py/bench-handoff.sh [BATCHES]   (default 15; the ring holds one more)
set -euo pipefail
cd "$(dirname "$0")/../.."
py=$PWD/.venv/bin/python
launcher=${LAUNCHER:-target/release/launcher}
n=${1:-15}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cat >"$dir/handoff.toml" <<TOML
[ring]
slots = $((n + 1))
min_ready = 1
[model]
layers = 4
hidden = 4096
[data]
synthetic_samples = $n
min_len = 2048
max_len = 2048
[target]
token_budget = 2048
command = ["$py", "$PWD/python/bench/handoff.py"]
[drafter]
params = 4096
command = ["$py", "$PWD/python/bench/handoff.py"]
TOML
timeout 300 "$launcher" --targets 0 --drafters 1 --config "$dir/handoff.toml" --run-dir "$dir/run" --monitor 5 >/dev/null
"$py" - "$dir/run/handoff.json" <<'PY'
import json, statistics, sys
r = json.load(open(sys.argv[1]))
mib = r["batch_bytes"] / 2**20
for key, what in [("take_release_s", "take + release (our drafters' path)"),
                  ("take_view_release_s", "take + views of every section + release (Python)")]:
    xs = r[key]
    med = statistics.median(xs)
    print(f"{what}: {len(xs)} batches of {mib:.0f} MiB hidden states, median {med*1e3:.2f} ms "
          f"= {1/med:.0f} batches/s = {med/1.0*100:.3f}% of a 1 s step")
PY
