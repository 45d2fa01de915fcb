#!/usr/bin/env bash
# The README's run command: builds and runs the launcher in release mode with the arguments
# given, e.g.
#   scripts/run.sh --targets 0-4 --drafters 5-7
# It runs the launcher in the caller's directory, so the paths given (`--data chats.jsonl`,
# `report runs/ID`) and the defaults (`runs/`, `data-cache/`) are the caller's, as with the
# launcher itself.
set -euo pipefail
# The script's own place, through any symlink to it (one in ~/bin, say).
repo=$(CDPATH='' cd -- "$(dirname -- "$(readlink -f -- "$0")")/.." && pwd)
# Cargo reads a relative CARGO_TARGET_DIR against the directory it runs in, and the caller
# meant theirs: made absolute here, the build below (run from the repository) puts the launcher
# where the caller's own `cargo build` would.
if [ -n "${CARGO_TARGET_DIR:-}" ] && [ "${CARGO_TARGET_DIR#/}" = "$CARGO_TARGET_DIR" ]; then
    export CARGO_TARGET_DIR="$PWD/$CARGO_TARGET_DIR"
fi
# The launcher runs its workers as itself (hidden subcommands): it is the only binary needed.
# Built from the repository, in a subshell: cargo then finds the same configuration as a build
# there would, not a `.cargo/config.toml` of the caller's directory that could move its output.
(cd "$repo" && cargo build --quiet --release -p launcher)
# Where cargo put it: a CARGO_TARGET_DIR set in the shell moves it, and target/ would then hold
# no launcher, or a stale one from before the variable was set.
exec "${CARGO_TARGET_DIR:-$repo/target}/release/launcher" "$@"
