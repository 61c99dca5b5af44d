"""ZeRO-3 in fp32: the optimizer updates the parameter partition itself, not a copy of it.

[Note: one fp32 partition, not two]
ZeRO-3 keeps each rank's parameter partition in a flat buffer per sub-group
(``fp16_partitioned_groups_flat``: bf16/fp16 in mixed precision, fp32 otherwise) and gives the
optimizer an fp32 "master" partition (``fp32_partitioned_groups_flat``); after each update
``_reassign_or_swap_out_partitioned_parameters`` copies the master into the parameter partition.
When the parameters are already fp32 on the optimizer's device the master is a second copy of
the same values, and DeepSpeed means to alias the two then (``_create_fp32_partitions``: "we
don't need another copy of the weights"). Its test, ``partition.device == self.device``,
compares a ``torch.device`` with ``self.device``, which is a string
(``get_accelerator().current_device_name()``): never equal, so DeepSpeed 0.19 always clones.
Every fp32 ZeRO-3 engine holds one more fp32 copy of its partition than it needs: a quarter of
its model states with Adam.

:func:`install` makes the alias DeepSpeed intended, right after construction: each sub-group's
master is its parameter partition. Nothing has read the clone by then (the optimizer's state is
created at the first update), the clone holds the same values, and the copy after each update
becomes a copy onto itself, so updates are DeepSpeed's bits. One difference a user can see, and
it is PyTorch's behaviour: a parameter written outside the optimizer (under
``GatheredParameters(modifier_rank=...)``) keeps the new value at the next update, where
DeepSpeed's clone would overwrite it with the master's. Applies without optimizer offload,
NVMe swapping and Muon (their masters live elsewhere or carry state from construction), with
an optimizer that has no state yet. ``DSM_MASTER_ALIAS=0`` keeps DeepSpeed's clone.
"""
from __future__ import annotations

import torch

from .. import compat
from ..switches import MASTER_ALIAS, switch_on

FEATURE = "stage3_master_alias"


def _aliasable(optimizer, i) -> bool:
    lp, master = optimizer.fp16_partitioned_groups_flat[i], optimizer.fp32_partitioned_groups_flat[i]
    return (lp is not None and master is not lp and lp.dtype == master.dtype and lp.device == master.device
            and lp.shape == master.shape and torch.equal(lp, master))


def install(optimizer) -> bool:
    """Point each fp32 ZeRO-3 master partition at its parameter partition; return whether it did."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    if (not isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3) or not switch_on(MASTER_ALIAS)
            or getattr(optimizer, "offload_optimizer", True) or getattr(optimizer, "swap_optimizer", True)
            or getattr(optimizer, "use_muon", False) or getattr(optimizer, "zenflow", False)
            or len(optimizer.optimizer.state) > 0 or not compat.fast_path_exact(optimizer, FEATURE)):
        return False
    aliased = []
    for i in range(len(optimizer.fp32_partitioned_groups_flat)):
        if not _aliasable(optimizer, i):
            continue
        lp, master = optimizer.fp16_partitioned_groups_flat[i], optimizer.fp32_partitioned_groups_flat[i]
        lp.ds_id = master.ds_id
        lp.requires_grad = True  # as DeepSpeed sets on the master ("in case internal optimizer uses it")
        optimizer.fp32_partitioned_groups_flat[i] = lp
        aliased.append(i)
    if aliased:
        compat.state(optimizer, FEATURE, {"sub_groups": aliased})
    return bool(aliased)
