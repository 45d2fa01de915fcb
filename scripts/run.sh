#!/usr/bin/env bash
# The README's run command: builds and runs the launcher in release mode with the arguments
# given, e.g.
#   scripts/run.sh --targets 0-4 --drafters 5-7
set -euo pipefail
cd "$(dirname "$0")/.."
# The launcher runs its workers as itself (hidden subcommands): it is the only binary needed.
cargo build --quiet --release -p launcher
# Where cargo put it: a CARGO_TARGET_DIR set in the shell moves it, and target/ would then hold
# no launcher, or a stale one from before the variable was set.
exec "${CARGO_TARGET_DIR:-target}/release/launcher" "$@"
