"""A target written in numpy: it computes the same hidden states as hspipe's mock target (so
hspipe's own drafters verify them), straight into the ring slot.

Run by the launcher from the config:  [target] command = ["python", "numpy_target.py"]
A PyTorch target does the same with  torch.from_dlpack(slot.hidden_states).copy_(states).
"""
import sys

import numpy as np

import hspipe

M = np.uint64(0x9E3779B97F4A7C15)


def _hash(x):
    x = x ^ (x >> np.uint64(31))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(29))


def _unit(x):
    return (x % np.uint64(1024)).astype(np.float32) / np.float32(1024.0) - np.float32(0.5)


def forward(ids, positions, layers, hidden):
    """The mock target's model: [T] ids -> bf16 bits [T, L, H] and greedy tokens [T]."""
    tok = ids.astype(np.uint64)[:, None, None]
    pos = positions.astype(np.uint64)[:, None, None]
    layer = np.arange(layers, dtype=np.uint64)[None, :, None]
    ch = np.arange(hidden, dtype=np.uint64)[None, None, :]
    with np.errstate(over="ignore"):
        signal = _unit(_hash((tok * M) ^ (ch << np.uint64(20))))
        noise = _unit(_hash(
            ((tok * M) + pos * np.uint64(0xBF58476D1CE4E5B9) + (layer << np.uint64(40))
             + (ch << np.uint64(20))) ^ np.uint64(0x5555)))
        f = (signal + noise / np.float32(4.0)).astype(np.float32)
        # Truncated to bf16, as the mock target does, so our drafters verify every byte; a
        # model of your own converts with hspipe.bf16_bits(f), which rounds as torch does.
        states = (f.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
        t = ids.astype(np.uint64)
        greedy = _hash((t * np.uint64(0xD6E8FEB86659FD93)) ^ positions.astype(np.uint64)
                       ^ np.uint64(0x70C3)).astype(np.uint32)
    return states, greedy


def run(w):
    """Computes and publishes every batch this target claims."""
    layers, hidden = w.config["model"]["layers"], w.config["model"]["hidden"]
    for claim in w:                      # the next planned batch; None ends the loop
        ids = np.asarray(claim.input_ids)        # read-only uint32 [T], no copy
        positions = np.concatenate([np.arange(n) for n in claim.seq_lens])
        with w.phase("compute"):
            states, greedy = forward(ids, positions, layers, hidden)
        slot = claim.reserve()           # blocks while the ring is full
        if slot is None:                 # a stop was asked for while waiting
            break
        with w.phase("copy"):
            # Buffer protocol: bf16 shows as its uint16 bit patterns ([T, L, H]): write bit
            # patterns (hspipe.bf16_bits), never floats, which numpy casts to integers.
            np.asarray(slot.hidden_states)[...] = states
            np.asarray(slot.target_tokens)[...] = greedy
        slot.commit()                    # no view of the slot may be alive here


def main():
    with hspipe.connect() as w:
        run(w)
        sys.exit(w.close())


if __name__ == "__main__":
    main()
