#!/usr/bin/env bash
# Builds the hspipe Python package (python/, PyO3 + maturin, one abi3 wheel for CPython 3.11
# and newer) and installs it into the Python given (default: the repository's .venv, which
# scripts/test.sh makes with maturin in it).
# Usage: scripts/py/build-wheel.sh [PYTHON] [--release]
# The default dev profile shares the workspace's build (seconds once it is built); --release
# is for measuring and for users (minutes, its own optimised build).
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${1:-.venv/bin/python}
profile=dev
[ "${2:-}" = --release ] && profile=release
bindir=$(dirname "$py")
echo "== hspipe wheel ($profile) into $py"
rm -rf target/wheels
"$bindir/maturin" build --quiet --profile "$profile" --strip -m python/Cargo.toml -i "$py" -o target/wheels
"$py" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps target/wheels/hspipe-*.whl
