"""Misuse of the API, run as a worker by test_workers.py (as the only target and the only
drafter): each case that gets a clear answer (a result or an exception of ours, never a panic)
appends its name to <run-dir>/misuse-cases.txt; then the worker goes on as the numpy example
does, so the run completes.
"""
import os
import threading
import time

import numpy as np

import hspipe
from cases import raises, recorder, run

case = recorder("misuse-cases.txt")


def later(seconds, fn):
    """Runs `fn` on another thread after `seconds` (what lets a long wait end)."""
    threading.Thread(target=lambda: (time.sleep(seconds), fn())).start()


def in_a_forked_child(w, calls):
    """Forks: in the child, each of `calls` must raise HspipeError naming this process as the
    connection's owner (it exits 1 otherwise). Returns once the child exited 0."""
    owner = os.getpid()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            for call in calls:
                raises(hspipe.HspipeError, call, f"belongs to pid {owner}",
                       "a forked child")
            code = 0
        except BaseException as e:  # noqa: BLE001 - said, then the exit code fails the case
            print(f"forked child: {e!r}", flush=True)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status


def beat_from_a_thread(w):
    # What changes the worker is its thread's (thread_drops.py); a thread that beats during
    # long work calls w.heartbeat() or holds the heartbeat handle.
    beat = w.heartbeat_handle()
    failed = []

    def beating():
        try:
            beat()
            w.heartbeat()
        except BaseException as e:  # noqa: BLE001 - the case is that nothing is raised
            failed.append(e)

    t = threading.Thread(target=beating)
    t.start()
    t.join()
    assert not failed, failed
    case(w, "a heartbeat handle beats from another thread")


def target_cases(w):
    beat_from_a_thread(w)
    in_a_forked_child(w, [lambda: w.claim(timeout=0), w.heartbeat])
    case(w, "a forked child cannot use the worker")
    # A timeout or wait too long for any clock waits for ever: it used to panic converting
    # the seconds (PanicException: "cannot convert float seconds to Duration").
    raises(TypeError, lambda: w.claim(timeout="1"), "claim()", "timeout", "str")
    claim = w.claim(timeout=1e300)
    raises(ValueError, lambda: claim.reserve(timeout=-1), "reserve()", "timeout")
    slot = claim.reserve(timeout=1e20)
    kept = [np.asarray(slot.hidden_states)]
    raises(ValueError, lambda: slot.commit(wait=-1), "commit()", "wait")
    case(w, "an argument out of range or of a wrong type is named")
    later(0.2, kept.clear)
    slot.commit(wait=1e19)
    case(w, "a timeout past any clock waits")


