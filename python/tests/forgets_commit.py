"""The numpy example target with its slot.commit() forgotten: each slot it fills is dropped when
the next reserve() replaces it. Run as the only target by test_workers.py.

Before, each dropped slot quietly went back to the work table and this target claimed the same
batches again, for ever: the launcher waited for READY batches that never came, and its hang
check never fired, since the target's calls kept beating.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import hspipe  # noqa: E402
import numpy_target  # noqa: E402


def main():
    with hspipe.connect() as w:
        layers, hidden = w.config["model"]["layers"], w.config["model"]["hidden"]
        for claim in w:
            ids = np.asarray(claim.input_ids)
            positions = np.concatenate([np.arange(n) for n in claim.seq_lens])
            states, greedy = numpy_target.forward(ids, positions, layers, hidden)
            slot = claim.reserve()
            if slot is None:
                break
            np.asarray(slot.hidden_states)[...] = states
            np.asarray(slot.target_tokens)[...] = greedy
            # slot.commit() forgotten.
        sys.exit(w.close())


if __name__ == "__main__":
    main()
