"""Engines on different data-parallel groups (``mpu``) in one backward pass: refused unless opted in.

Each engine averages its gradients over its own data-parallel group; one backward that reaches
engines on different groups is right only when the data is replicated across each
model-parallel group (see :func:`check_dp_groups`). :func:`own_dp_group` keeps a ZeRO-0
reduction on the engine's own group.
"""
import weakref
from contextlib import contextmanager

from ..autograd import graph


class _DpGroups:
    """This process's trainable MultiEngines, for :func:`check_dp_groups`."""
    engines = weakref.WeakValueDictionary()  # registration number -> engine, in build order
    count = 0
    mixed = False  # live engines on >= 2 groups, not all opted in: backward passes are checked
    checked_task = None  # the autograd graph task checked last (one check per backward pass)
    verified = set()  # sets of (ranks, opted in) of engines reached together, compared and allowed


def _dp_group_ranks(engine) -> tuple:
    """The global ranks of the group the engine reduces its gradients over (ZeRO partitions too):
    ``seq_data_parallel_group``, which DeepSpeed takes from ``mpu.get_data_parallel_group()`` when an
    mpu is given (data x sequence parallel when the mpu has sequence parallelism), else a clone
    of the world group."""
    import torch.distributed as tdist
    group = engine.seq_data_parallel_group
    return tuple(tdist.get_process_group_ranks(group if group is not None else tdist.group.WORLD))


def _update_mixed(live) -> bool:
    _DpGroups.mixed = (len({e._dsm_dp_ranks for e in live}) > 1
                       and not all(e.options.allow_mixed_dp_groups for e in live))
    return _DpGroups.mixed


def register_dp_group(engine) -> None:
    """At initialize: remember the engine's data-parallel ranks (static, local: no collective)."""
    if not engine.trains:
        return  # an engine that trains nothing reduces nothing: its group cannot skew a gradient
    engine._dsm_dp_ranks = _dp_group_ranks(engine)
    _DpGroups.count += 1
    _DpGroups.engines[_DpGroups.count] = engine
    _update_mixed(list(_DpGroups.engines.values()))


def unregister_dp_group(engine) -> None:
    """``engine.destroy()``: its group no longer counts among this process's trainable engines."""
    for key, registered in list(_DpGroups.engines.items()):
        if registered is engine:
            del _DpGroups.engines[key]
    _update_mixed(list(_DpGroups.engines.values()))


def check_dp_groups(engine) -> None:
    """One backward pass must not reach trainable engines on different data-parallel groups.

    Called by the boundary nodes (autograd/boundary.py) whenever a gradient reaches an engine, first
    thing. The first call of a backward pass (before any engine's prologue, watchdog mark or
    reduction) looks, only while this process's trainable engines are on different groups and
    not all opted in, at which of them this pass will accumulate into (the parameter lookup of
    ``_pre_backward``), and raises if their groups differ and not all of them set
    ``allow_mixed_dp_groups``. Otherwise (the common case) it is one attribute read. Group
    membership is local and static (read once, at initialize), so every rank decides the same
    without a collective; a combination of groups that passed is not compared again.
    """
    if not _DpGroups.mixed:
        return
    task = graph.current_task()
    if task == _DpGroups.checked_task:
        return
    live = list(_DpGroups.engines.values())
    if not _update_mixed(live):
        return
    reached = [e for e in live if graph.any_param_in_current_graph(e._trainable_params)]
    key = frozenset((e._dsm_dp_ranks, e.options.allow_mixed_dp_groups) for e in reached)
    if key not in _DpGroups.verified:
        if len({e._dsm_dp_ranks for e in reached}) > 1 and not all(e.options.allow_mixed_dp_groups for e in reached):
            raise RuntimeError(_mixed_dp_message(reached))
        _DpGroups.verified.add(key)
    _DpGroups.checked_task = task


def _mixed_dp_message(reached) -> str:
    import torch.distributed as tdist
    first = reached[0]
    other = next(e for e in reached if e._dsm_dp_ranks != first._dsm_dp_ranks)
    rest = [e for e in reached if e is not first and e is not other]
    also = "".join(f", MultiEngine ({e._engine_name()}) over ranks {list(e._dsm_dp_ranks)}" for e in rest)
    missing = ", ".join(e._engine_name() for e in reached if not e.options.allow_mixed_dp_groups)
    rank = tdist.get_rank() if tdist.is_initialized() else 0
    return (
        f"deepspeed_multi: one backward pass reaches engines on different data-parallel groups: MultiEngine "
        f"({first._engine_name()}) averages its gradients over ranks {list(first._dsm_dp_ranks)}, MultiEngine "
        f"({other._engine_name()}) over ranks {list(other._dsm_dp_ranks)}{also} (data-parallel groups of rank "
        f"{rank}; were the engines given different mpu= at initialize?). Each engine averages over its own "
        "group, so unless every rank of a model-parallel group holds the same batch, the engines average different "
        "data and the updates would be wrong. Give every engine of one loss the same mpu. If the data is "
        "replicated across each model-parallel group (then every engine's data-parallel average is the same "
        'average), set {"deepspeed_multi": {"allow_mixed_dp_groups": true}} in the config of every engine of '
        f"this loss (not set on: {missing}). No engine's backward had started: the engines are as before it.")


class _OwnDpGroup:
    """Stands in for DeepSpeed's process-wide ``deepspeed.utils.groups.mpu`` while one engine reduces."""

    def __init__(self, engine):
        self.engine = engine

    def get_sequence_data_parallel_group(self):
        return self.engine.seq_data_parallel_group

    def get_data_parallel_group(self):
        return self.engine.data_parallel_group


@contextmanager
def own_dp_group(engine):
    """Make a ZeRO-0 reduction use the engine's own data-parallel group.

    DeepSpeed's ZeRO-0 reduction (``buffered_allreduce_fallback``) takes its group from
    ``deepspeed.utils.groups.mpu``, the last mpu given to any initialize in the process, not from
    the engine: an engine built without an mpu beside one built with an mpu would average over
    the other's group, silently (measured: off by 1.8e-2 after one SGD step in
    test_misuse.py::test_engines_on_different_dp_groups without this). ZeRO 1-3 keep the group
    the engine was built with. Only while this process holds trainable engines on different
    groups; otherwise nothing changes.
    """
    live = list(_DpGroups.engines.values())
    if engine.zero_optimization_stage() != 0 or len({e._dsm_dp_ranks for e in live}) < 2:
        yield
        return
    from deepspeed.utils import groups

    from .. import compat
    with compat.swapped(groups, "mpu", _OwnDpGroup(engine)):
        yield
