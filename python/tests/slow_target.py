"""The numpy example target, slowed to the config's [target] tokens_per_s (as hspipe's mock
target is), so a test can act mid-run: test_workers.py."""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import hspipe  # noqa: E402
import numpy_target  # noqa: E402


def main():
    with hspipe.connect() as w:
        layers, hidden = w.config["model"]["layers"], w.config["model"]["hidden"]
        speed = w.config["target"]["tokens_per_s"]
        for claim in w:
            ids = np.asarray(claim.input_ids)
            positions = np.concatenate([np.arange(n) for n in claim.seq_lens])
            with w.phase("compute"):
                states, greedy = numpy_target.forward(ids, positions, layers, hidden)
                time.sleep(claim.tokens / speed)
            slot = claim.reserve()
            if slot is None:
                break
            np.asarray(slot.hidden_states)[...] = states
            np.asarray(slot.target_tokens)[...] = greedy
            slot.commit()
        sys.exit(w.close())


if __name__ == "__main__":
    main()
