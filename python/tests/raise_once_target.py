"""The numpy example target, raising once: its first incarnation commits one batch, then
raises on the next claim (an error in the user's forward: a CUDA out of memory, a bug).
Its restart must claim work again."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import hspipe  # noqa: E402
import numpy_target  # noqa: E402


class RaisingOnce:
    """The worker, whose second claim raises in the first incarnation (marked in the run
    directory, so the restart runs normally)."""

    def __init__(self, w):
        self._w = w

    def __getattr__(self, name):
        return getattr(self._w, name)

    def __iter__(self):
        marker = Path(self._w.run_dir) / f"raised-{self._w.name}"
        for n, claim in enumerate(self._w):
            if n == 1 and not marker.exists():
                marker.touch()
                raise RuntimeError("raised once")
            yield claim


def main():
    with hspipe.connect() as w:
        numpy_target.run(RaisingOnce(w))
        sys.exit(w.close())


if __name__ == "__main__":
    main()
