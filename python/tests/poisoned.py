"""The numpy example target or drafter (whichever the launcher starts it as), failing on any
batch that holds sample 137: a poison batch that kills every worker that computes it (the
launcher sets it aside, `--set-aside-after`)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import hspipe  # noqa: E402
import numpy_drafter  # noqa: E402
import numpy_target  # noqa: E402

POISON = 137


class Poisoned:
    """The worker, raising on the poison batch once it is in hand: a drafter's after its
    take(), a target's after its claim."""

    def __init__(self, w):
        self._w = w

    def __getattr__(self, name):
        return getattr(self._w, name)

    def _check(self, batch):
        if batch is not None and POISON in batch.sample_ids:
            if self._w.role == "target":
                # Whether a target died with it before (`claim.returned`), one line per claim.
                with open(Path(self._w.run_dir) / "poison-claims", "a") as f:
                    f.write(f"{batch.returned}\n")
            raise RuntimeError(f"poisoned by sample {POISON}")
        return batch

    def take(self, *args, **kwargs):
        return self._check(self._w.take(*args, **kwargs))

    def __iter__(self):
        return (self._check(claim) for claim in self._w)


def main():
    with hspipe.connect() as w:
        run = numpy_target.run if w.role == "target" else numpy_drafter.run
        run(Poisoned(w))
        sys.exit(w.close())


if __name__ == "__main__":
    main()
