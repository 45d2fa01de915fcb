"""The device check's end-to-end verdict on a finished run directory (scripts/gpu-check.sh,
step e2e): every planned batch trained exactly once (summary.json, judged from the ledgers),
the loss falls (metrics.jsonl: the mean of the last fifth of the steps below the first fifth's),
and each worker's figures printed. Standard library only: it runs on the GPU machine's python3
and in CI.

    python3 scripts/py/e2e_check.py RUN_DIR [--json OUT]

Exit status 0 when every check holds, 1 naming the first that does not.
"""

import argparse
import json
import pathlib
import statistics
import sys


def main():
    p = argparse.ArgumentParser()
    p.add_argument("run_dir", type=pathlib.Path)
    p.add_argument("--json", type=pathlib.Path, help="writes the figures here")
    a = p.parse_args()
    summary = json.loads((a.run_dir / "summary.json").read_text())
    losses = []
    for line in (a.run_dir / "metrics.jsonl").read_text().splitlines():
        for s in json.loads(line).get("steps") or []:
            if s.get("loss") is not None:
                losses.append(s["loss"])
    fifth = max(1, len(losses) // 5)
    first = statistics.mean(losses[:fifth]) if losses else None
    last = statistics.mean(losses[-fifth:]) if losses else None
    figures = {
        "backend": summary["backend"],
        "ok": summary["ok"],
        "batches_total": summary["batches_total"],
        "batches_trained": summary["batches_trained"],
        "duplicated": summary["duplicated"],
        "steps": len(losses),
        "loss_first_fifth": first,
        "loss_last_fifth": last,
        "tokens_per_s": summary["tokens_per_s"],
        "wall_s": summary["wall_s"],
        "workers": [
            {k: w[k] for k in ("role", "index", "items", "tokens", "busy_frac")}
            for w in summary["workers"]
        ],
    }
    print(json.dumps(figures, indent=1))
    if a.json:
        a.json.write_text(json.dumps(figures) + "\n")
    checks = [
        (summary["ok"], "summary.json says the run is not ok (a batch lost or trained twice)"),
        (summary["batches_trained"] == summary["batches_total"],
         f"{summary['batches_trained']} batches trained of {summary['batches_total']}"),
        (summary["duplicated"] == 0, f"{summary['duplicated']} batches trained twice"),
        (len(losses) >= 10, f"only {len(losses)} steps reported a loss"),
        (first is not None and last is not None and last < first,
         f"the loss did not fall: {first} over the first fifth, {last} over the last"),
    ]
    for held, why in checks:
        if not held:
            print(f"e2e: FAILED: {why}", file=sys.stderr)
            return 1
    print(f"e2e: ok: {summary['batches_total']} batches trained once each; "
          f"loss {first:.3f} -> {last:.3f} over {len(losses)} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
