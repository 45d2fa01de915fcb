"""The numpy example drafter as three ranks, where rank 1 is interrupted (SIGINT, as Ctrl-C)
while it waits in its third group round, its batch contributed. Rank 0 arrives in that round
only once rank 1 says so (`<run-dir>/interrupted` exists), so the round commits with rank 1's
contribution. First incarnation only. Then rank 1, as the argument says:

- `drop`: drops the batch and ends with the KeyboardInterrupt. It writes to the file: the
  batch, the step its round commits as, how many dropped batches the drafter kept right after
  the drop (the batch is undecided while the round may still commit), and how many batches the
  drafter counted trained once it was decided.
- `retry`: calls all_reduce again with the same data, which finishes that round (rank 0 is
  let in while it waits) and trains on as the others do. It writes the batch and the step.
- `late`: waits until the others committed the round, then calls all_reduce again: an error
  (its weights are behind the group's), with which it ends. It writes the batch, the step and
  the error.
"""
import os
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import hspipe  # noqa: E402
import numpy_drafter  # noqa: E402
from drops_applied import Holding  # noqa: E402

ROUND = 3
WATCHDOG_S = 120


def wait_for(what, pred):
    began = time.monotonic()
    while not pred():
        if time.monotonic() - began > WATCHDOG_S:
            raise TimeoutError(f"no {what} in {WATCHDOG_S} s")
        time.sleep(0.01)


class Interrupted(Holding):
    def __init__(self, w, how):
        super().__init__(w)
        self._how = how
        self._calls = 0
        self._marker = Path(w.run_dir) / "interrupted"
        self._first = not self._marker.exists()

    def all_reduce(self, data, batch=None, **kwargs):
        real = None if batch is None else batch.batch
        self._calls += 1
        if not self._first or self._calls != ROUND or real is None:
            return self._w.all_reduce(data, batch=real, **kwargs)
        if self._w.index == 0:
            wait_for("interrupted round", self._marker.exists)
        if self._w.index != 1:
            return self._w.all_reduce(data, batch=real, **kwargs)
        target = self._w.membership[1] + 1
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        try:
            return self._w.all_reduce(data, batch=real, **kwargs)
        except KeyboardInterrupt:
            batch_id = real.batch_id
            if self._how == "retry":
                # Rank 0 is let in once this rank waits in the round again.
                threading.Timer(0.3, self._marker.write_text, ("",)).start()
                r = self._w.all_reduce(data, batch=real, **kwargs)
                self._marker.write_text(f"{batch_id} {target} {r.step}\n")
                return r
            if self._how == "late":
                self._marker.write_text("")  # rank 0 arrives now: the round commits
                wait_for("committed round", lambda: self._w.membership[1] >= target)
                try:
                    self._w.all_reduce(data, batch=real, **kwargs)
                except hspipe.HspipeError as e:
                    self._marker.write_text(f"{batch_id} {target} {e}\n")
                    raise
                self._marker.write_text(f"{batch_id} {target} no error\n")
                raise
            trained = self._w.trained
            batch.batch = real = None  # dropped unreleased
            kept = self._w.deferred
            self._marker.write_text("")  # rank 0 arrives now: the round commits
            wait_for("decided round", lambda: self._w.deferred == 0)
            gained = self._w.trained - trained
            self._marker.write_text(f"{batch_id} {target} {kept} {gained}\n")
            raise


def main():
    with hspipe.connect() as w:
        numpy_drafter.run(Interrupted(w, sys.argv[1]))
        sys.exit(w.close())


if __name__ == "__main__":
    main()
