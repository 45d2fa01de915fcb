"""The drafters' mean share of each phase over a run's monitor ticks (metrics.jsonl), for the
benchmark scripts.

    python3 scripts/py/phases.py RUN_DIR            # {"compute": 0.84, ...} as JSON
    python3 scripts/py/phases.py RUN_DIR copy_in compute   # "copy_in 0.1% compute 84.2%"
"""

import json
import sys


def shares(run_dir):
    acc, n = {}, 0
    for line in open(run_dir + "/metrics.jsonl"):
        t = json.loads(line)
        ds = [w for w in t.get("workers", []) if w["name"].startswith("drafter") and w.get("state") == "alive"]
        if not ds:
            continue
        n += 1
        for w in ds:
            for p, v in w.get("phases", {}).items():
                acc[p] = acc.get(p, 0.0) + v / len(ds)
    return {p: v / max(n, 1) for p, v in sorted(acc.items())}


if __name__ == "__main__":
    s = shares(sys.argv[1])
    if len(sys.argv) > 2:
        print(" ".join(f"{p} {s.get(p, 0.0) * 100:.1f}%" for p in sys.argv[2:]))
    else:
        print(json.dumps({p: round(v, 4) for p, v in s.items()}))
