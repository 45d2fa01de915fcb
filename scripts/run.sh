#!/usr/bin/env bash
# The README's run command: fetches the crates if needed (scripts/deps.sh), then runs the
# launcher in release mode with the arguments given, e.g.
#   scripts/run.sh --targets 0-4 --drafters 5-7
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
# The launcher runs the worker binaries beside it: build them too, so stale ones never run.
cargo build --quiet --release -p launcher -p target-worker -p drafter-worker
exec target/release/launcher "$@"
