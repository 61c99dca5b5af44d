"""bf16/fp16 ZeRO-3: a parameter's 16-bit partition is cast from the fp32 master when it is gathered.

[Note: one parameter partition in mixed precision]
In bf16 or fp16 ZeRO-3 DeepSpeed keeps two copies of each rank's parameter partition: the fp32
master the optimizer updates (``fp32_partitioned_groups_flat``) and a 16-bit copy
(``lp_param_buffer``, viewed per sub-group as ``fp16_partitioned_groups_flat`` and per parameter
as ``param.ds_tensor``), rewritten from the master after every update
(``_reassign_or_swap_out_partitioned_parameters``) and read only when the parameter is gathered.
FSDP2 keeps the fp32 shard alone and casts it on the way to its all-gather. The copy is 2 bytes
per partition element, a third of the parameters' memory and the whole of what keeps our peak
above FSDP2's in bf16 on encoder -> LLM (``benchmarks/memory_breakdown.py``).

Here the 16-bit buffer is released after construction and each ``ds_tensor`` is a placeholder
of the right shape and dtype: one NaN, expanded (a read by anything this module does not know
of is NaN, loudly; an in-place write raises). The gathers (``Init._all_gather``, class-wide, for
``GatheredParameters`` and the persistent parameters; each module parameter's
``all_gather_coalesced``, for the forward's and backward's fetches) first put a fresh tensor in
``ds_tensor``, the master's slice cast to the parameter's dtype, and put the placeholder back
when the call returns. The fresh tensor is a new object, so an asynchronous collective that still
holds it keeps it alive until it completes, as it does DeepSpeed's own staging copies.

Values: DeepSpeed's copy is ``copy_`` of the master (round to nearest even) after each update
and at construction the master is the copy's exact widening, so a cast at gather time gives the
same bits, except where DeepSpeed's copy and its master part ways between updates. Those are
kept as DeepSpeed keeps them: a parameter written under ``GatheredParameters(modifier_rank=...)``
(``Init._partition(has_been_updated=True)``) or whose master is written by
``safe_set_full_fp32_param`` / ``safe_set_local_fp32_param`` is *pinned*: its ``ds_tensor`` is
a real copy of DeepSpeed's 16-bit value, which the write changes (or does not, for a master
write), until the next update of its sub-group overwrites it from the master, as DeepSpeed's
update does. A partition replaced by assignment (``param.ds_tensor.data = value``, as DeepSpeed's
own tests do) is pinned the same way at the next read (a gather, DeepSpeed's layout): upstream
that value is the partition until the update re-views the partition into the buffer, so here it
is ``ds_tensor`` until that update too (``_take_assigned``). Every other DeepSpeed method that reads or writes the 16-bit buffer (the
checkpoint loads, ``refresh_fp32_params``) runs on DeepSpeed's layout: the buffer is rebuilt
from the masters and the pinned copies before it, and released after it, pinning any parameter
whose 16-bit value then differs from its master's cast. ``offload_states`` and ``destroy()``
rebuild it for good (a new engine over the module builds its partitions from it).

Applies to ZeRO-3 with 16-bit parameters on the optimizer's device: not with parameter or
optimizer offload, NVMe, hpZ (secondary partitions), quantized weights, ZenFlow or Muon.
``DSM_ZERO3_CAST_ON_GATHER=0`` keeps DeepSpeed's copy.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import List

import torch

from ... import compat
from ...switches import ZERO3_CAST_ON_GATHER, switch_on

FEATURE = "stage3_cast_on_gather"
FEATURE_INIT = "stage3_cast_on_gather_init"  # the gathers, on deepspeed.zero.Init
_SOURCE = "_dsm_cast_source"  # on each parameter: (state, sub_group, offset, placeholder)
# DeepSpeed methods that read or write the 16-bit buffer: run on DeepSpeed's layout.
_ON_DEEPSPEED_LAYOUT = ("_restore_from_bit16_weights", "_rigid_load_state_dict",
                        "load_hp_checkpoint_state_from_checkpoint_dir_stage3",
                        "load_module_checkpoint_state_from_checkpoint_dir_stage3")


class _CastOnGather:
    """One optimizer's parameters, their places in its sub-groups, and the buffer's state."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        flat = optimizer.lp_param_buffer
        self.dtype, self.device = flat.dtype, flat.device
        self.nan = torch.full((1, ), float("nan"), dtype=self.dtype, device=self.device)
        self.on = True
        self.layout_depth = 0  # > 0 while DeepSpeed's layout is rebuilt for one of its methods

    def master_cast(self, group: int, offset: int, numel: int) -> torch.Tensor:
        master = self.optimizer.fp32_partitioned_groups_flat[group].detach()  # (it requires grad)
        return master.narrow(0, offset, numel).to(self.dtype)

    def poison(self, t: torch.Tensor) -> None:
        n = t.numel()  # (one element would be the shared NaN itself, writable: its own then)
        t.data = self.nan.expand(n) if n != 1 else self.nan.clone()
        t._dsm_poison_ptr = t.data_ptr()  # a ``.data =`` assignment changes it (_take_assigned)

    def params(self):
        """(sub-group, parameter, offset in the sub-group, placeholder) for every parameter."""
        opt = self.optimizer
        for group, (params, placeholders) in enumerate(zip(opt.fp16_groups, opt.fp16_partitioned_groups)):
            offset = 0
            for p, ph in zip(params, placeholders):
                yield group, p, offset, ph
                offset += ph.ds_numel

    def release(self) -> None:
        """Pin what differs from its master's cast, then drop the 16-bit buffer (see the Note)."""
        for group, p, offset, ph in self.params():
            if p.ds_tensor is ph and not torch.equal(ph, self.master_cast(group, offset, ph.ds_numel)):
                p.ds_tensor = _partition_tensor(ph.detach().clone(), ph)
            self.poison(ph)
        for flat in self.optimizer.fp16_partitioned_groups_flat:
            self.poison(flat)
        self.poison(self.optimizer.lp_param_buffer)

    def rebuild(self) -> None:
        """DeepSpeed's 16-bit buffer again: the masters' casts, then the pinned values (the released
        buffers kept their shapes, so the sizes are read from them)."""
        opt = self.optimizer
        for _, p, _, ph in self.params():
            _take_assigned(self, p, ph)
        buffer = torch.empty(opt.lp_param_buffer.numel(), dtype=self.dtype, device=self.device)
        opt.lp_param_buffer.data = buffer
        start = 0
        for group, flat in enumerate(opt.fp16_partitioned_groups_flat):
            numel = flat.numel()
            flat.data = buffer.narrow(0, start, numel)
            flat.data.copy_(opt.fp32_partitioned_groups_flat[group].data)  # as DeepSpeed's update copies
            opt._unflatten_partitioned_parameters(group)  # each placeholder: a view of the buffer again
            start += numel
        for _, p, _, ph in self.params():
            if p.ds_tensor is not ph:
                ph.data.copy_(p.ds_tensor)
                p.ds_tensor = ph

    @contextmanager
    def deepspeed_layout(self):
        if self.on and self.layout_depth == 0:
            self.rebuild()
        self.layout_depth += 1
        try:
            yield
        finally:
            self.layout_depth -= 1
            if self.on and self.layout_depth == 0:
                self.release()


