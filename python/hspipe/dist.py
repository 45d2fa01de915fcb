"""The drafter group's gradient exchange on torch.distributed: NCCL between GPUs, gloo on the CPU.

``TorchGroup(w)`` makes a torch process group of the current membership epoch's members and
makes it again at every membership change (a rank died, or a restarted one joined), so a
restarted rank rejoins without restarting the others. One step::

    tg = hspipe.dist.TorchGroup(w)
    ...
    r = tg.all_reduce(flat_grad, batch=batch, ended=w.ended, stats=[loss_sum, tokens])
    # flat_grad now holds the sum over the members; r.sum the stats' sum; r.step the step

Exactly once, the way hspipe's own group keeps it: the gradient goes through torch, then the
step commits in hspipe's group *within that epoch* (``w.all_reduce(..., epoch=E)``). A commit
means every member of epoch E finished the same exchange, so the applied sum and the batches
the launcher counts as trained are the same set. If the membership changes first, nothing
commits (``GroupChanged``): the dead rank's batch goes back to the ring, and the survivors,
who still hold their own gradients (the exchange runs on a copy), exchange again among the
new members.

A rank that dies inside a collective does not hang the rest: every exchange is started
asynchronously and watched every 10 ms; when hspipe's membership moves on (the launcher
removes a dead rank once its process is gone; the leader admits a joiner between steps), the
ranks stop waiting for it and go on in a new group of the new epoch. On GPUs the stale group
is aborted (``ncclCommAbort``: its kernels would otherwise spin). On gloo a stale exchange is
left, not waited for: gloo's abort does nothing (measured with torch 2.15), and destroying a
group waits for its pending work, so such a group is kept until that work ends, which it does
once the missing rank lets its own group of that epoch go (at its next step) or dies. A gloo
exchange with a dead peer fails by itself ("connection closed by peer"): the rank then waits
for the launcher's removal. An exchange that fails while the membership stays the same for
``timeout`` seconds ends this worker with an error: the launcher restarts it, which is itself
a membership change, and the rest go on.

Store and rendezvous: one ``FileStore`` per epoch under ``<run-dir>/torch-dist/<ring>/``
(the ring's name is new for every launch, so a resumed run never meets an old epoch's keys).
A process group is made, and connected (NCCL connects lazily: a one-element all-reduce does
it), on a thread, so the wait for slow members is watched too. Tested with torch 2.15 (gloo on
the CPU); the NCCL path has not run yet (no GPU where it was written).

Cost: the exchange runs on a copy of the gradient (a failed exchange leaves partial sums in
its buffer): one extra gradient-sized buffer and two device copies per step; an abandoned
exchange holds its copy until it ends.
"""

import datetime
import os
import sys
import threading
import time

import numpy as np
import torch
import torch.distributed as dist

from ._hspipe import GroupChanged, HspipeError

# How often a running exchange is checked against the membership (and Ctrl-C gets through).
_POLL_S = 0.01


