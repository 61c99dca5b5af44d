"""ZeRO-3: a sub-group's gradient partition exists from its first gradient to the update, not always.

[Note: ZeRO-3's gradient partitions between updates]
DeepSpeed allocates ZeRO-3's gradient partitions once, as one flat buffer of this rank's whole
partition (``grad_partitions_flat_buffer``, fp32 or the gradient accumulation dtype), and keeps
it for the whole run: it takes its full size in the forward, where it holds nothing, and from the
first reduced bucket of the backward on. PyTorch (and FSDP2) hold a gradient from the first
backward that produces it to ``zero_grad(set_to_none=True)``. On encoder -> LLM the buffer is
what puts our peak above FSDP2's (benchmarks/memory_breakdown.py).

Here the buffer is one per sub-group (DeepSpeed's ``sub_group_size``, the unit its update walks
through), allocated at the first access in a window and dropped after each update
(``buffers.start_window``): with sub-groups the size of a block, a block's gradient partition
comes into being as its gradients are reduced, as FSDP2's sharded gradients do. Every DeepSpeed
reader and writer reaches the partitions through ``__param_id_to_grad_partition[ds_id]``
(``partition_grads``, the epilogue's ``averaged_gradients``, ``safe_get_full_grad``), which
:class:`LazyGradPartitions` replaces: the first lookup of a sub-group allocates it, zeroed.

Values: a window starts from zeros either way (``buffers.start_window`` zeroes DeepSpeed's buffer
after each update and always accumulates), and each sub-group's partitions stay consecutive in
one buffer, in DeepSpeed's order, so the update (and ``stage3_grad_view``'s view of a sub-group)
sees the same values: DeepSpeed's bits. ``grad_partitions_flat_buffer`` is None while this is on;
its readers are the fp16 overflow check (``has_overflow``, which here ORs the sub-group buffers'
non-finite values into DeepSpeed's tracker and then runs on an empty buffer: the same decision),
the skip group's non-finite check (reads :func:`grad_buffers`) and ``offload_states``, before which
the sub-groups are copied back into one flat buffer and DeepSpeed's layout is restored for good.
``DSM_ZERO3_LAZY_GRADS=0`` keeps DeepSpeed's buffer.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from ... import compat
from ...switches import ZERO3_LAZY_GRADS, switch_on
from .partition import _GRAD_PARTITIONS

FEATURE = "stage3_lazy_grads"


class LazyGradPartitions(dict):
    """``ds_id -> this rank's gradient partition``, a view of its sub-group's buffer, which the
    first lookup in a window allocates (zeroed) and :meth:`release` drops."""

    def __init__(self, sub_groups, dtype, device):
        super().__init__()
        self.dtype, self.device = dtype, device
        self.sizes: List[int] = []
        for group, params in enumerate(sub_groups):
            offset = 0
            for p in params:
                dict.__setitem__(self, p.ds_id, (group, offset, p.partition_numel()))
                offset += p.partition_numel()
            self.sizes.append(offset)
        self.buffers: List[Optional[torch.Tensor]] = [None] * len(self.sizes)

    def buffer(self, group: int) -> torch.Tensor:
        if self.buffers[group] is None:
            self.buffers[group] = torch.zeros(self.sizes[group], dtype=self.dtype, device=self.device)
        return self.buffers[group]

    def __getitem__(self, ds_id) -> torch.Tensor:
        group, offset, numel = dict.__getitem__(self, ds_id)
        return self.buffer(group).narrow(0, offset, numel)

    def get(self, ds_id, default=None):
        return self[ds_id] if dict.__contains__(self, ds_id) else default

    def values(self):
        return [self[k] for k in self.keys()]

    def items(self):
        return [(k, self[k]) for k in self.keys()]

    def release(self) -> None:
        """Drop every sub-group's buffer: the next window starts from (lazily allocated) zeros."""
        self.buffers = [None] * len(self.sizes)


def lazy(optimizer) -> Optional[LazyGradPartitions]:
    """``optimizer``'s :class:`LazyGradPartitions`, or None where this feature is not on."""
    found = optimizer.__dict__.get(_GRAD_PARTITIONS)
    return found if isinstance(found, LazyGradPartitions) else None


