"""ZeRO-3: the first parameter fetch of several engines' forwards, as one all-gather.

[Note: one fetch for several engines' forwards]
At the start of each forward ZeRO-3's coordinator gathers the parameters its trace says come
first and prefetches up to ``stage3_prefetch_bucket_size`` more, one all-gather (and one wait)
for the lot. One engine over N towers (the super-module) pays that once per forward; N engines
under one loss pay it N times, each a point where the ranks meet, and each engine's first
gather blocks its own compute. Here the engines' forwards are grouped in *rounds*: the sequence
of ZeRO-3 MultiEngine forwards (``reset_step``, DeepSpeed's start-of-forward) until an engine
comes again. When a round starts with the engine that started the previous one, the
parameters each engine of the previous round would gather first (its trace from the start,
NOT_AVAILABLE ones, up to its own prefetch bucket) are gathered in one call of DeepSpeed's
``all_gather_coalesced`` and waited for, as far as they fit in the first engine's prefetch bucket
(and ``stage3_max_live_parameters``): the super-module's one bucket, so no more parameters are
live than one engine over the same modules would hold. Each engine gets its share at its own
start of forward (counted in its coordinator's live-parameter total); its coordinator then finds
them AVAILABLE, does not gather them, and releases them as it releases its own (the trace
decides), so what is gathered is what it would have gathered, only earlier and in one collective.

Values: an all-gather moves data (no arithmetic), so parameters are bitwise those of the
engines' own fetches (asserted against ``DSM_ZERO3_JOINED_FETCH=0`` in test_zero3_joined_fetch.py and
by the fuzzer, whose ZeRO-3 programs run with it). A prediction that does not come true (an
engine of the previous round not called in this one) leaves that engine's share gathered until
the next round starts, its ``step()``/``zero_grad()``/``destroy()`` (``prefetch.drain``),
or a partition of it by DeepSpeed; then it is released. Every rank must gather the same
parameters in the same order (DeepSpeed's coalesced gather lays them out by ``ds_id``): each new
set is compared across the ranks once (one small all-reduce); a set the ranks disagree on is
never joined. Rounds follow the ranks' program order, which ZeRO-3 already requires to agree (each
forward's gather is a collective); ranks whose programs part ways fail in a collective here as
they would in the engines' own gathers (gloo: sizes differ), not with mixed parameters.

Joined: engines whose parameters are gathered by the default path (not swapped out to NVMe, no
hpZ secondary partition, no quantized weights) over the same process group; never
inside a backward (a checkpointed forward). ``DSM_ZERO3_JOINED_FETCH=0`` turns it off.
"""
from __future__ import annotations

import collections
import logging
import weakref
import zlib
from typing import List, Optional

import torch

from ... import compat
from ...autograd import graph
from ...switches import ZERO3_JOINED_FETCH, switch_on
from . import cast_on_gather as stage3_cast_on_gather

logger = logging.getLogger(__name__)
FEATURE = "stage3_joined_fetch"
_MANGLED = "_PartitionedParameterCoordinator__"
_AGREED_KEPT = 64
STATS = collections.Counter()  # "joins", "released": for tests


class _Rounds:
    """The process's rounds of ZeRO-3 forwards (see the Note); coordinators held weakly."""

    def __init__(self):
        self.current: List[weakref.ref] = []
        self.last: List[weakref.ref] = []
        self.pending = weakref.WeakKeyDictionary()  # coordinator -> its share, gathered, not yet handed over
        self.agreed = {}  # parameter set key -> whether the ranks agreed on it

    def forward_started(self, coordinator) -> None:
        if coordinator not in self.pending and (not self.current or any(r() is coordinator for r in self.current)):
            self.last, self.current = self.current or self.last, []  # a new round
            self.release_pending()
            if len(self.last) > 1 and self.last[0]() is coordinator:
                self._join([r() for r in self.last])
        if coordinator in self.pending:
            _hand_over(coordinator, self.pending.pop(coordinator))
        self.current.append(weakref.ref(coordinator))

    def release_pending(self, coordinator=None) -> None:
        """Release what was gathered for a forward that did not come (all, or ``coordinator``'s)."""
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
        for c in [coordinator] if coordinator is not None else list(self.pending.keys()):
            for p in self.pending.pop(c, ()):
                if p.ds_status == ZeroParamStatus.AVAILABLE and not p.ds_active_sub_modules:
                    p.partition()
                    STATS["released"] += 1

    def forget(self, coordinator) -> None:
        self.release_pending(coordinator)
        self.current = [r for r in self.current if r() is not coordinator]
        self.last = [r for r in self.last if r() is not coordinator]

    def _join(self, coordinators) -> None:
        first = coordinators[0]
        room = min(getattr(first, _MANGLED + "prefetch_bucket_sz"), getattr(first, _MANGLED + "max_n_available_params"))
        shares, total, group = [], 0, None
        for c in coordinators:
            share = _share(c) if c is not None else None
            if not share:
                continue
            numel = sum(p.ds_numel for p in share)
            group = share[0].ds_process_group if group is None else group
            if (shares and total + numel > room) or any(p.ds_process_group is not group for p in share):
                continue
            shares.append((c, share))
            total += numel
        if len(shares) < 2:
            return  # one engine's share: its own fetch gathers it the same way
        params = [p for _, share in shares for p in share]
        if not self._ranks_agree(params, group):
            return
        with stage3_cast_on_gather.cast_for_gather(params):
            handle = params[0].all_gather_coalesced(params)
        handle.wait()
        STATS["joins"] += 1
        for c, share in shares:
            self.pending[c] = share

    def _ranks_agree(self, params, group) -> bool:
        key = tuple(sorted((p.ds_id, p.ds_numel) for p in params))
        if key not in self.agreed:
            if len(self.agreed) >= _AGREED_KEPT:  # sets that change from step to step: compare again
                self.agreed.clear()
            import deepspeed.comm as dist
            from deepspeed.accelerator import get_accelerator
            h = zlib.crc32(repr(key).encode())
            both = torch.tensor([h, -h], dtype=torch.int64, device=get_accelerator().current_device_name())
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
            self.agreed[key] = both.tolist() == [h, -h]  # max == min: every rank has this set
            if not self.agreed[key]:
                logger.warning("deepspeed_multi: the ranks' ZeRO-3 engines would gather different parameters at the "
                               "start of this forward; each engine gathers its own (%s).", FEATURE)
        return self.agreed[key]


