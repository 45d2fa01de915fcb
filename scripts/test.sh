#!/usr/bin/env bash
# The whole test suite: every crate's tests, then the loom models of the ring's state machine.
# Usage: scripts/test.sh            (from the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."

# The crates come from Debian's archive (crates.io is not reachable here): see scripts/deps.sh.
scripts/deps.sh

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

# The end-to-end tests run the real launcher and worker binaries, which `cargo test` alone does
# not build for another crate's tests: build them first.
echo "== cargo build --workspace --bins"
cargo build --workspace --bins
echo "== cargo test --workspace"
cargo test --workspace

# loom explores every interleaving of the slot state machine, the close broadcast, recovery, the
# work table with a producer killed at each step, and registration (shm-ring/src/model.rs), and
# the drafter group's collective (collective/src/model.rs). Two preemptions keep it to about a minute; its own target dir keeps the
# --cfg loom build from invalidating the normal one.
echo "== loom models (LOOM_MAX_PREEMPTIONS=2)"
RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 CARGO_TARGET_DIR=target/loom \
    cargo test -p shm-ring -p collective --release --lib model
