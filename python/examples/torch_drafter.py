"""The numpy drafter's model in PyTorch on the CPU, one rank of the drafter group: the batch's
states come in through torch.from_dlpack (bf16 as bf16, no copy), the gradient from autograd,
the group's sum through w.all_reduce on the gradient's CPU buffer.

Not run by CI (no torch there): scripts/py/torch-check.sh runs it with a Python that has torch.
"""
import hashlib
import sys

import torch

import hspipe


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
    lr = 4.0
    while True:
        w.admit(torch.cat([scale, shift]).detach().numpy())
        batch = None if w.ended else w.take()
        grad = torch.zeros(2 * hidden + 2)
        if batch is not None:
            with w.phase("compute"):
                states = torch.from_dlpack(batch.hidden_states).float()   # [T, L, H], bf16 in
                x, y = states[:, 0, :], states[:, -1, :]
                m = torch.from_dlpack(batch.loss_mask).float()[:, None]
                err = (x * scale + shift - y) * m
                loss = (err * err).sum()
                gs, gb = torch.autograd.grad(loss, [scale, shift])
                grad[:hidden], grad[hidden : 2 * hidden] = gs, gb
                grad[2 * hidden] = loss.detach()
                grad[2 * hidden + 1] = m.sum() * hidden
                del states, x, y, m, err
        r = w.all_reduce(grad.numpy(), batch=batch, ended=w.ended)
        s = torch.from_dlpack(r.sum)
        n = float(s[2 * hidden + 1])
        if n > 0:
            with torch.no_grad():
                scale -= lr * s[:hidden] / n
                shift -= lr * s[hidden : 2 * hidden] / n
            if r.leader:
                w.progress(r.step, float(s[2 * hidden]) / n, tokens=int(n))
                print(f"step {r.step} loss {float(s[2 * hidden]) / n:.6f}")
        digest = hashlib.sha256(torch.cat([scale, shift]).detach().numpy().tobytes()).hexdigest()[:16]
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
