#!/usr/bin/env bash
# The torch check of the hspipe package (not in CI, which has no torch): pytest on
# python/tests/test_torch.py with a Python that has torch: hspipe.dist.TorchGroup (gloo on the
# CPU) with ranks inside an exchange when a rank leaves or dies, torch drafters
# (python/examples/torch_drafter.py, torch.from_dlpack) training as one group through the
# launcher, and one of them SIGKILLed and rejoining a new process group. Then the package's
# other tests (test_workers.py) with the same Python. Then the DFlash drafter's oracle: our
# step's loss and every gradient (bench-dflash-step --dump) against the same step in torch
# (scripts/py/dflash_step.py oracle, float64; needs safetensors too).
# Usage: scripts/py/torch-check.sh PYTHON   (a Python 3.11+ with torch, numpy, maturin, pytest)
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${1:?usage: scripts/py/torch-check.sh PYTHON (with torch, numpy, maturin and pytest)}
"$py" -c "import torch, numpy, pytest" || { echo "error: $py lacks torch, numpy or pytest" >&2; exit 1; }
cargo build -p launcher -p ring-stat
cargo build -p scripts --bin bench-dflash-step
scripts/py/build-wheel.sh "$py"
"$py" -c "import torch; print('torch', torch.__version__)"
"$py" -m pytest -q -p no:cacheprovider python/tests/test_torch.py python/tests/test_workers.py
step=$(mktemp -d)
target/debug/bench-dflash-step --dump "$step"
"$py" scripts/py/dflash_step.py oracle "$step"
rm -rf "$step"
