"""ZeRO-3: the update reads its fp32 gradient in place, not from a flattened copy of it.

[Note: ZeRO-3's gradient for the update]
Before each sub-group's update DeepSpeed's ``DeepSpeedZeroOptimizer_Stage3._prepare_fp32_grad_
for_sub_group`` flattens the sub-group's gradient partitions (``averaged_gradients``) into a new
tensor and hands it to the optimizer as the fp32 master partition's ``.grad``. Without optimizer
offload those partitions are consecutive views of one buffer, ``grad_partitions_flat_buffer``
(DeepSpeed lays it out in sub-group order), so the copy holds exactly what the buffer holds: one
more partition-sized fp32 tensor at the update's peak and one pass over it per update; on CPU a
fresh tensor of more than glibc's mmap threshold (32 MiB) is page-faulted in on every update
(35 ms of an 80 ms ZeRO-3 step at 14.6M parameters per rank). :func:`prepare_fp32_grad` hands
the optimizer one view of the buffer instead when the partitions are one run of that dtype, and
calls DeepSpeed's method otherwise (a frozen parameter's zeros in the list, a gradient
accumulation dtype other than the master's, a layout some DeepSpeed version changes).

The values the optimizer sees are the same tensors, so the update is bit-identical (asserted end
to end in tests/unit/test_zero3_step.py and by the fused matrix against this path turned off).
What changes is that the update's in-place work on ``.grad`` (the unscale and clip,
``DeepSpeedZeroOptimizer_Stage3.unscale_and_clip_grads``) now lands in the buffer instead of in
the copy. Nothing reads the buffer between the update and the next window's zeroing
(``zero_buffers.start_window``, called right after every update), so no reader can tell.

``DSM_ZERO3_GRAD_VIEW=0`` keeps DeepSpeed's copy (for A/B benchmarks).
"""
from __future__ import annotations

import os
import types
from typing import Optional

import torch
from deepspeed.accelerator import get_accelerator

from .fused_zero import consecutive_runs, flat_run

ENV = "DSM_ZERO3_GRAD_VIEW"
_ATTR = "_dsm_zero3_step"
_METHOD = "_prepare_fp32_grad_for_sub_group"


def one_view(grads, master: torch.Tensor) -> Optional[torch.Tensor]:
    """A 1-D view covering ``grads`` if they are consecutive views of one storage, of ``master``'s
    dtype and device, with ``master.numel()`` elements in all; else ``None``."""
    if not grads or any(g.dtype != master.dtype or g.device != master.device for g in grads):
        return None
    if consecutive_runs(grads) != [(0, len(grads))]:
        return None
    view = flat_run(grads)
    return view if view.numel() == master.numel() else None


def prepare_fp32_grad(self, sub_group_id):
    """Replacement for ``_prepare_fp32_grad_for_sub_group`` (bound to a ZeRO-3 optimizer)."""
    master = self.fp32_partitioned_groups_flat[sub_group_id]
    view = one_view(self.averaged_gradients[sub_group_id], master)
    if view is None:
        return self._dsm_zero3_step["original"](sub_group_id)
    master.grad = view
    accelerator = get_accelerator()
    if not accelerator.is_synchronized_device() and accelerator.on_accelerator(view):
        view.record_stream(accelerator.current_stream())  # as DeepSpeed does for each partition
    self.averaged_gradients[sub_group_id] = None


def install(optimizer) -> bool:
    """Give ``optimizer``'s update a view of the gradient buffer; return whether it did."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    if os.environ.get(ENV, "1").strip() == "0" or getattr(optimizer, _ATTR, None) is not None:
        return False
    if (not isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3) or getattr(optimizer, "offload_optimizer", True)
            or _METHOD in vars(optimizer)
            or getattr(type(optimizer), _METHOD, None) is not getattr(DeepSpeedZeroOptimizer_Stage3, _METHOD, None)
            or not hasattr(optimizer, "fp32_partitioned_groups_flat")):
        return False
    optimizer._dsm_zero3_step = {"original": getattr(optimizer, _METHOD)}
    setattr(optimizer, _METHOD, types.MethodType(prepare_fp32_grad, optimizer))
    return True
