"""What building an engine leaves resident on the host: the heap its construction frees, handed back to
the operating system once, and DeepSpeed's Muon kernels, compiled when Muon first runs.

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

[Note: Muon's kernels compiled at their first call]
Building a ZeRO or bf16 optimizer imports DeepSpeed's Muon module to ask whether the optimizer is
Muon (``is_zero_supported_optimizer``, the ZeRO-3 and bf16 optimizers' constructors, ZeRO-1/2's
``average_tensor``). That module decorates its kernels with ``torch.compile`` (through
``deepspeed.runtime.compiler.compile``) when it is imported, and the first ``torch.compile`` call of a
process imports Inductor and what it needs (sympy's solvers, networkx): about 43 MiB resident on every
rank and a second or more of construction, paid by a process that never runs Muon. ``torch.compile``
compiles nothing until the function is called, so calling it then instead changes only when those
imports happen: before the first engine is built, where the module is not imported yet, it is imported
with DeepSpeed's ``compile()`` handing each kernel a wrapper that calls the same ``torch.compile`` at
the kernel's first call and the compiled function from then on. Inside a region being compiled the
wrapper calls the kernel itself, which dynamo inlines as it inlines a compiled function called there.
A module the program imported first (it uses Muon directly) is left as DeepSpeed made it.
``DSM_MUON_COMPILE_AT_FIRST_CALL=0`` imports it as DeepSpeed does (for A/B runs).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib
import sys

import torch

from . import compat
from .switches import MUON_COMPILE_AT_FIRST_CALL, TRIM_AFTER_BUILD, switch_on

# The module whose import compiles (DeepSpeed 0.19.x); DeepSpeed's other Muon module imports it.
MUON_KERNELS = "deepspeed.runtime.zero.muon.original_muon"


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


def compiled_at_first_call(fn, compile_fn):
    """``fn``, run as ``compile_fn(fn)`` made at its first call (see the Note)."""
    compiled = None

    @functools.wraps(fn)
    def kernel(*args, **kwargs):
        nonlocal compiled
        if torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        if compiled is None:
            compiled = compile_fn(fn)
        return compiled(*args, **kwargs)

    kernel.compiled_at_first_call = True
    return kernel


def import_muon_kernels() -> bool:
    """Import DeepSpeed's Muon kernels compiled at their first call (see the Note), unless the module is
    already imported or cannot be; whether it was imported here. Callers hold the engine lock."""
    if MUON_KERNELS in sys.modules or not switch_on(MUON_COMPILE_AT_FIRST_CALL):
        return False
    try:
        from deepspeed.runtime import compiler
    except ImportError:
        return False
    deepspeeds = getattr(compiler, "compile", None)
    if not callable(deepspeeds):
        return False
    at_first_call = lambda: functools.partial(compiled_at_first_call, compile_fn=deepspeeds())  # noqa: E731
    with compat.swapped(compiler, "compile", at_first_call):
        try:
            importlib.import_module(MUON_KERNELS)
        except ImportError:  # a DeepSpeed without Muon
            return False
    return True
