"""bfloat16 as numpy sees it: numpy has no bf16 type, so a bf16 section of a slot or a batch
shows, through the buffer protocol, as its uint16 bit patterns. Writing float32 values into that
uint16 array casts each float to an integer (0.3 becomes 0) and a drafter trains on garbage: a
target converts first, ``np.asarray(slot.hidden_states)[...] = hspipe.bf16_bits(states)``, and a
drafter reads ``hspipe.bf16_to_f32(np.asarray(batch.hidden_states))``. (torch has bf16: its
``torch.from_dlpack(slot.hidden_states)`` is a bf16 tensor, and ``.copy_()`` converts.)

numpy is imported when called, so ``import hspipe`` needs no numpy.
"""


def bf16_bits(x):
    """float32 values (any array-like; other float types are converted first) as bf16 bit
    patterns, uint16 of the same shape, rounded to nearest, ties to even, as torch and CUDA
    convert. NaN stays NaN; values past bf16's largest round to infinity."""
    import numpy as np

    f = np.asarray(x, dtype=np.float32)
    u = f.view(np.uint32)
    # Adding 0x7FFF plus the kept half's lowest bit rounds the dropped half to nearest, ties to
    # the even kept value; the carry moves into the exponent when the mantissa overflows.
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    # A NaN's payload could round to infinity's pattern: it keeps its top bits, made quiet.
    nan = (u >> np.uint32(16) | np.uint32(0x0040)).astype(np.uint16)
    return np.where(np.isnan(f), nan, rounded.astype(np.uint16))


def bf16_to_f32(bits):
    """bf16 bit patterns (uint16, as a bf16 view shows through numpy) as float32, exactly: a
    new array of the same shape."""
    import numpy as np

    b = np.asarray(bits)
    if b.dtype != np.uint16:
        raise TypeError(f"bf16_to_f32: bits must be uint16 bf16 patterns, got {b.dtype}")
    return (b.astype(np.uint32) << np.uint32(16)).view(np.float32)
