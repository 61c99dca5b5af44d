"""fp32 ZeRO-1/2/3: the optimizer updates the parameter partition itself, not a copy of it.

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
Every fp32 ZeRO-3 engine holds one more fp32 copy of its partition than it needs: a fifth of
its model states with Adam (parameters, master, gradients, two moments).

:func:`install` makes the alias DeepSpeed intended, right after construction: each sub-group's
master is its parameter partition. Nothing has read the clone by then (the optimizer's state is
created at the first update), the clone holds the same values, and the copy after each update
becomes a copy onto itself, so updates are DeepSpeed's bits. One difference a user can see, and
it is PyTorch's behaviour: a parameter written outside the optimizer (under
``GatheredParameters(modifier_rank=...)``) keeps the new value at the next update, where
DeepSpeed's clone would overwrite it with the master's. Applies without optimizer offload,
NVMe swapping and Muon (their masters live elsewhere or carry state from construction), with
an optimizer that has no state yet. DeepSpeed's ``offload_states`` / ``reload_states`` move the
master and the parameters separately: the alias ends there, and the two copies hold the same values
(the update still copies the master into the parameters). ``DSM_MASTER_ALIAS=0`` keeps DeepSpeed's
clone.

ZeRO-1/2 (``stage12_master_alias``) are the same in their own names: the master
(``single_partition_of_fp32_groups``) is cloned from this rank's slice of the flat parameter
buffer (``parallel_partitioned_bit16_groups``), and ``step`` copies it back before the
all-gather. DeepSpeed does not try the alias there; making it also points the inner optimizer's
parameter group and the parameters' fp32 fragment links (``_link_all_hp_params``) at the slice.
Its ``state_dict`` saves the master as views, and ``torch.save`` writes a view's whole storage:
the flat buffer holds every rank's slice, so the saved master would be world-size times larger.
``state_dict`` therefore hands out copies of the master slices, as DeepSpeed's clone was.
"""
from __future__ import annotations

import torch

from .. import compat
from ..switches import MASTER_ALIAS, switch_on

FEATURE = "stage3_master_alias"
FEATURE_Z12 = "stage12_master_alias"
_SD_KEY = "single_partition_of_fp32_groups"  # deepspeed.checkpoint.constants.SINGLE_PARTITION_OF_FP32_GROUPS


def install(optimizer) -> dict:
    """Point each fp32 master partition of a ZeRO-1/2/3 optimizer at its parameter partition;
    return ``{feature: installed}``."""
    return {FEATURE: _install_zero3(optimizer), FEATURE_Z12: _install_zero12(optimizer)}


def _equal_tensors(lp, master) -> bool:
    return (lp is not master and lp.dtype == master.dtype and lp.device == master.device and lp.shape == master.shape
            and torch.equal(lp, master))


def _install_zero12(optimizer) -> bool:
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    if (not isinstance(optimizer, DeepSpeedZeroOptimizer) or not switch_on(MASTER_ALIAS)
            or getattr(optimizer, "cpu_offload", True) or getattr(optimizer, "zenflow", False)
            or any(getattr(p, "use_muon", False) for group in optimizer.bit16_groups for p in group)
            or len(optimizer.optimizer.state) > 0 or not compat.fast_path_exact(optimizer, FEATURE_Z12)):
        return False
    import deepspeed.comm as dist
    aliased = []
    for i, master in enumerate(optimizer.single_partition_of_fp32_groups):
        lp = optimizer.parallel_partitioned_bit16_groups[i][dist.get_rank(group=optimizer.real_dp_process_group[i])]
        group = optimizer.optimizer.param_groups[i]
        if not _equal_tensors(lp, master) or len(group["params"]) != 1 or group["params"][0] is not master:
            continue
        alias = lp.data  # shares the memory, not the flat buffer's version counter (DeepSpeed writes it through .data)
        alias.requires_grad = True  # as DeepSpeed sets on the master ("in case internal optimizer uses it")
        optimizer.single_partition_of_fp32_groups[i] = group["params"][0] = alias
        aliased.append(i)
    if not aliased:
        return False
    optimizer._link_all_hp_params()  # the parameters' fp32 fragments: views of the new master
    compat.replace_method(optimizer, "state_dict", _state_dict_with_copied_master, FEATURE_Z12)
    compat.state(optimizer, FEATURE_Z12, {"groups": aliased})
    return True


def _state_dict_with_copied_master(self):
    """DeepSpeed's ``state_dict`` with the master slices copied (see the Note: a view would save the
    whole flat parameter buffer)."""
    sd = compat.original(self, "state_dict")()
    sd[_SD_KEY] = [t.clone() for t in sd[_SD_KEY]]
    return sd


def _install_zero3(optimizer) -> bool:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    if (not isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3) or not switch_on(MASTER_ALIAS)
            or getattr(optimizer, "offload_optimizer", True) or getattr(optimizer, "swap_optimizer", True)
            or getattr(optimizer, "use_muon", False) or getattr(optimizer, "zenflow", False)
            or len(optimizer.optimizer.state) > 0 or not compat.fast_path_exact(optimizer, FEATURE)):
        return False
    aliased = []
    for i in range(len(optimizer.fp32_partitioned_groups_flat)):
        lp, master = optimizer.fp16_partitioned_groups_flat[i], optimizer.fp32_partitioned_groups_flat[i]
        if lp is None or not _equal_tensors(lp, master):
            continue
        lp.ds_id = master.ds_id
        lp.requires_grad = True  # as DeepSpeed sets on the master ("in case internal optimizer uses it")
        optimizer.fp32_partitioned_groups_flat[i] = lp
        aliased.append(i)
    if aliased:
        compat.state(optimizer, FEATURE, {"sub_groups": aliased})
    return bool(aliased)
