"""A drafter group whose rank 1 reduces a longer buffer than the others (its model laid out
differently), run as every drafter by test_workers.py.

Before, the collective summed whole group buffers: rank 1's extra floats were added to the
others' zero padding, and every rank went on with a sum of misaligned parts, silently. Each rank
passes a batch when it has one: the round commits, but no rank applies it, so its batches must
count untrained.
"""
import numpy as np

import hspipe


def main():
    with hspipe.connect() as w:
        hidden = w.config["model"]["hidden"]
        n = hidden + (10 if w.index == 1 else 2)
        batch = w.take()
        w.all_reduce(np.ones(n, dtype=np.float32), batch=batch, ended=batch is None)
        raise AssertionError(f"all_reduce summed {n} floats with buffers of other lengths")


if __name__ == "__main__":
    main()
