"""The hand-off cost seen from Python (BENCHMARKS.md, "Python workers"): run as both workers
of a 1x1 run by scripts/py/bench-handoff.sh. The target publishes 64 MiB batches (their
contents do not matter: nothing trains). The drafter lets the ring fill, drains it (each slot
touched for the first time by this process: "cold"), lets it fill again and drains it again
(the same slots, their pages mapped already: "warm", as in a long run), timing each batch:
take (with its checksum, as our drafters verify) + release alone, or take + views of every
section (numpy.from_dlpack and numpy.asarray, a first and last byte read) + release,
alternately. Writes <run-dir>/handoff.json; bench-handoff.rs is the Rust drafter's twin."""
import json
import os
import sys
import time

import numpy as np

import hspipe


def target(w):
    for claim in w:
        slot = claim.reserve()
        if slot is None:
            break
        slot.commit()


def drafter(w):
    fill = float(os.environ.get("HANDOFF_FILL_S", "4"))
    slots = w.config["ring"]["slots"]
    time.sleep(fill)                     # let the ring fill
    times = {"cold": ([], []), "warm": ([], [])}
    nbytes = 0
    i = 0
    while True:
        if i == slots:
            time.sleep(fill)             # and fill again, into the slots drained once
        bare, viewed = times["cold" if i < slots else "warm"]
        t0 = time.perf_counter()
        b = w.take()
        if b is None:
            if w.ended:
                break
            continue
        if i % 2:
            h = np.from_dlpack(b.input_ids)
            s = np.asarray(b.hidden_states)          # uint16 bit patterns of bf16
            m = np.from_dlpack(b.loss_mask)
            t = np.asarray(b.target_tokens)
            _ = int(s.reshape(-1)[0]) + int(s.reshape(-1)[-1]) + int(h[0]) + int(m[0]) + int(t[0])
            nbytes = s.nbytes
            del h, s, m, t
        b.release()
        (viewed if i % 2 else bare).append(time.perf_counter() - t0)
        i += 1
    out = {"batch_bytes": nbytes}
    for phase, (bare, viewed) in times.items():
        out[f"{phase}_take_release_s"] = bare
        out[f"{phase}_take_view_release_s"] = viewed
    with open(os.path.join(w.run_dir, "handoff.json"), "w") as f:
        json.dump(out, f)


def main():
    with hspipe.connect() as w:
        (target if w.role == "target" else drafter)(w)
        sys.exit(w.close())


if __name__ == "__main__":
    main()
