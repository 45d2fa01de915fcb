"""hspipe's Python workers: a user's own target or drafter (numpy, PyTorch) runs as an hspipe
worker, zero-copy on the ring, supervised like hspipe's own.

``hspipe.connect()`` returns this process's worker (a ``Target`` or a ``Drafter``); the README's
section "Your own model in Python: the `hspipe` package" documents the whole API with an example
of each kind. ``hspipe.bf16_bits`` and ``hspipe.bf16_to_f32`` convert float32 to and from the
bf16 bit patterns numpy shows for a bf16 section. ``hspipe.dist.TorchGroup`` (import it where
torch is installed) runs the drafter group's gradient exchange on torch.distributed (NCCL on
GPUs, gloo on the CPU).
"""

import atexit

from . import _hspipe
from .bf16 import bf16_bits, bf16_to_f32  # noqa: F401  (the package's API)
from ._hspipe import (  # noqa: F401  (the package's API)
    Batch,
    Claim,
    Drafter,
    GroupChanged,
    HspipeError,
    PhaseScope,
    Reduced,
    Slot,
    Target,
    View,
    connect,
)

# Objects of the worker that another thread let go of go back to the worker's thread at its next
# call; at the interpreter's exit too (atexit runs on the main thread, the usual worker's).
atexit.register(_hspipe._bring_home)
