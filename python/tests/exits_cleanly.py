"""The numpy example target, ending its process with sys.exit(0) instead of
sys.exit(w.close()): inside `with` (argv "with"), or with no `with` at all (argv "bare")."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import hspipe  # noqa: E402
import numpy_target  # noqa: E402


def main():
    if sys.argv[1] == "with":
        with hspipe.connect() as w:
            numpy_target.run(w)
            sys.exit(0)
    w = hspipe.connect()
    numpy_target.run(w)
    sys.exit(0)


if __name__ == "__main__":
    main()
