"""The numpy example drafter whose rank 1 records weights of its own from step 3 on, as a rank
that adds 1e-3 to its weights after each update would: every count still agrees (each sample
trained once), but the ranks no longer train one model. The launcher compares the ranks' ledger
digests at the end, names the first step and the ranks that differ, and ends the run degraded."""
import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import hspipe  # noqa: E402
import numpy_drafter  # noqa: E402
from drops_applied import Held, Holding  # noqa: E402

FROM_STEP = 3


class Drifting(Held):
    """A taken batch whose release records rank 1's weights apart from step 3 on."""

    def __init__(self, batch, index):
        super().__init__(batch)
        self._index = index

    def release(self, step=None, digest=None, **kwargs):
        if self._index == 1 and step is not None and step >= FROM_STEP and digest:
            digest = hashlib.sha256(f"drifted {digest}".encode()).hexdigest()[:16]
        super().release(step=step, digest=digest, **kwargs)


class Worker(Holding):
    """The worker, whose `take()` hands out `Drifting` batches (`all_reduce` gets the real one)."""

    def take(self, *args, **kwargs):
        batch = self._w.take(*args, **kwargs)
        return None if batch is None else Drifting(batch, self._w.index)

    def all_reduce(self, data, batch=None, **kwargs):
        real = None if batch is None else batch.batch
        return self._w.all_reduce(data, batch=real, **kwargs)


def main():
    with hspipe.connect() as w:
        numpy_drafter.run(Worker(w))
        sys.exit(w.close())


if __name__ == "__main__":
    main()