class TorchGroup:
    """The torch.distributed side of a Python drafter rank's group (see the module doc).

    ``backend``: "nccl" or "gloo"; default NCCL when CUDA is available, else gloo.
    ``timeout``: seconds a group may take to form, or an exchange may stay failed with the
    membership unchanged, before this worker gives up with an error (the launcher restarts it).
    """

    def __init__(self, w, backend=None, timeout=600.0):
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"TorchGroup: backend {backend!r}: use 'nccl' or 'gloo'")
        self._w = w
        self.backend = backend
        self.timeout = float(timeout)
        self._root = os.path.join(str(w.run_dir), "torch-dist", w.ring)
        os.makedirs(self._root, exist_ok=True)
        self._epoch = None
        self._pg = None
        # Groups of past epochs, with their pending work (see _drop).
        self._stale = []
        self.device = torch.device("cpu")
        if backend == "nccl":
            # The launcher sets CUDA_VISIBLE_DEVICES to the worker's GPU (w.gpu), so it is
            # device 0 here.
            self.device = torch.device("cuda", 0)
            torch.cuda.set_device(self.device)
        # Exchanges begun again after a membership change (the monitor's "retries").
        self.retries = 0

    @property
    def epoch(self):
        """The membership epoch of the current process group (None before the first step)."""
        return self._epoch

    @property
    def process_group(self):
        """The current torch ProcessGroup backend (valid until the next membership change)."""
        return self._pg

    def all_reduce(self, tensor, batch=None, ended=False, stats=()):
        """One group step: sums ``tensor`` (this rank's flat gradient, on ``self.device``) over
        the members, in place, then commits the step in hspipe's group with ``batch`` (the batch
        it came from, None if none) and ``ended`` (this rank saw the ring's end). ``stats``: a
        few floats (loss sum, token count) summed in the commit round, returned in ``r.sum``.
        Returns the commit (an ``hspipe.Reduced``: step, epoch, members, leader,
        everyone_ended). A rank with no batch still calls it, with a zero gradient.
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError("TorchGroup.all_reduce: tensor must be a torch.Tensor")
        data = np.asarray(list(stats), dtype=np.float32)
        self._prune()
        with self._w.phase("sync"):
            while True:
                epoch, _, members = self._w.membership
                pg = self._group(epoch, members)
                if pg is None:
                    continue  # the membership moved on while the group formed
                buf = tensor.detach().clone()
                if not self._exchange(pg, buf, epoch):
                    self.retries += 1
                    continue
                try:
                    r = self._w.all_reduce(data, batch=batch, ended=ended, epoch=epoch)
                except GroupChanged:
                    self.retries += 1
                    continue
                tensor.detach().copy_(buf)
                return r

    def close(self):
        """Lets the current process group go (call it when the rank is done)."""
        self._pg = None
        self._prune()

    # --- the process group of one epoch ---

    def _group(self, epoch, members):
        if epoch == self._epoch and self._pg is not None:
            return self._pg
        self._drop()
        me = self._w.index
        if me not in members:
            raise HspipeError(
                f"TorchGroup: rank {me} is not a member of the group (epoch {epoch}): it was removed"
            )
        rank, size = members.index(me), len(members)
        store = dist.FileStore(os.path.join(self._root, f"epoch-{epoch}"), size)
        made = {}

        def make():
            try:
                t = datetime.timedelta(seconds=self.timeout)
                if self.backend == "nccl":
                    pg = dist.ProcessGroupNCCL(store, rank, size, t)
                    # NCCL connects lazily, in the first collective: make that happen here,
                    # where the wait is watched, not in the first exchange.
                    one = torch.zeros(1, device=self.device)
                    pg.allreduce([one]).wait()
                    torch.cuda.current_stream(self.device).synchronize()
                    made["pg"] = pg
                else:
                    # Gloo connects every pair in its constructor.
                    made["pg"] = dist.ProcessGroupGloo(store, rank, size, t)
            except Exception as e:  # noqa: BLE001  (raised in this thread below)
                made["error"] = e

        t = threading.Thread(target=make, name=f"hspipe-pg-epoch-{epoch}", daemon=True)
        t.start()
        self._wait(
            lambda: not t.is_alive() or self._w.membership[0] != epoch,
            f"the {self.backend} group of epoch {epoch} (ranks {members}) did not form",
        )
        if t.is_alive():
            # The members of `epoch` will never all come; the thread ends at the store's
            # timeout, holding nothing of ours.
            return None
        if "error" in made:
            raise HspipeError(
                f"TorchGroup: making the {self.backend} group of epoch {epoch}: {made['error']}"
            ) from made["error"]
        self._pg, self._epoch = made["pg"], epoch
        # One line per membership epoch into the worker's log.
        print(f"hspipe.dist: {self.backend} group of epoch {epoch}: ranks {members}",
              file=sys.stderr, flush=True)
        return self._pg

    def _drop(self, work=None):
        """Retires the current group after a membership change. NCCL's is aborted (its kernels
        would spin); gloo's abort does nothing (torch 2.15), its pending work ends when the
        missing rank lets its own group go or dies. A group with pending `work` is kept, not
        destroyed (destroying it waits for that work); one without is let go at once, which
        closes its connections and so ends the other ranks' stale work on it."""
        if self._pg is not None:
            if self.backend == "nccl":
                self._pg.abort()
            self._stale.append((self._pg, work))
            self._pg = None
            self._epoch = None
        self._prune()

    def _prune(self):
        """Lets go of the kept groups whose work is over."""
        self._stale = [(pg, w) for pg, w in self._stale if w is not None and not w.is_completed()]

    # --- one exchange ---

    def _exchange(self, pg, buf, epoch):
        """True if ``buf`` now holds the sum over epoch ``epoch``'s members; False if the
        membership moved on (the group is aborted). Raises if it failed with the membership
        unchanged for ``timeout`` seconds."""
        try:
            work = pg.allreduce([buf])
        except Exception as e:  # noqa: BLE001  (a broken group: as a failed exchange)
            work = None
            failure = e
        while work is not None and not work.is_completed():
            if self._w.membership[0] != epoch:
                # Not waited for: gloo's pending work ends only when the missing rank goes.
                # It sums into `buf`, a copy this step lets go of.
                self._drop(work)
                return False
            self._w.heartbeat()
            time.sleep(_POLL_S)
        if work is not None:
            failure = _settle(work)
            if failure is None:
                return True
        # Failed (a peer's connection closed): the launcher is about to remove the dead rank.
        self._wait(
            lambda: self._w.membership[0] != epoch,
            f"the exchange of epoch {epoch} failed ({failure}) and the membership has not changed",
        )
        self._drop()
        return False

    def _wait(self, done, what):
        """Polls `done` every 10 ms, heartbeating; raises after `timeout` seconds."""
        began = time.monotonic()
        while not done():
            self._w.heartbeat()
            if time.monotonic() - began > self.timeout:
                raise HspipeError(f"TorchGroup: {what} in {self.timeout:.0f} s")
            time.sleep(_POLL_S)


def _settle(work):
    """Waits for ``work`` to finish; None if it succeeded, else its exception."""
    try:
        work.wait()
        return None
    except Exception as e:  # noqa: BLE001  (a failed collective, reported by the caller)
        return e
