"""A drafter written in numpy, one rank of the drafter group: a linear model learns to predict
each token's last captured layer from its first (mean squared error). Each step:
take a batch, compute the gradient, all-reduce it with the other ranks, apply the same update,
release the batch with the step and the weights' digest. The leader saves the weights every
[drafter] checkpoint_every steps and at the end, one file a step (`numpy_drafter-<step>.npz` in
the run directory), and tells hspipe once the file is in place (`w.checkpointed(step)`), so
`launcher --resume` goes on from that step: the resumed ranks load that file (`w.resume_step`).
A rank restarted when no other lives loads the newest file.

Run by the launcher from the config:  [drafter] command = ["python", "numpy_drafter.py"]
Set [drafter] params to at least the size of what the group reduces (here 2 * hidden + 2).
"""
import hashlib
import os
import sys
from pathlib import Path

import numpy as np

import hspipe


PREFIX = "numpy_drafter-"


def checkpoint_path(run_dir, step):
    """The file of the weights of group step `step`."""
    return Path(run_dir) / f"{PREFIX}{step}.npz"


def saved_steps(run_dir):
    """The steps whose weights are saved in `run_dir`, ascending (a temporary is no file of a
    step: `.npz.tmp`)."""
    steps = []
    for p in Path(run_dir).glob(f"{PREFIX}*.npz"):
        step = p.name[len(PREFIX):-len(".npz")]
        if step.isdigit():
            steps.append(int(step))
    return sorted(steps)


def load(path):
    """(step, weights) of the checkpoint at `path`, or None if there is none."""
    try:
        with np.load(path) as f:
            return int(f["step"]), f["weights"].copy()
    except FileNotFoundError:
        return None


def remove_steps(run_dir, which):
    """Removes the files of the saved steps for which `which(step)` holds."""
    for step in saved_steps(run_dir):
        if which(step):
            checkpoint_path(run_dir, step).unlink(missing_ok=True)


def save(path, step, weights):
    """Writes the checkpoint whole or not at all: a rank killed while writing leaves the last."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez(f, step=np.uint64(step), weights=weights)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def run(w, checkpoint_every=None):
    """Trains with the group until every rank saw the ring's end."""
    hidden = w.config["model"]["hidden"]
    every = w.config["drafter"]["checkpoint_every"] if checkpoint_every is None \
        else checkpoint_every
    run_dir = Path(w.run_dir)           # the group's model: one file a saved step, the leader's
    n = 2 * hidden                       # a scale and a shift per channel
    weights = np.zeros(n, dtype=np.float32)   # every rank starts the same
    if w.index in w.membership[2]:
        # A first incarnation: the group starts at the step the run resumed from (the last
        # recorded saved), with that step's weights, or at 0 with the initial ones. Files of
        # later steps were saved by a run killed before it recorded them: their updates are
        # trained again, so they go (a restarted rank would take the newest for the group's).
        start = w.resume_step
        remove_steps(run_dir, lambda step: start is None or step > start)
        if start is not None:
            saved = load(checkpoint_path(run_dir, start))
            if saved is None:
                raise RuntimeError(
                    f"the run resumes from step {start}, but {checkpoint_path(run_dir, start)} "
                    "(its weights) is gone")
            weights = saved[1]
            print(f"resumed from step {start}, weights "
                  f"{hashlib.sha256(weights.tobytes()).hexdigest()[:16]}")
    else:
        # Restarted: the leader's live weights, or, with every rank gone, the newest saved,
        # whose step the group then goes on from (the updates since are recorded lost).
        steps = saved_steps(run_dir)
        saved = load(checkpoint_path(run_dir, steps[-1])) if steps else None
        joined = w.join(step=None if saved is None else saved[0])
        if joined is not None:
            _, state = joined
            weights = np.asarray(state).view(np.float32)[:n].copy()
        elif saved is not None:
            weights = saved[1]
    lr = np.float32(4.0)
    while True:
        w.admit(weights)                 # the leader hands its weights to joiners
        batch = None if w.ended else w.take()
        grad = np.zeros(n + 2, dtype=np.float32)   # gradient sum, loss sum, loss tokens
        if batch is not None:
            with w.phase("compute"):
                # bf16 shows as its uint16 bit patterns: hspipe.bf16_to_f32 makes floats.
                states = hspipe.bf16_to_f32(np.asarray(batch.hidden_states))   # [T, L, H]
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
        if r.leader and every and (r.step % every == 0 or r.everyone_ended):
            with w.phase("checkpoint"):
                save(checkpoint_path(run_dir, r.step), r.step, weights)
                # Whole on disk: a resume may go on from this step. The files before it are
                # no longer needed (kept until now: a kill before this call resumes from one).
                w.checkpointed(r.step)
                remove_steps(run_dir, lambda step: step < r.step)
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
