#!/usr/bin/env bash
# The whole test suite: every crate's tests, then the loom models of the ring's state machine.
# Usage: scripts/test.sh            (from the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."

# The screen tests run shm-ring-stat and the launcher in a real terminal: tmux's.
if ! command -v tmux >/dev/null; then
    echo "== installing tmux (the screen tests' terminal)"
    if [ "$(id -u)" = 0 ]; then sudo=; else sudo=sudo; fi
    $sudo apt-get install -y -q tmux >/dev/null 2>&1 ||
        { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q tmux >/dev/null; } || {
        echo "error: the screen tests need tmux, and apt-get could not install it" >&2
        exit 1
    }
fi

# The data tests make Parquet and HF `datasets` fixtures and check that pyarrow reads the Arrow
# files we write (hspipe itself runs no Python). Both come from PyPI into the project's own
# venv, .venv (made once; a re-run only compares the requirements file).
venv=.venv
req=scripts/py/requirements.txt
if ! { [ -x "$venv/bin/python" ] && cmp -s "$req" "$venv/.hspipe-requirements"; }; then
    echo "== Python venv $venv with $(grep -v '^#' "$req" | tr '\n' ' ')"
    python3 -m venv "$venv" || {
        echo "error: the data tests need Python 3 with its venv module (apt-get install python3-venv)" >&2
        exit 1
    }
    "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$req" || {
        echo "error: could not install $req into $venv (is PyPI reachable?)" >&2
        exit 1
    }
    cp "$req" "$venv/.hspipe-requirements"
fi
# The data tests run their fixtures and checks with this interpreter.
export HSPIPE_PYTHON="$PWD/$venv/bin/python"

# The end-to-end tests run the real launcher and worker binaries, which `cargo test` alone does
# not build for another crate's tests: build them first.
echo "== cargo build --workspace --bins"
cargo build --workspace --bins
# The hspipe Python package (python/), built into this venv and tested with pytest: its workers
# run through the launcher and shm-ring-stat just built. (Its torch tests, test_torch.py, need
# torch, which CI does not install: scripts/py/torch-check.sh runs them.)
scripts/py/build-wheel.sh "$venv/bin/python"
echo "== pytest python/tests/test_workers.py"
"$venv/bin/python" -m pytest -q -p no:cacheprovider python/tests/test_workers.py
echo "== cargo test --workspace"
cargo test --workspace

# loom explores every interleaving of the slot state machine, the close broadcast, recovery, the
# work table with a producer killed at each step, registration and requeue (shm-ring/src/model.rs), and
# the drafter group's collective (collective/src/model.rs), both on shmem::sync's one model of a futex.
# One more in shm-ring: the phase clock's seqlock (phase_clock.rs, `phase_clock::model`).
# Two preemptions keep it to about a minute; its own target dir keeps the
# --cfg loom build from invalidating the normal one.
echo "== loom models (LOOM_MAX_PREEMPTIONS=2)"
RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 CARGO_TARGET_DIR=target/loom \
    cargo test -p shm-ring -p collective --release --lib model
