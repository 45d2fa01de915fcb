"""What the case scripts run as workers (view_lifetimes.py, misuse.py) share: a case that holds
is appended by name to a file in the run directory, which test_workers.py reads; then the
worker goes on as the numpy example does, so the run completes.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import hspipe  # noqa: E402
import numpy_drafter  # noqa: E402
import numpy_target  # noqa: E402


def recorder(file_name):
    """`case(w, name)`: appends `name` to <run-dir>/`file_name`."""
    def case(w, name):
        with open(os.path.join(w.run_dir, file_name), "a") as f:
            f.write(name + "\n")
    return case


def raises(exc, fn, *words):
    try:
        fn()
    except exc as e:
        for word in words:
            assert word in str(e), f"{word!r} not in {e}"
        return
    raise AssertionError(f"{fn} did not raise {exc}")


def run(target_cases, drafter_cases):
    """The worker: its role's cases, then the numpy example's loop, then close."""
    with hspipe.connect() as w:
        if w.role == "target":
            target_cases(w)
            numpy_target.run(w)
        else:
            drafter_cases(w)
            numpy_drafter.run(w)
        sys.exit(w.close())
