#!/usr/bin/env bash
# Conversations prepared per second: hspipe's `launcher prepare --model DIR` against Python
# transformers' apply_chat_template(..., tokenize=True, return_dict=True,
# return_assistant_tokens_mask=True) on the same tokenizer, template and data, in turn
# (BENCHMARKS.md, "Conversations"). Uses the tests' venv (.venv, scripts/py/requirements.txt).
#   scripts/bench-chat.sh [CONVERSATIONS] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-20000}
rounds=${2:-5}
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
    .venv/bin/pip install -q --disable-pip-version-check -r scripts/py/requirements.txt
fi
cargo build --release -p launcher --bin launcher
dir=${BENCH_DIR:-/tmp/hspipe-bench-chat-$n}
if [ ! -f "$dir/chats.jsonl" ]; then
    .venv/bin/python scripts/py/bench_chat.py make "$dir" "$n"
fi
.venv/bin/python scripts/py/bench_chat.py compare "$dir" "$PWD/target/release/launcher" "$rounds"