def grad_buffers(optimizer) -> List[torch.Tensor]:
    """The tensors holding ``optimizer``'s gradient partitions now (unallocated ones hold zeros)."""
    partitions = lazy(optimizer)
    if partitions is not None:
        return [b for b in partitions.buffers if b is not None]
    flat = getattr(optimizer, "grad_partitions_flat_buffer", None)
    return [] if flat is None else [flat]


def nonfinite(optimizer) -> Optional[torch.Tensor]:
    """True (a 0-dim bool tensor) if a gradient partition holds an inf or a nan, as DeepSpeed's
    ``isinf().any() | isnan().any()``; None where no partition is allocated."""
    held = grad_buffers(optimizer)
    return torch.stack([~torch.isfinite(b).all() for b in held]).any() if held else None


def _restore_flat_buffer(self) -> None:
    """DeepSpeed's one flat buffer again, holding what the sub-groups hold (before ``offload_states``)."""
    partitions = lazy(self)
    if partitions is None:
        return
    flat = torch.zeros(sum(partitions.sizes), dtype=partitions.dtype, device=partitions.device)
    views = {}
    start = 0
    for group, params in enumerate(self.fp16_groups):
        if partitions.buffers[group] is not None:
            flat.narrow(0, start, partitions.sizes[group]).copy_(partitions.buffers[group])
        for p in params:
            _, offset, numel = dict.__getitem__(partitions, p.ds_id)
            views[p.ds_id] = flat.narrow(0, start + offset, numel)
        start += partitions.sizes[group]
    for group, grads in list(self.averaged_gradients.items()):
        if grads is not None:  # the epilogue's lists, pointing at the sub-group buffers
            self.averaged_gradients[group] = [views[p.ds_id] if p.requires_grad else g
                                              for p, g in zip(self.fp16_groups[group], grads)]
    setattr(self, _GRAD_PARTITIONS, views)
    self.grad_partitions_flat_buffer = flat
    compat.state(self, FEATURE, {"restored": True})


def _has_overflow(self, partition_gradients=True):
    """DeepSpeed's ``has_overflow`` over the sub-group buffers (see the Note): what its check of the
    one buffer would OR into ``inf_or_nan_tracker`` is OR-ed in first, then it checks an empty one."""
    original = compat.original(self, "has_overflow")
    partitions = lazy(self)
    if partitions is None or not partition_gradients:
        return original(partition_gradients)
    from deepspeed.accelerator import get_accelerator
    found = nonfinite(self)
    if found is not None:
        with get_accelerator().stream(self.reduce_and_partition_stream):
            self.inf_or_nan_tracker.logical_or_(found)
    self.grad_partitions_flat_buffer = torch.empty(0, dtype=partitions.dtype, device=partitions.device)
    try:
        return original(partition_gradients)
    finally:
        self.grad_partitions_flat_buffer = None


def _offload_states(self, *args, **kwargs):
    _restore_flat_buffer(self)
    return compat.original(self, "offload_states")(*args, **kwargs)


def install(optimizer) -> bool:
    """Allocate ``optimizer``'s gradient partitions per sub-group on demand; return whether it did
    (ZeRO-3 without optimizer offload or ZenFlow)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    if (not isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3) or not switch_on(ZERO3_LAZY_GRADS)
            or getattr(optimizer, "offload_optimizer", True) or getattr(optimizer, "zenflow", False)
            or not hasattr(optimizer, "inf_or_nan_tracker")
            or getattr(optimizer, "grad_partitions_flat_buffer", None) is None
            or not isinstance(optimizer.__dict__.get(_GRAD_PARTITIONS), dict)
            or not compat.fast_path_exact(optimizer, FEATURE)):
        return False
    flat = optimizer.grad_partitions_flat_buffer
    partitions = LazyGradPartitions(optimizer.fp16_groups, flat.dtype, flat.device)
    if sum(partitions.sizes) != flat.numel() or set(partitions.keys()) != set(optimizer.__dict__[_GRAD_PARTITIONS]):
        return False  # not the layout DeepSpeed 0.19 builds: keep its buffer
    setattr(optimizer, _GRAD_PARTITIONS, partitions)
    optimizer.grad_partitions_flat_buffer = None
    compat.replace_method(optimizer, "offload_states", _offload_states, FEATURE)
    compat.replace_method(optimizer, "has_overflow", _has_overflow, FEATURE)
    return True
