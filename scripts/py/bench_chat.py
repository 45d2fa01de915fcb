"""Conversations prepared per second: hspipe's `launcher prepare` against Python transformers'
apply_chat_template(..., tokenize=True, return_dict=True, return_assistant_tokens_mask=True),
on the same tokenizer, template and data, run in turn (BENCHMARKS.md, "Conversations").

  bench_chat.py make DIR N                 DIR/model (a 32k byte-level BPE trained on Python's
                                           standard library sources, the tests' Qwen-style
                                           template with {% generation %}) and DIR/chats.jsonl
  bench_chat.py python DIR [BATCH]         transformers on every record, BATCH conversations a
                                           call; prints {"conversations", "seconds", "per_s"}
  bench_chat.py compare DIR LAUNCHER ROUNDS  both in turn, ROUNDS times; medians and the ratio
  bench_chat.py encode DIR ROUNDS BIN...   the tokenizer alone: every conversation rendered
                                           (tokenize=False) into DIR/texts.json, then in turn
                                           Python's tokenizers on one thread, its encode_batch
                                           (all cores, what transformers calls), and each
                                           bench-tokenize BIN (ours, one thread)
"""
import glob
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEMPLATE = os.path.join(ROOT, "tests", "py", "chat", "qwen.jinja")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]


def corpus():
    """Lines of English and code: the standard library's sources, a fixed set on any Python."""
    lib = os.path.dirname(os.__file__)
    lines = []
    for p in sorted(glob.glob(os.path.join(lib, "*.py"))):
        with open(p, encoding="utf-8", errors="replace") as f:
            lines += [l.strip() for l in f if len(l.strip()) > 20]
    return lines


def make(out, n):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    os.makedirs(os.path.join(out, "model"), exist_ok=True)
    lines = corpus()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=32000, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(lines, trainer)
    m = os.path.join(out, "model")
    tok.save(os.path.join(m, "tokenizer.json"))
    shutil.copy(TEMPLATE, os.path.join(m, "chat_template.jinja"))
    with open(os.path.join(m, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
                   "pad_token": "<|endoftext|>", "bos_token": None}, f)
    rng = random.Random(1)

    def text(words):
        i = rng.randrange(len(lines))
        out = []
        while len(out) < words:
            out += lines[i % len(lines)].split()
            i += 1
        return " ".join(out[:words])

    with open(os.path.join(out, "chats.jsonl"), "w") as f:
        for _ in range(n):
            msgs = []
            if rng.random() < 0.5:
                msgs.append({"role": "system", "content": text(rng.randint(10, 40))})
            for _ in range(rng.randint(1, 4)):
                msgs.append({"role": "user", "content": text(rng.randint(20, 120))})
                answer = text(rng.randint(50, 300))
                if rng.random() < 0.2:
                    answer = "<think>\n" + text(rng.randint(20, 100)) + "\n</think>\n\n" + answer
                msgs.append({"role": "assistant", "content": answer})
            f.write(json.dumps({"messages": msgs}) + "\n")


