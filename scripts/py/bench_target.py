"""The real target's forward + capture on the CPU: hspipe (candle) beside PyTorch (HF
transformers, eager and sdpa attention), same weights, same threads, interleaved round by round.

Each round runs `bench-target` (a subprocess: hspipe's target code, timed in-process) and then
transformers in this process, each timing `reps` forwards after a warm-up and reporting the
median. The work is the same: every layer's output, the captured layers (SpecForge's rule, as
hspipe's) stacked [tokens, layers, hidden] and cast to bf16, and the greedy token at every
position (argmax of the LM head). Prints each round and the medians and ratios over rounds.

    .venv-bench/bin/python scripts/py/bench_target.py --model /tmp/mid --threads 2 --rounds 5

On a GPU (`--device cuda`, the GPU machine's python3 and the CUDA build's bench-target): both
compute in bf16 and both copy the captured states and greedy tokens to the host, so the work
is the same as the worker's. `--random` makes both models' weights on the device from the
directory's config.json alone (`scripts/shapes/qwen3-8b`: nothing downloaded):

    python3 scripts/py/bench_target.py --device cuda --random --model scripts/shapes/qwen3-8b \
        --bin target/cuda/release/bench-target --shapes 2048x4 --rounds 3

On a GPU our attention is the fused kernel (one per layer, `cuda::attention`); `--blocked-too`
also times ours with candle's blocked matrix products (HSPIPE_TARGET_ATTENTION=blocked) in each
round, so the kernel's gain is measured side by side too, and `--plain-too` with the kernel's
plain form (HSPIPE_TARGET_ATTENTION=plain), the ldmatrix form's gain.

A side of ours that fails (exit status not 0) is dropped from the later rounds, named with its
last line of stderr in the JSON's `failed`, and the script exits 1 after printing what the other
sides measured: every side of ours that ran is in `over_eager` and `over_sdpa`.

torch comes from PyPI into a benchmark venv (`scripts/bench-target.sh` makes it); CI never
needs it.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def layer_ids(n_layers, n_draft=5):
    if n_draft == 1:
        return [n_layers // 2]
    return [int(round(1 + i * (n_layers - 4) / (n_draft - 1))) for i in range(n_draft)]


def torch_rate(model, ids, reps, capture):
    times = []
    with torch.inference_mode():
        for rep in range(reps + 1):
            t0 = time.perf_counter()
            out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
            states = torch.stack([out.hidden_states[i + 1] for i in capture], dim=2)
            states = states.to(torch.bfloat16).contiguous()
            greedy = out.logits.argmax(-1)
            if ids.is_cuda:
                # What the worker does with them: into host memory (this also waits for the GPU).
                states, greedy = states.cpu(), greedy.cpu()
            _ = (states.sum(), greedy.sum())
            if rep > 0:
                times.append(time.perf_counter() - t0)
    return ids.numel() / statistics.median(times)


def load(a, impl):
    if not a.random:
        dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
        m = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype, attn_implementation=impl)
        return m.to(a.device).eval()
    cfg = AutoConfig.from_pretrained(a.model)
    torch.manual_seed(0)
    with torch.device(a.device):
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation=impl)
    return m.eval()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--bin", default="target/release/bench-target")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--shapes", default="512x8,1024x4,2048x2", help="seq_len x batch, comma-separated")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--random", action="store_true", help="weights made on the device from config.json")
    p.add_argument("--blocked-too", action="store_true",
                   help="also run hspipe with its blocked attention each round (HSPIPE_TARGET_ATTENTION=blocked)")
    p.add_argument("--plain-too", action="store_true",
                   help="also run hspipe with its attention kernel's plain form each round (HSPIPE_TARGET_ATTENTION=plain)")
    p.add_argument("--glibc-too", action="store_true",
                   help="also run hspipe with glibc's malloc defaults each round (bench-target --glibc-malloc)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    models = {impl: load(a, impl) for impl in ("eager", "sdpa")}
    capture = layer_ids(models["eager"].config.num_hidden_layers)
    vocab = models["eager"].config.vocab_size
    env = {"RAYON_NUM_THREADS": str(a.threads), "PATH": "/usr/bin:/bin"}
    # The CUDA build's libraries (scripts/cuda-env.sh), the same GPU as torch's, and HOME for
    # the driver's PTX cache.
    for k in ("LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "HOME", "HSPIPE_TARGET_ATTENTION"):
        if k in os.environ:
            env[k] = os.environ[k]
    extra = (["--device", a.device] if a.device != "cpu" else []) + (["--random"] if a.random else [])
    failed = {}
    for shape in a.shapes.split(","):
        seq, batch = (int(x) for x in shape.split("x"))
        ids = torch.arange(seq * batch).mul(7919).remainder(vocab).reshape(batch, seq).to(a.device)
        ours = {"hspipe": ([], {})}
        if a.blocked_too:
            ours["hspipe-blocked"] = ([], {"HSPIPE_TARGET_ATTENTION": "blocked"})
        if a.plain_too:
            ours["hspipe-plain"] = ([], {"HSPIPE_TARGET_ATTENTION": "plain"})
        if a.glibc_too:
            ours["hspipe-glibc"] = (["--glibc-malloc"], {})
        rates = {k: [] for k in ours} | {"eager": [], "sdpa": []}
        attention = {}
        for r in range(a.rounds):
            for side, (flags, more_env) in ours.items():
                if side in failed.get(shape, {}):
                    continue
                run = subprocess.run(
                    [a.bin, "--model", a.model, "--seq-len", str(seq), "--batch", str(batch), "--reps", str(a.reps)]
                    + extra + flags,
                    capture_output=True, text=True, env=env | more_env,
                )
                if run.returncode != 0:
                    # One side failing (say, the attention kernel faulting on a GPU) leaves the
                    # others' figures worth having: it is dropped, said here and in the JSON,
                    # and the script's exit status is 1.
                    said = (run.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
                    failed.setdefault(shape, {})[side] = f"exit {run.returncode}: {said}"
                    print(f"  {shape} round {r + 1}: {side} failed, the other sides go on: "
                          f"{failed[shape][side]}", file=sys.stderr, flush=True)
                    continue
                line = json.loads(run.stdout)
                rates[side].append(line["tokens_per_s"])
                attention[side] = line.get("attention", "blocked")
            for impl, m in models.items():
                rates[impl].append(torch_rate(m, ids, a.reps, capture))
            print(f"  {shape} round {r + 1}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in rates.items() if v),
                  flush=True)
        print(json.dumps(figures(shape, rates, failed.get(shape, {}))
                         | {"threads": a.threads, "device": a.device, "attention": attention}), flush=True)
    sys.exit(1 if failed else 0)


def ratio(rates, a, b):
    """The median over rounds of `a`'s rate over `b`'s (round by round), or None without both."""
    pairs = list(zip(rates.get(a, []), rates.get(b, [])))
    return round(statistics.median(x / y for x, y in pairs), 3) if pairs else None


def figures(shape, rates, failed):
    """One shape's medians and side-by-side ratios: every side of ours that ran over eager and
    over sdpa, the fused kernel over each other side of ours, and what failed."""
    ours = [k for k in rates if k.startswith("hspipe") and rates[k]]
    out = {
        "shape": shape,
        "tokens_per_s_median": {k: round(statistics.median(v), 1) for k, v in rates.items() if v},
        "over_eager": {k: ratio(rates, k, "eager") for k in ours},
        "over_sdpa": {k: ratio(rates, k, "sdpa") for k in ours},
    }
    if rates.get("hspipe"):
        out["hspipe_over_eager"] = ratio(rates, "hspipe", "eager")
        out["hspipe_over_sdpa"] = ratio(rates, "hspipe", "sdpa")
        for other in ("blocked", "plain", "glibc"):
            if rates.get(f"hspipe-{other}"):
                out[f"hspipe_over_{other}"] = ratio(rates, "hspipe", f"hspipe-{other}")
    if failed:
        out["failed"] = failed
    return out


if __name__ == "__main__":
    main()