_ROUNDS = _Rounds()


def _share(coordinator) -> Optional[List[torch.nn.Parameter]]:
    """What ``coordinator``'s first fetch and prefetch of a forward would gather (see the Note)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    bucket = getattr(coordinator, _MANGLED + "prefetch_bucket_sz")
    if not coordinator.is_complete_trace() or bucket <= 0 or coordinator.zero_quantized_weights:
        return None
    share, numel, seen = [], 0, set()
    for entry in getattr(coordinator, _MANGLED + "param_order"):
        p = entry.param
        if id(p) in seen or p.ds_status != ZeroParamStatus.NOT_AVAILABLE:
            continue
        if p.ds_secondary_tensor is not None or hasattr(p.ds_tensor, "ds_quant_scale") or swapped_to_nvme(p):
            return None  # gathered another way: this engine fetches its own
        seen.add(id(p))
        share.append(p)
        numel += p.ds_numel
        if numel >= bucket:
            break
    return share


def swapped_to_nvme(param) -> bool:
    """Whether ZeRO-3 swaps ``param``'s partition out to NVMe (gathered through its swapper)."""
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
    return getattr(param.ds_tensor, "final_location", None) == OffloadDeviceEnum.nvme


def _hand_over(coordinator, share) -> None:
    """``coordinator``'s start of forward: its share counts as parameters it has live."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    live = _MANGLED + "n_available_params"
    setattr(coordinator, live, getattr(coordinator, live) +
            sum(p.ds_numel for p in share if p.ds_status == ZeroParamStatus.AVAILABLE))


def reset_step(self) -> None:
    """Replacement for ``PartitionedParameterCoordinator.reset_step``: DeepSpeed's, then the round."""
    compat.original(self, "reset_step")()
    if not graph.in_backward():  # not a forward recomputed inside a backward
        _ROUNDS.forward_started(self)


def coordinator_of(optimizer):
    """The ZeRO-3 parameter coordinator behind ``optimizer`` (trained or inference-only), or None."""
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    offload = (optimizer if isinstance(optimizer, DeepSpeedZeRoOffload) else
               getattr(optimizer, "parameter_offload", None))
    return None if offload is None else offload.get_param_coordinator()


def install(optimizer) -> bool:
    """Join ``optimizer``'s ZeRO-3 forward fetches with other engines'; return whether it does."""
    coordinator = coordinator_of(optimizer)
    if coordinator is None or not switch_on(ZERO3_JOINED_FETCH) or not compat.fast_path_exact(coordinator, FEATURE):
        return False
    compat.replace_method(coordinator, "reset_step", reset_step, FEATURE)
    compat.state(optimizer, FEATURE, {})  # so that compat.installed(optimizer, FEATURE) sees it
    return True


def release_pending(coordinator) -> None:
    """Release what was gathered for this coordinator's next forward (``prefetch.drain``)."""
    _ROUNDS.release_pending(coordinator)


def forget(optimizer) -> None:
    """``destroy()``: this engine takes part in no more rounds."""
    coordinator = coordinator_of(optimizer)
    if coordinator is not None and compat.installed(coordinator, FEATURE):
        _ROUNDS.forget(coordinator)
        compat.restore(coordinator, FEATURE)
        compat.restore(optimizer, FEATURE)
