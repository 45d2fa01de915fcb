"""The numpy example drafter, letting go of the batch holding sample 137 after the group's
round applied it, without release(): `drop` goes on training (a forgotten release), `raise`
raises (an error in the user's code after the update, e.g. in its checkpoint), `viewed`
raises too, keeping a view of the batch alive to the end of the process. `loss`: every rank
reduces its loss in a round of its own, with no batch, after each gradient round, and the
rank holding the batch dies (os._exit) after that round, before its release. Only in the
first incarnation (marked in the run directory); the batch and its round's step go to
`<run-dir>/dropped-applied`.

The batch was trained: every member applied its update. It must get one ledger line, at that
step, and never be delivered again (a live rank would train it twice)."""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import numpy as np  # noqa: E402

import hspipe  # noqa: E402
import numpy_drafter  # noqa: E402

MARKED = 137
# Views kept to the end of the process (`viewed`).
KEPT = []


class Held:
    """A taken batch; `release()` does nothing once the worker has let go of it."""

    def __init__(self, batch):
        self.batch = batch

    def __getattr__(self, name):
        return getattr(self.batch, name)

    def release(self, **kwargs):
        if self.batch is not None:
            self.batch.release(**kwargs)


class Holding:
    """The worker, whose `take()` hands out `Held` batches."""

    def __init__(self, w):
        self._w = w

    def __getattr__(self, name):
        return getattr(self._w, name)

    def take(self, *args, **kwargs):
        batch = self._w.take(*args, **kwargs)
        return None if batch is None else Held(batch)


class DropsApplied(Holding):
    def __init__(self, w, how):
        super().__init__(w)
        self._how = how
        self._marker = Path(w.run_dir) / "dropped-applied"

    def all_reduce(self, data, batch=None, **kwargs):
        real = None if batch is None else batch.batch
        r = self._w.all_reduce(data, batch=real, **kwargs)
        marked = real is not None and MARKED in real.sample_ids and not self._marker.exists()
        if self._how == "loss":
            if not r.everyone_ended:
                self._w.all_reduce(np.zeros(1, dtype=np.float32), **kwargs)
            if marked:
                self._marker.write_text(f"{real.batch_id} {r.step}\n")
                os._exit(1)
            return r
        if marked:
            self._marker.write_text(f"{real.batch_id} {r.step}\n")
            if self._how == "viewed":
                KEPT.append(np.asarray(real.input_ids))
                batch.batch = real = None  # dropped unreleased, a view of it alive
            if self._how != "drop":
                raise RuntimeError("raised after the update")
            batch.batch = None  # the last reference: the batch is dropped unreleased
        return r


def main():
    with hspipe.connect() as w:
        numpy_drafter.run(DropsApplied(w, sys.argv[1]))
        sys.exit(w.close())


if __name__ == "__main__":
    main()
