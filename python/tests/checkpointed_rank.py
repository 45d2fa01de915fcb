"""The numpy example drafter as a lone rank that saves its checkpoint (the example's own:
weights and step, by the leader) every step, and dies once, after saving step 5: restarted, it
finds the group empty, loads the checkpoint and joins with `join(step=5)`, so the group goes on
from that step instead of from 0. With the argument `every4`, it saves only every 4 steps:
restarted, it loads step 4's and joins with it, and the update of step 5 is lost. With
`at_end`, it saves only at the end, and dies at the end round (every batch trained, none saved):
restarted, it finds no checkpoint and joins with none, and every update is lost. With
`leader_at_end` (two ranks or more), the leader dies once the end round committed, before its
end save: the same, with the others finished."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import hspipe  # noqa: E402
import numpy_drafter  # noqa: E402

DIES_AFTER = 5


class DiesOnce:
    """The worker, dying in its first incarnation at the round after step 5 (once step 5's
    checkpoint, if any, is saved)."""

    def __init__(self, w):
        self._w = w
        self._marker = Path(w.run_dir) / f"died-{w.name}"

    def __getattr__(self, name):
        return getattr(self._w, name)

    def all_reduce(self, data, **kwargs):
        mode = " ".join(sys.argv[1:])
        at = kwargs.get("ended") if mode == "at_end" else self._w.membership[1] == DIES_AFTER
        if not self._marker.exists() and at and mode != "leader_at_end":
            self._die()
        r = self._w.all_reduce(data, **kwargs)
        if not self._marker.exists() and mode == "leader_at_end" and r.everyone_ended and r.leader:
            self._die()
        return r

    def _die(self):
        self._marker.touch()
        raise RuntimeError(f"dies after step {self._w.membership[1]}")


def main():
    with hspipe.connect() as w:
        every = {"every4": 4, "at_end": 1000, "leader_at_end": 1000}.get(" ".join(sys.argv[1:]), 1)
        numpy_drafter.run(DiesOnce(w), checkpoint_every=every)
        sys.exit(w.close())


if __name__ == "__main__":
    main()