def python_side(out, batch=1000):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.join(out, "model"))
    t = time.perf_counter()
    n = tokens = 0
    with open(os.path.join(out, "chats.jsonl")) as f:
        while True:
            convs = [json.loads(l)["messages"] for _, l in zip(range(batch), f)]
            if not convs:
                break
            o = tok.apply_chat_template(convs, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
            n += len(convs)
            tokens += sum(len(ids) for ids in o["input_ids"])
    dt = time.perf_counter() - t
    print(json.dumps({"conversations": n, "tokens": tokens, "seconds": dt, "per_s": n / dt}))


def compare(out, launcher, rounds):
    n = sum(1 for _ in open(os.path.join(out, "chats.jsonl")))
    ours_wall, ours_in, py_wall, py_in, pairs = [], [], [], [], []
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1")
    for r in range(rounds):
        t = time.perf_counter()
        said = subprocess.run([launcher, "prepare", os.path.join(out, "chats.jsonl"), "--model",
                               os.path.join(out, "model"), "-o", os.path.join(out, "chats.arrow")],
                              check=True, capture_output=True, text=True).stdout
        w = time.perf_counter() - t
        secs = float(re.search(r"prepared in ([0-9.]+) s", said).group(1))
        t = time.perf_counter()
        got = json.loads(subprocess.run([sys.executable, __file__, "python", out], check=True,
                                        capture_output=True, text=True, env=env).stdout)
        pw = time.perf_counter() - t
        ours_wall.append(w)
        ours_in.append(n / secs)
        py_wall.append(pw)
        py_in.append(got["per_s"])
        pairs.append((n / w) / (n / pw))
        print(f"round {r + 1}: hspipe {w:.2f} s ({n / secs:.0f} conv/s preparing), "
              f"transformers {pw:.2f} s ({got['per_s']:.0f} conv/s in apply_chat_template)", flush=True)
    med = statistics.median
    print(next(l for l in said.splitlines() if "prepared in" in l))
    print(f"{n} conversations, {got['tokens']} tokens, {os.cpu_count()} cores, {rounds} rounds (medians):")
    print(f"  hspipe launcher prepare   whole process {med(ours_wall):.2f} s = {n / med(ours_wall):.0f} conv/s;"
          f" preparing alone {med(ours_in):.0f} conv/s")
    print(f"  transformers (batch 1000) whole process {med(py_wall):.2f} s = {n / med(py_wall):.0f} conv/s;"
          f" apply_chat_template alone {med(py_in):.0f} conv/s")
    print(f"  ratio: whole process {med(pairs):.1f}x (median of pairs), "
          f"preparing against apply_chat_template alone {med(ours_in) / med(py_in):.1f}x")


def encode(out, rounds, bins):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.join(out, "model"))
    texts = [tok.apply_chat_template(json.loads(l)["messages"], tokenize=False)
             for l in open(os.path.join(out, "chats.jsonl"))]
    path = os.path.join(out, "texts.json")
    with open(path, "w") as f:
        json.dump(texts, f)
    tokenizer = os.path.join(out, "model", "tokenizer.json")
    sides = {"python tokenizers, one thread": [sys.executable, __file__, "encode-python", path,
                                               tokenizer, "one"],
             "python tokenizers, encode_batch": [sys.executable, __file__, "encode-python", path,
                                                 tokenizer, "batch"]}
    for b in bins:
        sides[f"ours, one thread ({b})"] = [b, tokenizer, path]
    got = {k: [] for k in sides}
    for r in range(rounds):
        for k, cmd in sides.items():
            env = dict(os.environ, TOKENIZERS_PARALLELISM="false" if cmd[-1] == "one" else "true")
            o = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True,
                                          env=env).stdout)
            got[k].append(o["seconds"])
    print(f"{len(texts)} rendered conversations, {o['tokens']} tokens, {rounds} rounds in turn:")
    for k, xs in got.items():
        print(f"  {k}: median {statistics.median(xs):.2f} s (runs {', '.join(f'{x:.2f}' for x in xs)})")


def encode_python(path, tokenizer, how):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer)
    texts = json.load(open(path))
    t = time.perf_counter()
    if how == "one":
        n = sum(len(tok.encode(x, add_special_tokens=False).ids) for x in texts)
    else:
        n = sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
    print(json.dumps({"seconds": time.perf_counter() - t, "tokens": n}))


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "make":
        make(sys.argv[2], int(sys.argv[3]))
    elif cmd == "python":
        python_side(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 1000)
    elif cmd == "compare":
        compare(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif cmd == "encode":
        encode(sys.argv[2], int(sys.argv[3]), sys.argv[4:])
    elif cmd == "encode-python":
        encode_python(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        sys.exit(f"bench_chat.py: unknown command {cmd!r} (make, python, compare, encode)")