def _partition_tensor(value: torch.Tensor, placeholder: torch.Tensor) -> torch.Tensor:
    """``value`` (a new tensor) as a ``ds_tensor``: with the placeholder's DeepSpeed attributes
    (``ds_numel``, ``status``, ``final_location``)."""
    value.__dict__.update(placeholder.__dict__)
    return value


def _assigned(ph) -> bool:
    """The placeholder's storage was replaced (``ds_tensor.data = value``) since it was poisoned."""
    return ph.data_ptr() != getattr(ph, "_dsm_poison_ptr", ph.data_ptr())


def _take_assigned(state, p, ph) -> None:
    """``p.ds_tensor.data = value`` replaced the placeholder's storage: pin that value (see the Note)."""
    if p.ds_tensor is not ph or not _assigned(ph):
        return
    value = ph.data
    if value.numel() != ph.ds_numel:
        raise RuntimeError(f"ZeRO-3 partition of a parameter (ds_id {getattr(p, 'ds_id', '?')}) was assigned "
                           f"{value.numel()} elements; it holds {ph.ds_numel}.")
    state.poison(ph)
    p.ds_tensor = _partition_tensor(value.to(state.dtype), ph)


def _cast(p) -> bool:
    """Put the master's cast in ``p.ds_tensor`` if it holds the placeholder; return whether it did."""
    source = getattr(p, _SOURCE, None)
    if source is None:
        return False
    state, group, offset, ph = source
    if not state.on or state.layout_depth:
        return False
    _take_assigned(state, p, ph)
    if p.ds_tensor is not ph:
        return False  # DeepSpeed's layout, or pinned: ds_tensor holds the value
    p.ds_tensor = _partition_tensor(state.master_cast(group, offset, ph.ds_numel), ph)
    return True