def drafter_cases(w):
    beat_from_a_thread(w)
    # A state the leader cannot hand over is refused at once, not only when a rank joins (the
    # leader then failed hours in, on the restart of another rank).
    raises(TypeError, lambda: w.admit(None), "NoneType")
    raises(hspipe.HspipeError, lambda: w.admit(np.zeros(1 << 22, np.float32)), "at most")
    assert w.admit(np.zeros(8, np.float32)[::2]) == 0
    case(w, "a state that cannot be handed over is refused at once")
    # Another element type is named, with the fix (it said only "buffer contents are not
    # compatible with f32").
    raises(BufferError, lambda: w.all_reduce(np.zeros(4)), "float64 ('d')", "numpy.float32")
    case(w, "a buffer of another dtype is named")
    # Each argument's error names the method, the parameter and what it takes (they said "must
    # be real number, not str", "can't convert negative int to unsigned", "out of range integral
    # type conversion attempted", or "a bytes-like object is required, not 'NoneType'"), and
    # what was taken silently (a bucket the ring lacks, a NaN loss) is refused.
    last = w.config["ring"]["buckets"] - 1
    raises(TypeError, lambda: w.take(timeout="1"), "take()", "timeout", "seconds", "str")
    raises(ValueError, lambda: w.take(timeout=-1), "take()", "timeout", "-1")
    for bad in (-1, last + 1, 99):
        raises(ValueError, lambda: w.take(prefer=bad), "take()", "prefer", f"0 to {last}",
               f"got {bad}")
    raises(ValueError, lambda: w.progress(-1, 0.5), "progress()", "step", "got -1")
    raises(ValueError, lambda: w.progress(0, float("nan"), tokens=5), "progress()", "loss",
           "skipped=True")
    raises(TypeError, lambda: w.progress(0, "x"), "progress()", "loss", "str")
    raises(ValueError, lambda: w.progress(0, 0.5, tokens=-5), "progress()", "tokens")
    raises(ValueError, lambda: w.checkpointed(-1), "checkpointed()", "step", "got -1")
    raises(ValueError, lambda: w.all_reduce(np.zeros(4, np.float32), epoch=-1), "all_reduce()",
           "epoch", "got -1")
    raises(TypeError, lambda: w.all_reduce(None), "all_reduce()", "data", "NoneType")
    raises(TypeError, lambda: w.all_reduce([1.0]), "all_reduce()", "data", "list")
    raises(ValueError, lambda: w.join(step=-1), "join()", "step")
    raises(ValueError, lambda: w.close(wait=-1), "close()", "wait")
    case(w, "an argument out of range or of a wrong type is named")
    # Weights saved of a step this rank has not applied cannot be resumed from: refused, with
    # the step it has; a new run has no step to resume from.
    assert w.resume_step is None
    raises(hspipe.HspipeError, lambda: w.checkpointed(1), "checkpointed(1)",
           "up to step 0 only")
    case(w, "a step saved that was not applied is refused")
    # A loss without its tokens is the group's loss all the same (it was dropped as if the step
    # had trained nothing, with a warning).
    w.progress(0, 0.5)
    b = w.take(timeout=1e300)
    assert b is not None
    # A release() forgotten: the refusal names the batch held and the call to make, not the
    # ring's words ("this consumer already holds 1 item(s) ... (held_per_consumer)").
    raises(hspipe.HspipeError, lambda: w.take(timeout=1),
           f"batch {b.batch_id} was taken and not released", "call its release()")
    case(w, "a take() while a batch is held names the batch and release()")
    raises(ValueError, lambda: b.release(wait=-1), "release()", "wait", "-1")
    raises(ValueError, lambda: b.release(step=-1), "release()", "step", "got -1")
    raises(TypeError, lambda: b.release(step=1.0), "release()", "step", "float")
    case(w, "an argument out of range or of a wrong type is named")
    # A forked child inherits the worker but not its connection: a take() there took a batch
    # in this rank's name, held for ever, and its heartbeats hid it from the launcher.
    beat, view = w.heartbeat_handle(), b.input_ids
    in_a_forked_child(w, [
        lambda: w.take(timeout=0), w.heartbeat, beat, lambda: w.progress(0, 0.5),
        lambda: b.release(), lambda: b.hidden_states, lambda: memoryview(view),
        lambda: w.all_reduce(np.zeros(4, np.float32), batch=b), lambda: hspipe.connect(),
    ])
    del view
    case(w, "a forked child cannot use the worker")
    # A round that leaves out the batch held: should the rank die after it commits, before the
    # release, the launcher would give that batch to another rank, which trained it again.
    raises(hspipe.HspipeError, lambda: w.all_reduce(np.zeros(4, np.float32)),
           f"holds batch {b.batch_id}", "pass batch=")
    case(w, "a round leaving out the batch held is refused, naming it")
    # A ledger line's step says which update used the batch, and a resume keeps it or trains it
    # again by that step: one its round did not commit is refused (release(step=999) wrote
    # step 999, release(step=0) a step the batch was never in).
    r = w.all_reduce(np.zeros(4, np.float32), batch=b)
    for wrong in (r.step + 1, 999, r.step - 1):
        raises(hspipe.HspipeError, lambda: b.release(step=wrong), f"step={wrong}",
               f"round of step {r.step}")
    case(w, "a release at a step other than its round's is refused")
    kept = [np.asarray(b.hidden_states)]
    later(0.2, kept.clear)
    b.release(wait=1e300)
    case(w, "a timeout past any clock waits")
    # A batch no round named: not past the group's last step.
    b = w.take(timeout=1e300)
    raises(hspipe.HspipeError, lambda: b.release(step=r.step + 1), f"step={r.step + 1}",
           f"last committed step is {r.step}")
    b.release()
    case(w, "a release past the group's last step is refused")



if __name__ == "__main__":
    run(target_cases, drafter_cases)
