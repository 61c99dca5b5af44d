"""Writes that ``GatheredParameters`` without ``modifier_rank`` discards: kept as DeepSpeed keeps them, warned.

[Note: writes that GatheredParameters discards]
``deepspeed.zero.GatheredParameters(params)`` with ``modifier_rank=None`` (its default) gathers
ZeRO-3 parameters to be read: at the exit every rank keeps its own partition as it was, so a value
written to a gathered parameter (an EMA's ``param_ema.data.copy_(...)``, a reference model synced
from the policy) is dropped on every rank, silently: DeepSpeed-Chat's EMA never moves with a ZeRO-3
actor. Upstream's own check (``ds_enable_sanity_checks``, off by default) compares data pointers
and version counters, which a write through ``.data`` leaves alone. Here, at the exit of such a
gather of a MultiEngine's parameters, each rank compares its own slice of each gathered parameter
with the partition it keeps (no collective, and a 1/world share of what the gather moved), and the
first discarded write to each parameter warns, naming it and the fix (``modifier_rank=0``, which
broadcasts rank 0's values at the exit). The bits stay DeepSpeed's: the write is still dropped.
Parameters whose partition lives off the gathered parameter's device (offload) are not compared.
"""
from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)
_NAME = "_dsm_written_name"  # on each ZeRO-3 parameter of a MultiEngine: "<engine>: <name>", None once warned


def _written(param) -> bool:
    """Does this rank's slice of the gathered ``param`` differ from the partition it keeps?"""
    from ..zero.stage3.cast_on_gather import partition_value
    import deepspeed.comm as dist
    kept = partition_value(param)
    full = param.data.reshape(-1)
    if kept.device != full.device or kept.dtype != full.dtype:
        return False
    size = param.partition_numel()
    start = size * dist.get_rank(group=param.ds_process_group)
    mine = max(0, min(size, full.numel() - start))
    return mine > 0 and not torch.equal(full.narrow(0, start, mine), kept.reshape(-1).narrow(0, 0, mine))


def _exit_warning(original):

    @functools.wraps(original)
    def __exit__(self, *exc):
        if getattr(self, "enabled", False) and self.src_rank is None and exc[0] is None:
            fresh = [p for p in self.params if getattr(p, _NAME, None) and _written(p)]
            if fresh:
                names = [getattr(p, _NAME) for p in fresh]
                for p in fresh:
                    setattr(p, _NAME, None)
                named = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
                logger.warning(
                    "deepspeed_multi: %s was written inside deepspeed.zero.GatheredParameters without modifier_rank: "
                    "at the exit DeepSpeed keeps every rank's ZeRO-3 partition as it was, so the write is discarded "
                    "(as upstream). To keep it, pass modifier_rank=0 (rank 0's values are broadcast at the exit); "
                    "warned once per parameter.", named)
        return original(self, *exc)

    __exit__._dsm_discarded_writes = True
    return __exit__


def install(engine) -> None:
    """At a ZeRO-3 engine's construction: name its parameters, and wrap ``GatheredParameters.__exit__`` once."""
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters
    for name, p in engine.module.named_parameters():
        setattr(p, _NAME, f"{engine._engine_name()}: {name}")
    if not getattr(GatheredParameters.__exit__, "_dsm_discarded_writes", False):
        GatheredParameters.__exit__ = _exit_warning(GatheredParameters.__exit__)


def forget(engine) -> None:
    """``engine.destroy()``: its parameters' names go with it (a new engine over them names them again)."""
    for p in engine.module.parameters():
        if hasattr(p, _NAME):
            delattr(p, _NAME)
