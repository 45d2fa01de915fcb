"""The figures of a `scripts/gpu-check.sh` run, read from its output directory, as BENCHMARKS.md
quotes them: medians over the rounds, and ratios measured side by side (the median of each
round's ratio beside the ratio of the medians).

    python3 scripts/py/gpu_check_summary.py DIR

DIR is the run's $GPU_CHECK_OUT (the files a device call brings back). Reads, where present:
dflash-step.log (the `dflash` step: ours, ours-released, ours-parts-2^28 and torch lines, and
what the check's time budget skipped),
dflash-tf32.log (the `dflash-tf32` step) and speed.log (the `speed` step's JSON lines). Prints
one JSON object, and exits 1 if DIR has none of them. Standard library only.
"""

import json
import os
import statistics
import sys


# How many of each traced pass's longest kernels the summary keeps.
KERNELS = 8


def lines_of(path):
    """`(label, value)` of each `label {json}` line; a label whose run failed keeps its text."""
    out = []
    with open(path) as f:
        for line in f:
            label, _, rest = line.strip().partition(" ")
            if not label:
                continue
            try:
                out.append((label, json.loads(rest)))
            except json.JSONDecodeError:
                out.append((label, rest))
    return out


def median(xs):
    return statistics.median(xs) if xs else None


def ratio(a, b):
    return a / b if a is not None and b else None


def dflash(path):
    """Ours against torch, round by round (a round is an `ours` line and the `torch` after it)."""
    ours, torch, extra, skipped = [], [], {}, []
    for label, v in lines_of(path):
        if label == "ours" and isinstance(v, dict):
            ours.append(v)
        elif label == "torch" and isinstance(v, dict):
            torch.append(v)
        elif label == "skipped":
            skipped.append(v)
        else:
            extra[label] = v
    rounds = list(zip(ours, torch))
    out = {
        "rounds": len(rounds),
        # Runs the check's time budget left out (`skipped rounds 2-3 (...)`), as it said.
        "skipped": skipped,
        "ours_step_s": [o["step_s"] for o in ours],
        "torch_step_s": [t["step_s"] for t in torch],
    }
    for key in ("step_s", "gradient_s", "update_s", "digest_s"):
        out[f"ours_{key}_median"] = median([o[key] for o in ours if o.get(key) is not None])
    for key in ("step_s", "gradient_s"):
        out[f"torch_{key}_median"] = median([t[key] for t in torch if t.get(key) is not None])
    # Speed: torch's time over ours (above 1, ours is faster).
    out["speed_ours_over_torch_median_of_rounds"] = median([t["step_s"] / o["step_s"] for o, t in rounds])
    out["speed_ours_over_torch_of_medians"] = ratio(out["torch_step_s_median"], out["ours_step_s_median"])
    if ours:
        first = ours[0]
        for key in ("parts", "scores", "scores_whole_context", "context_per_group", "attention", "tf32", "init_s"):
            if key in first:
                out[key] = first[key]
        if isinstance(first.get("traced"), dict):
            out["traced"] = {k: v for k, v in first["traced"].items() if not isinstance(v, (list, dict))}
            # The trace's device time kernel by kernel, each pass's longest (CUPTI, on a GPU).
            kernels = first["traced"].get("kernels")
            if isinstance(kernels, dict):
                out["kernels"] = {
                    p: {**{k: v for k, v in t.items() if k != "longest"}, "longest": t.get("longest", [])[:KERNELS]}
                    for p, t in kernels.items() if isinstance(t, dict)
                }
    if torch:
        out["torch_peak_gib"] = torch[0].get("peak_gib")
        out["torch_version"] = torch[0].get("torch")
    # Round one's ours traced its gradient before its timed steps, in the same process (CUPTI
    # loaded, recording nothing): its step against the untraced rounds' median shows what that
    # cost, and the extra runs of ours (untraced processes) are set against the untraced
    # rounds, or against round one, said, when it is the only round.
    traced = [o for o in ours if isinstance(o.get("traced"), dict)]
    untraced = [o["step_s"] for o in ours if not isinstance(o.get("traced"), dict)]
    if traced and untraced:
        out["ours_traced_over_untraced"] = ratio(traced[0]["step_s"], median(untraced))
    base, against = (median(untraced), "untraced rounds' median") if untraced else (out["ours_step_s_median"], "round one, traced")
    for label, v in extra.items():
        if isinstance(v, dict):
            out[label] = {
                "step_s": v.get("step_s"),
                "gradient_s": v.get("gradient_s"),
                "parts": v.get("parts"),
                "over_ours": ratio(v.get("step_s"), base),
                "ours": against,
            }
        else:
            out[label] = {"failed": v}
    return out


def tf32(path, f32):
    """Each side with TF32, against its f32 median from the `dflash` step of the same run."""
    out = {}
    for label, v in lines_of(path):
        if not isinstance(v, dict):
            out[label] = {"failed": v}
            continue
        side = "ours" if label.startswith("ours") else "torch"
        base = (f32 or {}).get(f"{side}_step_s_median")
        out[label] = {"step_s": v.get("step_s"), "over_f32_median": ratio(v.get("step_s"), base)}
    return out


def speed(path):
    """The `speed` step's JSON lines (one per shape compared)."""
    found = []
    for line in open(path):
        line = line.strip()
        if line.startswith("{"):
            try:
                found.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return found


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(64)
    d = sys.argv[1]
    at = lambda name: os.path.join(d, name)
    summary = {}
    if os.path.exists(at("dflash-step.log")):
        summary["dflash"] = dflash(at("dflash-step.log"))
    if os.path.exists(at("dflash-tf32.log")):
        summary["dflash_tf32"] = tf32(at("dflash-tf32.log"), summary.get("dflash"))
    if os.path.exists(at("speed.log")):
        summary["speed"] = speed(at("speed.log"))
    if not summary:
        print(f"gpu_check_summary: no dflash-step.log, dflash-tf32.log or speed.log in {d}", file=sys.stderr)
        sys.exit(1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
