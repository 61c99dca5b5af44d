"""ZeRO-3: the update reads its fp32 gradient in place, not from a flattened copy of it.

[Note: ZeRO-3's gradient for the update]
Before each sub-group's update DeepSpeed's ``DeepSpeedZeroOptimizer_Stage3._prepare_fp32_grad_
for_sub_group`` flattens the sub-group's gradient partitions (``averaged_gradients``) into a new
tensor and hands it to the optimizer as the fp32 master partition's ``.grad``. Without optimizer
offload those partitions are consecutive views of one buffer, ``grad_partitions_flat_buffer``
(DeepSpeed lays it out in sub-group order), so the copy holds exactly what the buffer holds: one
more partition-sized fp32 tensor during the update and one pass over it per update; on CPU a
fresh tensor larger than glibc's mmap threshold (32 MiB at most) is page-faulted in on every
update (measured in benchmarks/zero3_grad_view.py; figures in benchmarks/PERFORMANCE.md). :func:`prepare_fp32_grad` hands the optimizer one view of
the buffer instead when the partitions are one run of the master's dtype, and calls DeepSpeed's
method otherwise (a 16-bit gradient buffer, which the master's fp32 needs converted; a list
with a tensor outside the buffer; a layout some DeepSpeed version changes).

The optimizer sees the same values, so the update is bit-identical (asserted against DeepSpeed's
copy and against plain PyTorch in tests/multi_gpu/test_zero3_step.py; every fp32 ZeRO-3 scenario of
the matrix and of the fuzzer runs through it). What changes is that the update's in-place work
on ``.grad`` (the unscale and clip, ``DeepSpeedZeroOptimizer_Stage3.unscale_and_clip_grads``)
now lands in the buffer instead of in the copy. Nothing reads the buffer between the update and
the next window's zeroing (``buffers.start_window``, right after every update; the test
asserts the buffer is zero then), so no reader can tell.

``DSM_ZERO3_GRAD_VIEW=0`` keeps DeepSpeed's copy (for A/B benchmarks).
"""
from __future__ import annotations

from typing import Optional

import torch
from deepspeed.accelerator import get_accelerator

from ... import compat
from ...switches import ZERO3_GRAD_VIEW as ENV
from ...switches import switch_on
from ..runs import run_view

FEATURE = "stage3_grad_view"
_METHOD = "_prepare_fp32_grad_for_sub_group"


def one_view(grads, master: torch.Tensor) -> Optional[torch.Tensor]:
    """A 1-D view covering ``grads`` if they are consecutive views of one storage, of ``master``'s
    dtype and device, with ``master.numel()`` elements in all; else ``None``."""
    if not grads or any(g.dtype != master.dtype or g.device != master.device for g in grads):
        return None
    return run_view(grads, master.numel())


def prepare_fp32_grad(self, sub_group_id):
    """Replacement for ``_prepare_fp32_grad_for_sub_group`` (bound to a ZeRO-3 optimizer)."""
    master = self.fp32_partitioned_groups_flat[sub_group_id]
    view = one_view(self.averaged_gradients[sub_group_id], master)
    if view is None:
        return compat.original(self, _METHOD)(sub_group_id)
    master.grad = view
    accelerator = get_accelerator()
    if not accelerator.is_synchronized_device() and accelerator.on_accelerator(view):
        view.record_stream(accelerator.current_stream())  # as DeepSpeed does for each partition
    self.averaged_gradients[sub_group_id] = None


def install(optimizer) -> bool:
    """Give ``optimizer``'s update a view of the gradient buffer; return whether it did."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    if not switch_on(ENV):
        return False
    if (not isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3) or getattr(optimizer, "offload_optimizer", True)
            or not hasattr(optimizer, "fp32_partitioned_groups_flat") or not compat.fast_path_exact(optimizer, FEATURE)):
        return False
    compat.replace_method(optimizer, _METHOD, prepare_fp32_grad, FEATURE)
    return True
