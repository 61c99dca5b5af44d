"""Engines on different data-parallel groups (``mpu``) in one backward pass: refused unless opted in.

Each engine averages its gradients over its own data-parallel group; one backward that reaches
engines on different groups is right only when the data is replicated across each
model-parallel group (see :func:`check_dp_groups`). An AutoTP engine's groups differ from an
engine without tensor parallelism by construction, and need no opt-in ([Note: AutoTP engines
beside engines without tensor parallelism]). :func:`own_dp_group` keeps a ZeRO-0 reduction on the
engine's own group.

[Note: AutoTP engines beside engines without tensor parallelism]
An engine with ``"tensor_parallel": {"autotp_size": t}`` has DeepSpeed's tensor-parallel groups
(``deepspeed.utils.groups``, which DeepSpeed builds and then sets as the engine's ``mpu``): blocks
of ``t`` consecutive ranks, and a data-parallel group of one rank per block, the ranks at the same
position in each. An engine without tensor parallelism beside it averages over the world. The
ranks differ (on 2 ranks with t = 2: [0, 1] against [rank]), yet both average the same data:

* The ranks of one tensor-parallel block hold the same data by AutoTP's own contract: its sharded
  layers combine the partial results of every rank of the block, which is right only when each
  rank computed them from the same inputs (DeepSpeed checks the inputs of the engine's first
  forward across the block and stops with "Data inconsistency within the TP group" otherwise).
  The block is one data-parallel replica, and a loss that goes through the AutoTP engine is the
  same on every rank of a block, so the gradient any engine of that loss gets on rank r, g(r),
  depends on r's block only.
* An engine averaging over ranks G then computes sum over G of g(r) / |G|. When G holds every
  block it touches equally often (n times), this is sum over blocks(G) of n g(b) / (n |blocks(G)|):
  the plain average over the blocks of G. The AutoTP engine's data-parallel group holds each block
  once, the world holds each block t times: the same blocks, the same average, and the same as
  plain PyTorch on the global batch (one batch per block).

So a backward that reaches an AutoTP engine is allowed when every engine it reaches averages over
the same set of DeepSpeed's blocks, each block equally often (:func:`_same_average_over_autotp`).
The premise comes from the AutoTP engine being in the loss; two engines without tensor
parallelism on different groups (a user ``mpu``) reached without it have no such guarantee and
are refused, and the process-wide shortcut (``_DpGroups.mixed`` false: nothing is checked) is
taken only when every pair of engines whose groups differ is an AutoTP engine and an engine
without tensor parallelism. Only groups DeepSpeed built are trusted: an AutoTP engine whose
tensor-parallel group is not DeepSpeed's block layout is compared by its ranks, as before.
"""
import weakref
from collections import Counter
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


def _autotp_block(engine):
    """``t`` when the engine is an AutoTP engine (``tensor_parallel.autotp_size`` t > 1) on the
    tensor-parallel groups DeepSpeed built (its ``mpu`` is ``deepspeed.utils.groups``): this rank's
    tensor-parallel group is its block of ``t`` consecutive ranks and its data-parallel ranks sit at
    this rank's position in their blocks. None otherwise (no AutoTP, or groups not in that layout)."""
    size = getattr(engine, "autotp_size", lambda: 0)() or 0
    if size <= 1:
        return None
    import torch.distributed as tdist
    from deepspeed.utils import groups
    if engine.mpu is not groups:
        return None
    rank = tdist.get_rank()
    start = rank // size * size
    tp_ranks = tuple(tdist.get_process_group_ranks(groups.get_tensor_model_parallel_group()))
    if tp_ranks != tuple(range(start, start + size)) or any(r % size != rank % size for r in engine._dsm_dp_ranks):
        return None
    return size


def _blocks(ranks, size):
    """The blocks of ``size`` consecutive ranks that ``ranks`` covers, when it covers each equally often."""
    count = Counter(r // size for r in ranks)
    return frozenset(count) if len(set(count.values())) == 1 else None


def _same_average_over_autotp(engines) -> bool:
    """True when ``engines`` (on different data-parallel groups) include an AutoTP engine on
    DeepSpeed's groups and every one of them averages over the same set of its tensor-parallel
    blocks, each equally often ([Note: AutoTP engines beside engines without tensor parallelism])."""
    sizes = {e._dsm_autotp_block for e in engines if e._dsm_autotp_block}
    if len(sizes) != 1:
        return False
    size = sizes.pop()
    covered = {_blocks(e._dsm_dp_ranks, size) for e in engines}
    return len(covered) == 1 and None not in covered


def _groups_differ(engines) -> bool:
    """Whether a backward through all of ``engines`` could average different data: their groups
    differ, and not only through AutoTP. Any subset of them must be safe too (the process-wide
    shortcut), so engines without tensor parallelism must share one group among themselves."""
    if len({e._dsm_dp_ranks for e in engines}) <= 1:
        return False
    plain = {e._dsm_dp_ranks for e in engines if not e._dsm_autotp_block}
    tp = {e._dsm_dp_ranks for e in engines if e._dsm_autotp_block}
    return not (len(plain) <= 1 and len(tp) <= 1 and _same_average_over_autotp(engines))


def _update_mixed(live) -> bool:
    _DpGroups.mixed = _groups_differ(live) and not all(e.options.allow_mixed_dp_groups for e in live)
    return _DpGroups.mixed


def register_dp_group(engine) -> None:
    """At initialize: remember the engine's data-parallel ranks (static, local: no collective)."""
    if not engine.trains:
        return  # an engine that trains nothing reduces nothing: its group cannot skew a gradient
    engine._dsm_dp_ranks = _dp_group_ranks(engine)
    engine._dsm_autotp_block = _autotp_block(engine)
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
    ``allow_mixed_dp_groups``, unless one of them is an AutoTP engine and the groups differ only by
    its tensor-parallel blocks ([Note: AutoTP engines beside engines without tensor parallelism]).
    Otherwise (the common case) it is one attribute read. Group
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
    key = frozenset((e._dsm_dp_ranks, e._dsm_autotp_block, e.options.allow_mixed_dp_groups) for e in reached)
    if key not in _DpGroups.verified:
        if (len({e._dsm_dp_ranks for e in reached}) > 1 and not _same_average_over_autotp(reached)
                and not all(e.options.allow_mixed_dp_groups for e in reached)):
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
