"""The numpy example drafter, failing on any batch that holds sample 137: a poison batch that
kills every rank that takes it (the launcher sets it aside, `--set-aside-after`)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import hspipe  # noqa: E402
import numpy_drafter  # noqa: E402

POISON = 137


class Poisoned:
    """The worker, whose take() raises on the poison batch (after the take: it is in hand)."""

    def __init__(self, w):
        self._w = w

    def __getattr__(self, name):
        return getattr(self._w, name)

    def take(self, *args, **kwargs):
        batch = self._w.take(*args, **kwargs)
        if batch is not None and POISON in batch.sample_ids:
            raise RuntimeError(f"poisoned by sample {POISON}")
        return batch


def main():
    with hspipe.connect() as w:
        numpy_drafter.run(Poisoned(w))
        sys.exit(w.close())


if __name__ == "__main__":
    main()