@contextmanager
def cast_for_gather(params):
    """``ds_tensor`` holds each parameter's value for the duration (see the Note)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    cast = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE and _cast(p)]
    try:
        yield
    finally:
        for p in cast:
            p.ds_tensor = getattr(p, _SOURCE)[3]


def partition_value(p) -> torch.Tensor:
    """This rank's 16-bit partition of ``p`` as DeepSpeed's ``ds_tensor`` would hold it: ``ds_tensor``
    itself, or the master's cast where it holds the placeholder (a new tensor)."""
    source = getattr(p, _SOURCE, None)
    if source is None:
        return p.ds_tensor
    state, group, offset, ph = source
    if not state.on or state.layout_depth:
        return p.ds_tensor
    _take_assigned(state, p, ph)
    if p.ds_tensor is not ph:
        return p.ds_tensor
    return state.master_cast(group, offset, ph.ds_numel)


def pin(p) -> None:
    """Give ``p`` its own copy of its 16-bit value until its sub-group's next update (a no-op where
    it has one, or DeepSpeed's layout is up)."""
    _cast(p)


# ---------------------------------------------------------------- the gathers (Init, class-wide)
def _all_gather(original):

    @functools.wraps(original)
    def all_gather_cast_from_master(self, param_list, *args, **kwargs):
        with cast_for_gather(param_list):
            return original(self, param_list, *args, **kwargs)

    all_gather_cast_from_master._dsm_cast = True
    return all_gather_cast_from_master


def _partition(original):

    @functools.wraps(original)
    def partition_pinning_writes(self, param_list, force=False, has_been_updated=False, free_data=True):
        if has_been_updated:  # DeepSpeed writes the gathered value into ds_tensor: keep it (see the Note)
            for p in param_list:
                pin(p)
        return original(self, param_list, force=force, has_been_updated=has_been_updated, free_data=free_data)

    partition_pinning_writes._dsm_cast = True
    return partition_pinning_writes


def _install_on_init() -> None:
    from deepspeed.runtime.zero.partition_parameters import Init
    if not getattr(Init._all_gather, "_dsm_cast", False):
        Init._all_gather = _all_gather(Init._all_gather)
    if not getattr(Init._partition, "_dsm_cast", False):
        Init._partition = _partition(Init._partition)


def _coalesced(original):

    def all_gather_coalesced_cast_from_master(params, *args, **kwargs):
        with cast_for_gather(params):
            return original(params, *args, **kwargs)

    all_gather_coalesced_cast_from_master._dsm_cast = True
    return all_gather_coalesced_cast_from_master


# ---------------------------------------------------------------- the optimizer
def _reassign_or_swap_out_partitioned_parameters(self, sub_group_id):
    """After a sub-group's update: DeepSpeed copies the master into the 16-bit buffer; here the
    master's cast is read at the next gather, and the sub-group's pinned copies end."""
    state = compat.state(self, FEATURE)["cast"]
    if not state.on or state.layout_depth:
        return compat.original(self, "_reassign_or_swap_out_partitioned_parameters")(sub_group_id)
    for p, ph in zip(self.fp16_groups[sub_group_id], self.fp16_partitioned_groups[sub_group_id]):
        if _assigned(ph):
            state.poison(ph)  # assigned since the last gather: DeepSpeed's re-view drops it too
        p.ds_tensor = ph


def _pinning_first(name):

    def master_write(self, value, param, optim_state_key=None):
        if optim_state_key is None:  # the master: DeepSpeed's 16-bit copy keeps its value until the update
            pin(param)
        return compat.original(self, name)(value, param, optim_state_key)

    master_write.__name__ = name
    return master_write


