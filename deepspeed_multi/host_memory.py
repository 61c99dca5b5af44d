"""The host heap an engine's construction frees, handed back to the operating system once.

[Note: construction's free heap]
Building a ZeRO engine makes host copies that live only during construction: the flattened and
partitioned copies of the parameters, the fp32 master built from them, the bucket DeepSpeed
allocates before it is resized. glibc's ``free`` keeps freed chunks of its heap (and, once one large
block has been freed, every allocation below the size of that block) for reuse, so after a CPU
engine is built its process keeps tens of MiB resident that no tensor holds; training does not
reuse much of it, because its allocations come in other sizes. After each ``initialize``,
``malloc_trim(0)`` hands the free pages of every heap back to the system: one call per engine, far
shorter than the construction it follows, that frees nothing any tensor or Python object still holds. Not
glibc (another C library, another OS): nothing is done. ``DSM_TRIM_AFTER_BUILD=0`` skips it (for A/B
runs).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools

from .switches import TRIM_AFTER_BUILD, switch_on


@functools.lru_cache(maxsize=None)
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc: no malloc_trim
        return None


def release_free_heap() -> bool:
    """Give the C heap's free pages back to the system (see the Note); whether it was done."""
    trim = _malloc_trim()
    if trim is None or not switch_on(TRIM_AFTER_BUILD):
        return False
    trim(0)
    return True
