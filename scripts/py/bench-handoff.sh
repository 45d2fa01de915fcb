#!/usr/bin/env bash
# BENCHMARKS.md, "Python workers": the hand-off of a 64 MiB batch, seen from a Python drafter
# (take + release; take + views of every section + release) against a Rust drafter on the same
# calls (scripts/src/bin/bench-handoff.rs: take, verify, ledger line, release), in alternating
# 1x1 runs fed by the same Python target; then the predecessor's multiprocessing.Queue moving
# 64 MiB (scripts/py/baseline.py), for scale. Needs the hspipe package in PYTHON's environment
# (scripts/py/build-wheel.sh PYTHON) and built binaries in BIN (default target/debug:
# cargo build -p launcher -p scripts --bin bench-handoff).
# Each drafter drains the ring twice (12 slots, 24 batches): cold (each slot's pages touched
# by the drafter for the first time) and warm (the same slots again, as in a long run).
# Usage: scripts/py/bench-handoff.sh [ROUNDS]   (default 3)
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${PYTHON:-$PWD/.venv/bin/python}
bin=${BIN:-target/debug}
rounds=${1:-3}
slots=12
n=$((2 * slots))
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
run() {   # run NAME DRAFTER_COMMAND: one 1x1 run; its results stay in $dir/NAME
    cat >"$dir/$1.toml" <<TOML
[ring]
slots = $slots
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
command = $2
TOML
    timeout 300 "$bin/launcher" --targets 0 --drafters 1 --config "$dir/$1.toml" \
        --run-dir "$dir/$1" --monitor 5 >/dev/null
}
for r in $(seq "$rounds"); do
    run "py-$r" "[\"$py\", \"$PWD/python/bench/handoff.py\"]"
    run "rust-$r" "[\"$PWD/$bin/bench-handoff\"]"
done
"$py" - "$dir" "$rounds" <<'PY'
import json, statistics, sys
d, rounds = sys.argv[1], int(sys.argv[2])
rows = [(f"{phase}: {who}", kind, f"{phase}_{key}")
        for phase in ("warm", "cold")
        for who, kind, key in [
            ("Rust drafter, take + verify + ledger + release", "rust", "take_release_s"),
            ("Python drafter, take + release", "py", "take_release_s"),
            ("Python drafter, take + views of every section + release", "py",
             "take_view_release_s")]]
print("| per 64 MiB batch, median | " + " | ".join(f"round {r}" for r in range(1, rounds + 1))
      + " | batches/s (all rounds) | share of a 1 s step |")
print("|---" * (rounds + 3) + "|")
for what, kind, key in rows:
    per, everything = [], []
    for r in range(1, rounds + 1):
        name = "handoff-rust.json" if kind == "rust" else "handoff.json"
        xs = json.load(open(f"{d}/{kind}-{r}/{name}"))[key]
        per.append(statistics.median(xs))
        everything += xs
    med = statistics.median(everything)
    print(f"| {what} | " + " | ".join(f"{m * 1e3:.1f} ms" for m in per)
          + f" | {1 / med:.0f} | {med * 100:.2f}% |")
PY
echo
echo "multiprocessing.Queue, for scale (scripts/py/baseline.py --runs 3 --sizes 64M):"
"$py" scripts/py/baseline.py --runs 3 --sizes 64M