def _on_deepspeed_layout(name):

    def on_deepspeed_layout(self, *args, **kwargs):
        with compat.state(self, FEATURE)["cast"].deepspeed_layout():
            return compat.original(self, name)(*args, **kwargs)

    on_deepspeed_layout.__name__ = name
    return on_deepspeed_layout


def _installed_state(optimizer):
    return compat.state(optimizer, FEATURE)["cast"] if compat.installed(optimizer, FEATURE) else None


def restore(optimizer) -> None:
    """DeepSpeed's 16-bit buffer for good (before ``offload_states``, which moves it)."""
    state = _installed_state(optimizer)
    if state is not None and state.on:
        if state.layout_depth == 0:
            state.rebuild()
        state.on = False


def hand_back(optimizer) -> None:
    """``engine.destroy()``: DeepSpeed's 16-bit partitions for good, the values a new engine over the
    module builds from; the parameters let go of this optimizer."""
    restore(optimizer)
    state = _installed_state(optimizer)
    if state is None:
        return
    for _, p, _, _ in state.params():
        if getattr(p, _SOURCE, (None, ))[0] is state:
            delattr(p, _SOURCE)


def applies(optimizer) -> bool:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    if (not isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3) or not switch_on(ZERO3_CAST_ON_GATHER)
            or getattr(optimizer, "offload_param", True) or getattr(optimizer, "offload_optimizer", True)
            or getattr(optimizer, "swap_optimizer", True) or getattr(optimizer, "zenflow", False)
            or getattr(optimizer, "use_muon", False) or getattr(optimizer, "zero_hpz_partition_size", 2) > 1
            or getattr(optimizer, "lp_param_buffer", None) is None):
        return False
    flat, masters = optimizer.fp16_partitioned_groups_flat, optimizer.fp32_partitioned_groups_flat
    if (optimizer.lp_param_buffer.dtype not in (torch.bfloat16, torch.float16) or len(flat) != len(masters)
            or any(f is None or m.dtype != torch.float32 or m.device != f.device or m.numel() != f.numel()
                   for f, m in zip(flat, masters))):
        return False
    params = [p for group in optimizer.fp16_groups for p in group]
    placeholders = placeholders_of(optimizer)
    if any(p.ds_tensor is not ph or hasattr(ph, "ds_quant_scale") or p.ds_secondary_tensor is not None
           for p, ph in zip(params, placeholders)) or len(params) != len(placeholders):
        return False
    return compat.fast_path_exact(optimizer, FEATURE) and compat.class_exact(FEATURE_INIT)


def install(optimizer) -> bool:
    """Release ``optimizer``'s 16-bit parameter buffer and cast each partition from its master at
    gather time; return whether it did."""
    if not applies(optimizer):
        return False
    _install_on_init()
    state = _CastOnGather(optimizer)
    for group, p, offset, ph in state.params():
        setattr(p, _SOURCE, (state, group, offset, ph))
    module_params = [p for p in optimizer.module.parameters() if hasattr(p, "ds_id")]
    for p in module_params:  # the coordinator gathers through a group's first parameter, any of them
        if not getattr(p.all_gather_coalesced, "_dsm_cast", False):
            p.all_gather_coalesced = _coalesced(p.all_gather_coalesced)
    compat.state(optimizer, FEATURE, {"cast": state})
    compat.state(optimizer, FEATURE_INIT, {})  # (its Init methods were checked: installed with it)
    compat.replace_method(optimizer, "_reassign_or_swap_out_partitioned_parameters",
                          _reassign_or_swap_out_partitioned_parameters, FEATURE)
    for name in ("set_full_hp_param", "set_local_hp_param"):
        compat.replace_method(optimizer, name, _pinning_first(name), FEATURE)
    for name in _ON_DEEPSPEED_LAYOUT:
        compat.replace_method(optimizer, name, _on_deepspeed_layout(name), FEATURE)
    compat.run_before(optimizer, "offload_states", restore, FEATURE)  # (after stage3_lazy_grads' restore)
    state.release()
    return True


def placeholders_of(optimizer) -> List[torch.Tensor]:
    """The 16-bit partitions ``optimizer`` holds now (tests: released ones hold one element)."""
    return [ph for group in optimizer.fp16_partitioned_groups for ph in group]
