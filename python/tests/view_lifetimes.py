"""The view-lifetime cases, run as a worker by test_workers.py (as a target, or as the
only drafter): each case that holds appends its name to <run-dir>/view-cases.txt; then the
worker goes on as the numpy example does, so the run completes.
"""
import ctypes
import hashlib
import threading
import time

import numpy as np

import hspipe
from cases import numpy_target, raises, recorder, run

case = recorder("view-cases.txt")


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32),
                ("device_id", ctypes.c_int32), ("ndim", ctypes.c_int32),
                ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.c_void_p),
                ("byte_offset", ctypes.c_uint64)]


class Versioned(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32),
                ("ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("t", DLTensor)]


def dlpack_info(view):
    """(type code, bits, shape, read-only flag) of a view's versioned DLPack capsule: a
    consumer written here, for bf16, which numpy cannot hold."""
    cap = view.__dlpack__(max_version=(1, 0))
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    m = Versioned.from_address(get(cap, b"dltensor_versioned"))
    shape = [m.t.shape[i] for i in range(m.t.ndim)]
    info = (m.t.code, m.t.bits, shape, m.flags & 1)
    del cap  # never consumed: its destructor gives the export back
    return info


def target_cases(w):
    cfg = w.config["model"]
    claim = w.claim()
    T = claim.tokens
    assert not np.asarray(claim.input_ids).flags.writeable
    slot = claim.reserve()
    assert slot.hidden_states.shape == (T, cfg["layers"], cfg["hidden"])
    assert dlpack_info(slot.hidden_states) == (4, 16, [T, cfg["layers"], cfg["hidden"]], 0)
    case(w, "bf16 via dlpack")
    a = np.asarray(slot.hidden_states)
    raises(hspipe.HspipeError, slot.commit, "hidden_states (1)")
    d = np.from_dlpack(slot.target_tokens)
    raises(hspipe.HspipeError, slot.commit, "hidden_states (1)", "target_tokens (1)")
    case(w, "commit with live views names them")
    del a, d
    ro = np.asarray(slot.input_ids)
    assert not ro.flags.writeable and np.array_equal(ro, np.asarray(claim.input_ids))
    raises(TypeError, lambda: memoryview(slot.input_ids).cast("B").__setitem__(0, 1))
    # A consumer that asks for writable memory is refused.
    raises((TypeError, BufferError), lambda: (ctypes.c_char * 4).from_buffer(slot.input_ids))
    del ro
    case(w, "read-only sections")
    ids = np.asarray(claim.input_ids).copy()
    positions = np.concatenate([np.arange(n) for n in claim.seq_lens])
    states, greedy = numpy_target.forward(ids, positions, cfg["layers"], cfg["hidden"])
    a = np.asarray(slot.hidden_states)
    a[...] = states
    np.from_dlpack(slot.target_tokens)[...] = greedy
    kept = [a]
    del a
    # Another thread lets go of the last view while commit waits for it.
    threading.Thread(target=lambda: (time.sleep(0.2), kept.clear())).start()
    slot.commit(wait=30.0)
    case(w, "commit waits for views to go")
    raises(hspipe.HspipeError, lambda: slot.hidden_states, "committed")
    case(w, "no view after commit")

    # A slot dropped while a view lives is kept, never reused, until the view goes.
    claim = w.claim()
    slot = claim.reserve()
    held = slot.hidden_states
    a = np.asarray(held)
    a[...] = 7
    del slot, claim
    assert w.deferred == 1, w.deferred
    assert (a == 7).all()
    raises(hspipe.HspipeError, w.close, "live views")
    case(w, "a dropped slot is kept while viewed")
    del a
    assert w.deferred == 0
    case(w, "and given back after")
    del held
    # Dropped without commit() or abort(): the next call says so, once.
    raises(hspipe.HspipeError, w.claim, "dropped without commit() or abort()")


def drafter_cases(w):
    b = w.take()
    assert b is not None
    x = np.asarray(b.hidden_states)
    assert not x.flags.writeable
    code, bits, shape, read_only = dlpack_info(b.hidden_states)
    assert (code, bits, read_only) == (4, 16, 1) and shape == list(x.shape)
    t = np.from_dlpack(b.target_tokens)
    assert not t.flags.writeable
    case(w, "drafter views are read-only")
    raises(hspipe.HspipeError, b.release, "hidden_states (1)", "target_tokens (1)")
    case(w, "release with live views names them")
    kept = x.copy()
    del x, t
    hidden = w.config["model"]["hidden"]
    r = w.all_reduce(np.zeros(2 * hidden + 2, dtype=np.float32), batch=b, ended=False)
    digest = hashlib.sha256(np.zeros(2 * hidden, dtype=np.float32).tobytes()).hexdigest()[:16]
    v = b.hidden_states
    b.release(step=r.step, digest=digest)
    raises(BufferError, lambda: memoryview(v), "released")
    raises(BufferError, lambda: np.from_dlpack(v), "released")
    case(w, "no view after release")
    assert kept.shape[0] == b.tokens
    b = w.take()
    y = np.asarray(b.input_ids)
    del b
    assert w.deferred == 1, w.deferred
    raises(hspipe.HspipeError, w.take, "dropped without release()", "views")
    case(w, "a dropped batch still viewed: take() says why it cannot")
    del y
    assert w.deferred == 0, w.deferred



if __name__ == "__main__":
    run(target_cases, drafter_cases)
