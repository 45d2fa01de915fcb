"""The numpy example drafter as a lone rank that keeps the step of its last update (as a
checkpoint would) and dies once, after step 5: restarted, it finds the group empty and joins
with `join(step=...)`, so the group goes on from that step instead of from 0. With the argument
`every4`, it keeps the step only every 4 steps (a checkpoint every 4): restarted, it joins with
step 4, and the update of step 5 is lost."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import hspipe  # noqa: E402
import numpy_drafter  # noqa: E402

DIES_AFTER = 5


class Checkpointed:
    def __init__(self, w, every=1):
        self._w = w
        self._every = every
        self._saved = Path(w.run_dir) / f"step-{w.name}"
        self._first = not self._saved.exists()

    def __getattr__(self, name):
        return getattr(self._w, name)

    def join(self):
        step = int(self._saved.read_text()) if self._saved.exists() else None
        return self._w.join(step=step)

    def all_reduce(self, data, **kwargs):
        r = self._w.all_reduce(data, **kwargs)
        if r.step % self._every == 0:
            self._saved.write_text(str(r.step))
        if self._first and r.step == DIES_AFTER:
            raise RuntimeError(f"dies after step {DIES_AFTER}")
        return r


def main():
    with hspipe.connect() as w:
        numpy_drafter.run(Checkpointed(w, 4 if sys.argv[1:] == ["every4"] else 1))
        sys.exit(w.close())


if __name__ == "__main__":
    main()
