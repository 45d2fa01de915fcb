"""Batches, slots and claims let go of on another thread, run as a worker by test_workers.py
(as the only target and the only drafter): each case that holds appends its name to
<run-dir>/thread-cases.txt; then the worker goes on as the numpy example does, so the run
completes with every sample trained once.

The last reference goes to another thread, which drops it there: a pool's worker thread, a
DataLoader's, or the garbage collector run on whatever thread allocates when a cycle is found.
The object goes back to the worker's own thread, which gives it back at its next call (the
batch requeued for redelivery, the slot aborted and its item returned to the work table); a
target's slot or claim dropped so, never committed or aborted, also makes that call raise,
naming its batch (a target that drops its slots would claim the same batches for ever).
Before, such an object was leaked (pyo3 cannot drop an `unsendable` object on another thread):
its slot stayed held for the life of the process, the drafter's next take() refused (a rank
holds one batch at a time) and the target's last claim() waited for ever for its own item.
"""
import gc
import threading

import numpy as np

import hspipe
from cases import raises, recorder, run

case = recorder("thread-cases.txt")


def on_a_thread(fn):
    """Runs `fn` on a new thread and returns what it returned or raised (an exception is
    returned, not raised: the case checks it)."""
    got = []

    def body():
        try:
            got.append(fn())
        except BaseException as e:  # noqa: BLE001 - PanicException too, the old answer
            # Without its traceback: that holds this frame, and `fn` (a batch's bound method)
            # would live on in the cycle until the collector ran.
            got.append(e.with_traceback(None))

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return got[0]


def let_go_on_a_thread(box):
    """Drops `box`'s only item, its last reference, on another thread."""
    on_a_thread(box.clear)


def refused_here(fn, what):
    """`fn` called on another thread raises hspipe's error, naming the thread rule."""
    e = on_a_thread(fn)
    assert isinstance(e, hspipe.HspipeError), f"{what}: {type(e).__name__}: {e}"
    assert "thread" in str(e), f"{what}: {e}"


def claim_until(w, wanted):
    """Claims batches (holding each) until every id in `wanted` was claimed again, then aborts
    the claims, which gives them back. One target: a claim waits only for an item this target
    itself holds, so a timeout means a lost one."""
    held, seen = [], set()
    while not wanted <= seen:
        try:
            c = w.claim(timeout=10)
        except TimeoutError:
            raise AssertionError(f"batches {sorted(wanted - seen)} never came back") from None
        assert c is not None, f"every batch published but {sorted(wanted - seen)}"
        held.append(c)
        seen.add(c.batch_id)
    for c in held:
        c.abort()


def target_cases(w):
    # A slot and a claim dropped on another thread go back to the work table, and the next
    # call says what was dropped unfinished.
    claim = w.claim()
    box = [claim.reserve()]
    del claim
    slot_id = box[0].batch_id
    let_go_on_a_thread(box)
    raises(hspipe.HspipeError, w.claim, f"the slot of batch {slot_id} was dropped without")
    box = [w.claim()]
    claim_id = box[0].batch_id
    let_go_on_a_thread(box)
    raises(hspipe.HspipeError, w.claim, f"the claim of batch {claim_id} was dropped without")
    claim_until(w, {slot_id, claim_id})
    case(w, "a slot and a claim dropped on another thread are given back")

    # Still viewed, it is kept until the view goes, then given back.
    box = [w.claim().reserve()]
    viewed_id = box[0].batch_id
    view = np.asarray(box[0].hidden_states)
    let_go_on_a_thread(box)
    assert w.deferred == 1, w.deferred
    del view
    assert w.deferred == 0, w.deferred
    raises(hspipe.HspipeError, w.claim, f"the slot of batch {viewed_id} was dropped without")
    claim_until(w, {viewed_id})
    case(w, "a slot dropped on another thread while viewed is kept, then given back")

    # Its data is anyone's to read; what changes it is its thread's.
    claim = w.claim()
    slot = claim.reserve()
    assert on_a_thread(lambda: slot.batch_id) == slot.batch_id
    assert on_a_thread(lambda: np.asarray(slot.input_ids).tolist()) == \
        np.asarray(claim.input_ids).tolist()
    assert on_a_thread(lambda: w.name) == w.name
    refused_here(slot.commit, "commit")
    refused_here(slot.abort, "abort")
    refused_here(w.claim, "claim")
    refused_here(lambda: w.phase("compute").__enter__(), "phase")
    slot.abort()
    case(w, "another thread reads a slot, and its calls that change it are refused")


def drafter_cases(w):
    # A batch dropped on another thread goes back to the ring, and take() goes on.
    box = [w.take()]
    let_go_on_a_thread(box)
    b = w.take(timeout=60)
    assert b is not None
    case(w, "a batch dropped on another thread is given back")

    # Still viewed, it is kept until the view goes.
    view = np.asarray(b.hidden_states)
    box = [b]
    del b
    let_go_on_a_thread(box)
    assert w.deferred == 1, w.deferred
    del view
    assert w.deferred == 0, w.deferred
    case(w, "a batch dropped on another thread while viewed is kept, then given back")

    # In a reference cycle, collected by the garbage collector on another thread.
    gc.disable()  # nothing collects it on this thread first
    cycle = [w.take(timeout=60)]
    cycle.append(cycle)
    del cycle
    on_a_thread(gc.collect)
    gc.enable()
    b = w.take(timeout=60)
    assert b is not None
    case(w, "a batch in a cycle the collector frees on another thread is given back")

    # Its data is anyone's to read; what changes it is its thread's.
    assert on_a_thread(lambda: b.sample_ids) == b.sample_ids
    got = on_a_thread(lambda: np.asarray(b.input_ids).tolist())
    assert got == np.asarray(b.input_ids).tolist()
    refused_here(b.release, "release")
    refused_here(w.take, "take")
    refused_here(w.close, "close")
    del b
    case(w, "another thread reads a batch, and its calls that change it are refused")


if __name__ == "__main__":
    run(target_cases, drafter_cases)
