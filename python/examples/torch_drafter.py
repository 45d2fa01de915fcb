"""The numpy drafter's model in PyTorch, one rank of the drafter group, with its gradient
exchange on torch.distributed (hspipe.dist.TorchGroup: NCCL on GPUs, gloo here on the CPU):
the batch's states come in through torch.from_dlpack (bf16 as bf16, no copy), the gradient
from autograd, the group's sum from the process group of the current membership epoch, and the
step's commit from hspipe's group, so a killed rank's batch is redelivered, never lost or
trained twice.

Not run by CI (no torch there): scripts/py/torch-check.sh runs it with a Python that has torch.
"""
import hashlib
import sys

import torch

import hspipe
import hspipe.dist


def run(w):
    hidden = w.config["model"]["hidden"]
    scale = torch.zeros(hidden, requires_grad=True)
    shift = torch.zeros(hidden, requires_grad=True)
    joined = w.join()
    if joined is not None:
        state = torch.from_dlpack(joined[1]).view(torch.float32)[: 2 * hidden].clone()
        with torch.no_grad():
            scale.copy_(state[:hidden])
            shift.copy_(state[hidden:])
    tg = hspipe.dist.TorchGroup(w, backend="gloo")
    lr = 4.0
    while True:
        w.admit(torch.cat([scale, shift]).detach().numpy())
        batch = None if w.ended else w.take()
        grad = torch.zeros(2 * hidden)
        loss_sum, tokens = 0.0, 0.0
        if batch is not None:
            with w.phase("compute"):
                states = torch.from_dlpack(batch.hidden_states).float()   # [T, L, H], bf16 in
                x, y = states[:, 0, :], states[:, -1, :]
                m = torch.from_dlpack(batch.loss_mask).float()[:, None]
                err = (x * scale + shift - y) * m
                loss = (err * err).sum()
                gs, gb = torch.autograd.grad(loss, [scale, shift])
                grad[:hidden], grad[hidden:] = gs, gb
                loss_sum, tokens = float(loss), float(m.sum()) * hidden
                del states, x, y, m, err
        r = tg.all_reduce(grad, batch=batch, ended=w.ended, stats=[loss_sum, tokens])
        s = torch.from_dlpack(r.sum)
        n = float(s[1])
        if n > 0:
            with torch.no_grad():
                scale -= lr * grad[:hidden] / n
                shift -= lr * grad[hidden:] / n
            if r.leader:
                w.progress(r.step, float(s[0]) / n, tokens=int(n))
                print(f"step {r.step} loss {float(s[0]) / n:.6f} epoch {r.epoch}", flush=True)
        digest = hashlib.sha256(torch.cat([scale, shift]).detach().numpy().tobytes()).hexdigest()[:16]
        if batch is not None:
            batch.release(step=r.step, digest=digest)
        if r.everyone_ended:
            break
    tg.close()


def main():
    with hspipe.connect() as w:
        run(w)
        sys.exit(w.close())


if __name__ == "__main__":
    main()
