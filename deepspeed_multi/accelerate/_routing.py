"""Make ``deepspeed.initialize`` build MultiEngines for the duration of one ``with`` block.

[Note: how Accelerate's prepare builds MultiEngines]
``Accelerator._prepare_deepspeed`` fills the active plugin's config (batch sizes, "auto"
values, optimizer/scheduler checks) and then calls ``deepspeed.initialize``, looked up on the
``deepspeed`` module at call time. Our Accelerator runs that method unchanged inside
:func:`multi_engine_initialize`, which points ``deepspeed.initialize`` at
``deepspeed_multi.initialize`` for the call only (under a lock, restored on exit, as
``deepspeed_multi.initialize`` itself swaps the engine class). Nothing in Accelerate is patched,
and nothing changes outside our own ``prepare``.
"""
import contextlib
import threading

import deepspeed

from .. import compat

_LOCK = threading.RLock()


@contextlib.contextmanager
def multi_engine_initialize():
    from ..initialize import initialize as multi_initialize
    with _LOCK:
        original = deepspeed.initialize

        def routed(*args, **kwargs):
            # deepspeed_multi.initialize calls deepspeed.initialize itself: give it the original.
            with compat.swapped(deepspeed, "initialize", original):
                return multi_initialize(*args, **kwargs)

        with compat.swapped(deepspeed, "initialize", routed):
            yield
