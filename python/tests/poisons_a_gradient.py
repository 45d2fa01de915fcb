"""The numpy example drafter, whose group sum at step 3 has a NaN in its gradient (as an
overflow would leave on every rank): the example skips that update and its leader reports the
step with `skipped=True`."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import numpy as np  # noqa: E402

import hspipe  # noqa: E402
import numpy_drafter  # noqa: E402

POISONED = 3


class Reduced:
    """A round's result whose `sum` is a copy, NaN in its first element at step POISONED."""

    def __init__(self, r):
        self._r = r
        self.sum = np.array(r.sum, copy=True)
        if r.step == POISONED:
            self.sum[0] = np.nan

    def __getattr__(self, name):
        return getattr(self._r, name)


class Poisoning:
    def __init__(self, w):
        self._w = w

    def __getattr__(self, name):
        return getattr(self._w, name)

    def all_reduce(self, *args, **kwargs):
        return Reduced(self._w.all_reduce(*args, **kwargs))


def main():
    with hspipe.connect() as w:
        numpy_drafter.run(Poisoning(w))
        sys.exit(w.close())


if __name__ == "__main__":
    main()
