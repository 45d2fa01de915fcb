"""hspipe.dist.TorchGroup (torch.distributed, gloo on the CPU) and a torch drafter through the
launcher. Needs torch, which CI does not install: scripts/py/torch-check.sh runs this file
with a Python that has it (the README's "Python workers" section).

The first two tests drive TorchGroup with a stand-in for the worker (its membership in a file
the test changes, as the launcher's removal or the leader's admission would), so the moment of
the membership change is the test's choice: ranks provably inside an exchange when it comes.
"""

import json
import multiprocessing as mp
import os
import signal
import time
import types
from contextlib import nullcontext
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import hspipe.dist  # noqa: E402
from conftest import PYTHON, config_text, every_sample_once, kill_one_of, losses, one_model, script  # noqa: E402
from hspipe import GroupChanged  # noqa: E402


class FakeWorker:
    """What TorchGroup uses of a Drafter, with the membership read from `<dir>/membership`."""

    def __init__(self, dir, index):
        self.dir, self.index = Path(dir), index
        self.run_dir, self.ring, self.gpu = str(dir), "test-ring", None

    @property
    def membership(self):
        m = json.loads((self.dir / "membership").read_text())
        return m["epoch"], 0, m["members"]

    def heartbeat(self):
        pass

    def phase(self, name):
        return nullcontext()

    def all_reduce(self, data, batch=None, ended=False, epoch=None):
        # hspipe's commit within an epoch, as far as this test needs it.
        if self.membership[0] != epoch:
            raise GroupChanged("epoch changed")
        return types.SimpleNamespace(sum=data, epoch=epoch)


def set_membership(dir, epoch, members):
    tmp = Path(dir) / "membership.tmp"
    tmp.write_text(json.dumps({"epoch": epoch, "members": members}))
    tmp.replace(Path(dir) / "membership")


class Marked(hspipe.dist.TorchGroup):
    """Writes `<dir>/in-exchange-<rank>-<epoch>` once its exchange has begun."""

    def _exchange(self, pg, buf, epoch):
        (Path(self._w.dir) / f"in-exchange-{self._w.index}-{epoch}").touch()
        return super()._exchange(pg, buf, epoch)


def rank_main(dir, index, mode, out):
    w = FakeWorker(dir, index)
    if mode == "absent" and index == 2:
        # Alive, in epoch 1's group, but never exchanging: as a rank that moved on.
        tg = hspipe.dist.TorchGroup(w, backend="gloo", timeout=120)
        tg._group(*w.membership[::2])
        time.sleep(3600)  # killed by the test; the others must not wait for it
        return
    tg = Marked(w, backend="gloo", timeout=120)
    if mode == "dies" and index == 2:
        tg._group(*w.membership[::2])
        buf = torch.ones(4)
        tg._pg.allreduce([buf])  # inside the collective...
        os._exit(9)  # ...and gone, its connections closed by the kernel
    grad = torch.full((4,), float(index + 1))
    r = tg.all_reduce(grad, stats=[1.0])
    out.put((index, grad.tolist(), r.epoch, tg.retries))


def wait_for(pred, what, timeout=120):
    began = time.monotonic()
    while not pred():
        assert time.monotonic() - began < timeout, f"watchdog: no {what}"
        time.sleep(0.01)


@pytest.mark.parametrize("mode", ["absent", "dies"])
def test_ranks_inside_an_exchange_go_on_in_the_next_epoch_when_a_rank_leaves(tmp_path, mode):
    # "absent": rank 2 is alive and in epoch 1's process group but never exchanges (a rank
    # that moved to another epoch): the others' exchange can only end by the abort on the
    # membership change. "dies": rank 2 dies inside the collective. Either way, ranks 0 and 1
    # are inside their exchange (marked) before the test moves the membership to epoch 2
    # without rank 2, and they must finish there with their two gradients' sum.
    set_membership(tmp_path, 1, [0, 1, 2])
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(tmp_path, i, mode, out)) for i in range(3)]
    for p in procs:
        p.start()
    try:
        for i in (0, 1):
            wait_for(lambda: (tmp_path / f"in-exchange-{i}-1").exists(), f"rank {i} in the exchange")
        if mode == "dies":
            procs[2].join(timeout=120)
            assert procs[2].exitcode == 9
        set_membership(tmp_path, 2, [0, 1])
        got = sorted(out.get(timeout=120) for _ in range(2))
    finally:
        # Rank 2 first: ranks 0 and 1 keep epoch 1's group (its work pending) until it goes.
        for p in reversed(procs):
            if p.is_alive() and p is procs[2]:
                p.kill()
            p.join(timeout=120)
            assert not p.is_alive(), "watchdog: a rank did not end"
    for index, grad, epoch, retries in got:
        assert grad == [3.0] * 4, f"rank {index}: the sum of ranks 0 and 1 only"
        assert (epoch, retries) == (2, 1), f"rank {index}: committed in epoch 2 after one retry"


TORCH_DRAFTER = [PYTHON, script("examples/torch_drafter.py")]


def test_torch_drafters_train_as_one_group_through_torch_distributed(run):
    code, out = run.launch(config_text(drafter=TORCH_DRAFTER)).finish()
    assert code == 0, out
    every_sample_once(run)
    one_model(run.ledgers())
    ls = losses(run.log("drafter-0"))
    assert len(ls) >= 6 and sum(ls[-3:]) < 0.8 * sum(ls[:3]), ls


def test_a_sigkilled_torch_drafter_rejoins_a_new_process_group(run):
    # Targets 16 times slower than the slow config: the restarted rank (an interpreter and
    # torch to import) is back while batches remain, so the group has it again.
    faults = "".join(f"[faults.target-{i}]\nslow = 16.0\n" for i in range(5))
    run.launch(config_text(slow=True, drafter=TORCH_DRAFTER, faults=faults))
    kill_one_of(run, "drafter-1", signal.SIGKILL, trained=3)
    # The leader went on through the removal (epoch 2, without rank 1) and the rejoin (epoch 3),
    # each in a new gloo group; so did the restarted rank, in epoch 3's.
    for worker, want in [
        ("drafter-0", "gloo group of epoch 1: ranks [0, 1, 2]"),
        ("drafter-0", "gloo group of epoch 2: ranks [0, 2]"),
        ("drafter-0", "gloo group of epoch 3: ranks [0, 1, 2]"),
        ("drafter-1", "gloo group of epoch 3: ranks [0, 1, 2]"),
    ]:
        assert want in run.log(worker), (worker, want)
