"""ZeRO-1/2: the update reads this rank's gradient partition in place, not from a flattened copy.

[Note: ZeRO-1/2's gradient for the update]
At every update ``DeepSpeedZeroOptimizer.step`` flattens this rank's partition of the reduced
gradients (``averaged_gradients[i]``, the list of views ``get_flat_partition`` returns) into a
new tensor, unless ``_get_preflattened_grad_partition`` hands it one already flat (DeepSpeed's
hook for DeepCompile). With ``contiguous_gradients`` those gradients already live in one buffer,
``grads_in_partition``: ``copy_grads_in_partition`` copies each reduced gradient of a parameter
in this rank's partition there. It copies at a running offset, in reduction order (the reverse
of the parameters' order in ZeRO-2's backward), so the list is not one run and the flatten is a
real copy: a partition-sized allocation per update (on CPU, page-faulted in whenever glibc has
returned the memory) and one pass over it.

Two per-instance replacements make the list one run and let the update take a view:

* :func:`copy_in_partition_order` (``copy_grads_in_partition``): each gradient goes to a fixed
  slot, the parameter's place in ``params_in_partition`` order (the order in which DeepSpeed sizes
  the buffer), instead of the next free offset. The same copy into the same buffer, only at a
  place that does not depend on when the reduction ran; nothing else reads the offset.
* :func:`preflattened_partition` (``_get_preflattened_grad_partition``): DeepSpeed's answer if it
  has one; else, if ``averaged_gradients[i]`` is one run of ``partition_size`` elements, a 1-D
  view of it; else ``None``, and DeepSpeed flattens as before.

The flatten stays where the list is not one run: the zero padding DeepSpeed appends on the rank
whose partition runs past the end of the group, a parameter without a gradient (a
``zeros_like``), more than one parameter group in a partition's buffer... Not installed with CPU
offload (its own fp32 gradient buffer) or where DeepSpeed's methods are overridden; the fp32
accumulation buffer of 16-bit weights (``_use_compact_grad_partition_buffer``) is already flat
and DeepSpeed hands it over itself.

The optimizer sees the same values, so the update is bit-identical (asserted against the flatten
and against plain PyTorch in tests/multi_gpu/test_zero12_step.py). What changes is that the
update's in-place unscale and clip (``unscale_and_clip_grads``) lands in ``grads_in_partition``
rather than in the copy. DeepSpeed has already cleared every ``param.grad`` pointing there
(``free_grad_in_param_list``, right before), and the next backward allocates a new buffer, so no
reader can tell.

The same view serves the overflow check before the update: ``has_overflow_partitioned_grads_serial``
tests every gradient of the partition for inf/nan one tensor at a time (an ``amax``, an ``amin``
and two ``isfinite`` per parameter, before every bf16/fp16 update); :func:`partition_has_overflow`
tests each group's partition once, as one run. A value is non-finite in the run exactly when it is
in one of its tensors, so the decision is the same. Where the gradient norm is on, step() asks for
no flag at all: the norm's all-reduce decides overflow (zero12_overflow.py); this check serves
``compute_grad_norm: false`` and the configurations zero12_overflow leaves alone.

``DSM_ZERO12_GRAD_VIEW=0`` keeps DeepSpeed's flatten and its per-tensor check (for A/B benchmarks).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from deepspeed.accelerator import get_accelerator

from ... import compat
from ...switches import ZERO12_GRAD_VIEW as ENV
from ...switches import switch_on
from ..runs import one_run, run_view

FEATURE = "stage12_grad_view"
OVERFLOW_FEATURE = "stage12_overflow_view"
_COPY = "copy_grads_in_partition"
_PREFLATTENED = "_get_preflattened_grad_partition"
_OVERFLOW = "has_overflow_partitioned_grads_serial"


def partition_slots(optimizer) -> Tuple[Dict[int, int], int]:
    """Each partition parameter's offset in ``grads_in_partition``, in ``params_in_partition``
    order (the order in which ``copy_grads_in_partition`` sums the buffer's size), and that size."""
    slots, offset = {}, 0
    for group in optimizer.params_in_partition:
        for param in group:
            slots[optimizer.get_param_id(param)] = offset
            offset += param.numel()
    return slots, offset


def copy_in_partition_order(self, param, group_idx=None):
    """Replacement for ``copy_grads_in_partition`` (bound to a ZeRO-1/2 optimizer)."""
    state = compat.state(self, FEATURE)
    slot = state["slots"].get(self.get_param_id(param))
    if group_idx is None:
        group_idx = self._get_param_group_idx(param)
    if slot is None or self.cpu_offload or self._use_compact_grad_partition_buffer(group_idx):
        return compat.original(self, _COPY)(param, group_idx)  # paths that do not use grads_in_partition
    if self.grads_in_partition is None:  # sized as DeepSpeed sizes it
        self.grads_in_partition = torch.empty(state["numel"], dtype=self.dtype,
                                              device=get_accelerator().current_device_name())
    self.grads_in_partition_offset = slot
    compat.original(self, _COPY)(param, group_idx)


def preflattened_partition(self, group_idx):
    """Replacement for ``_get_preflattened_grad_partition`` (bound to a ZeRO-1/2 optimizer)."""
    flat = compat.original(self, _PREFLATTENED)(group_idx)
    if flat is not None:
        return flat
    grads = self.averaged_gradients.get(group_idx)
    if grads is None:
        return None
    view = run_view(grads, int(self.partition_size[group_idx]))
    if view is not None:
        accelerator = get_accelerator()
        if not accelerator.is_synchronized_device() and accelerator.on_accelerator(view):
            view.record_stream(accelerator.current_stream())
    return view


def partition_views(optimizer) -> Optional[List[torch.Tensor]]:
    """Each group's gradient partition (``averaged_gradients[i]``, its tensors that are not None)
    as one 1-D view, leaving out groups with nothing in them; ``None`` if some group's tensors do
    not lie one after another in one buffer (or are sparse)."""
    views = []
    for i in range(len(optimizer.bit16_groups)):
        grads = [g for g in optimizer.averaged_gradients[i] if g is not None]
        if any(g.is_sparse for g in grads):
            return None
        if all(g.numel() == 0 for g in grads):
            continue
        view = one_run(grads)
        if view is None:
            return None
        views.append(view)
    return views


def partition_has_overflow(self):
    """Replacement for ``has_overflow_partitioned_grads_serial`` (bound to a ZeRO-1/2 optimizer):
    DeepSpeed's per-tensor test (``_has_inf_or_nan``, counted into one flag) on each group's run."""
    views = partition_views(self)
    if views is None:
        return compat.original(self, _OVERFLOW)()
    invalid_grad_count = torch.zeros([1], dtype=torch.float, device=get_accelerator().current_device_name())
    for view in views:
        invalid_grad_count += self._has_inf_or_nan(view)
    return invalid_grad_count.bool()


def install(optimizer) -> bool:
    """Give ``optimizer``'s update a view of its gradient partition; return whether it did."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    if not switch_on(ENV):
        return False
    if (not isinstance(optimizer, DeepSpeedZeroOptimizer) or getattr(optimizer, "cpu_offload", True)
            or not getattr(optimizer, "contiguous_gradients", False) or not compat.fast_path_exact(optimizer, FEATURE)):
        return False
    slots, numel = partition_slots(optimizer)
    compat.state(optimizer, FEATURE, {"slots": slots, "numel": int(numel)})
    compat.replace_method(optimizer, _COPY, copy_in_partition_order, FEATURE)
    compat.replace_method(optimizer, _PREFLATTENED, preflattened_partition, FEATURE)
    if compat.fast_path_exact(optimizer, OVERFLOW_FEATURE):
        compat.replace_method(optimizer, _OVERFLOW, partition_has_overflow, OVERFLOW_FEATURE)
    return True
