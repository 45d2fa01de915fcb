"""A drafter written in numpy, one rank of the drafter group: a linear model learns to predict
each token's last captured layer from its first (mean squared error). Each step:
take a batch, compute the gradient, all-reduce it with the other ranks, apply the same update,
release the batch with the step and the weights' digest.

Run by the launcher from the config:  [drafter] command = ["python", "numpy_drafter.py"]
Set [drafter] params to at least the size of what the group reduces (here 2 * hidden + 2).
"""
import hashlib
import sys

import numpy as np

import hspipe


def bf16(bits):
    """bf16 bit patterns (what the buffer protocol shows) as float32."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def run(w):
    """Trains with the group until every rank saw the ring's end."""
    hidden = w.config["model"]["hidden"]
    n = 2 * hidden                       # a scale and a shift per channel
    weights = np.zeros(n, dtype=np.float32)   # every rank starts the same
    joined = w.join()                    # a restarted rank gets the leader's live weights
    if joined is not None:
        _, state = joined
        weights = np.asarray(state).view(np.float32)[:n].copy()
    lr = np.float32(4.0)
    while True:
        w.admit(weights)                 # the leader hands its weights to joiners
        batch = None if w.ended else w.take()
        grad = np.zeros(n + 2, dtype=np.float32)   # gradient sum, loss sum, loss tokens
        if batch is not None:
            with w.phase("compute"):
                states = bf16(np.asarray(batch.hidden_states))   # [T, L, H], a copy
                x, y = states[:, 0, :], states[:, -1, :]
                m = np.asarray(batch.loss_mask).astype(np.float32)[:, None]
                err = (x * weights[:hidden] + weights[hidden:] - y) * m
                grad[:hidden] = 2 * (err * x).sum(0)
                grad[hidden:n] = 2 * err.sum(0)
                grad[n] = (err * err).sum()
                grad[n + 1] = m.sum() * hidden
        r = w.all_reduce(grad, batch=batch, ended=w.ended)
        s = np.asarray(r.sum)
        if s[n + 1] > 0:
            # A gradient that is not finite is skipped, as every rank sees the same sum: one
            # NaN applied would make every weight NaN for the rest of the run.
            skipped = not np.isfinite(s[:n]).all()
            if not skipped:
                weights -= lr * s[:n] / s[n + 1]
            if r.leader:                 # the monitor, TensorBoard and summary show it
                loss = float(s[n] / s[n + 1])
                w.progress(r.step, loss, tokens=int(s[n + 1]), skipped=skipped)
                print(f"step {r.step} loss {loss:.6f}{' (skipped)' if skipped else ''}")
        digest = hashlib.sha256(weights.tobytes()).hexdigest()[:16]
        if batch is not None:
            batch.release(step=r.step, digest=digest)
        if r.everyone_ended:
            break

def main():
    with hspipe.connect() as w:
        run(w)
        sys.exit(w.close())


if __name__ == "__main__":
    main()
