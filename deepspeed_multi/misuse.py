"""Misuse that would otherwise hang or give wrong gradients: each check raises an error that
names the engine and the fix.

[Note: the misuse catalogue]
What each mistake meets (README "Failure and recovery" lists upstream's behaviour beside it):

* step() or zero_grad() while a backward pass is running and either is producing this
  engine's gradients or will still reach it (e.g. from a tensor hook): refused
  (:func:`refuse_inside_backward`); the gradients would land in the next window, or be wiped.
* ``engine.backward(loss)`` on a loss that an engine's ``backward()`` already backpropagated
  (upstream habit: one ``backward`` per engine on a shared loss): refused
  (:func:`mark_backpropagated`), since one backward already reaches every engine in the graph
  and a second one, with ``retain_graph=True``, counts every gradient twice. A plain
  ``loss.backward()`` followed by ``engine.backward(loss)`` cannot be seen here: without
  retain_graph torch refuses it itself, with it the gradients are doubled.
* a MultiEngine or DeepSpeedEngine given to ``deepspeed_multi.initialize`` as the model:
  refused (:func:`refuse_engine_as_model`); given to upstream ``deepspeed.initialize``: refused
  by the MultiEngine itself when the outer engine first runs it (:func:`install_outer_engine_guard`).
* ``requires_grad`` changed on a parameter after initialize: refused at the next update
  (:func:`check_requires_grad_unchanged`, one pass over the parameters per update); the
  optimizer and ZeRO's partitions were built for the parameters that required grad then.
* one backward through trainable engines on different data-parallel groups (``mpu``): refused
  before any engine's backward starts (:func:`check_dp_groups`) unless every engine it reaches
  opted in with ``allow_mixed_dp_groups``; each engine averages over its own group, so the
  gradients are right only when the data is replicated across each model-parallel group.
* the watchdog (watchdog.py) and the rank-agreement check at ZeRO 0/1 (engine.py) catch
  engines reached on some ranks only; skip groups (skip_group.py) keep fp16 overflows in one
  engine isolated or shared as configured.
"""
import weakref
from contextlib import contextmanager

import torch


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _any_param_in_current_graph(params) -> bool:
    """Will the running backward accumulate into any of ``params``? Stops at the first one."""
    from torch.autograd.graph import _get_grad_fn_or_grad_acc
    with torch.enable_grad():  # leaf parameters need grad mode to hand out their AccumulateGrad
        for param in params:
            if not param.requires_grad:
                continue
            node = _get_grad_fn_or_grad_acc(param)
            if node is not None and torch._C._will_engine_execute_node(node):
                return True
    return False


def refuse_inside_backward(engine, what: str) -> None:
    """``what`` (step()/zero_grad()) inside a backward that produces, or will reach, this engine's gradients."""
    if not _in_backward() or not engine.trains:
        return
    from ._state import TrainingState
    if engine._state is TrainingState.IN_BACKWARD:
        when = "while a backward pass is still producing this engine's gradients"
    elif _any_param_in_current_graph(engine._trainable_params):
        when = "inside a backward pass that has yet to reach this engine (from a hook?)"
    else:
        return
    raise RuntimeError(f"MultiEngine ({engine._engine_name()}): {what} called {when}; its gradients would "
                       f"{'land in the next window' if what == 'step()' else 'be partly discarded'}. Call {what} "
                       "after loss.backward() returns.")


_BACKPROPAGATED = "_dsm_backpropagated_by"


def check_not_backpropagated(engine, loss) -> None:
    first = getattr(loss, _BACKPROPAGATED, None)
    if first is not None:
        raise RuntimeError(
            f"MultiEngine ({engine._engine_name()}).backward(loss): this loss was already backpropagated by "
            f"MultiEngine ({first}).backward(loss). One backward reaches every engine in the loss's graph, so a "
            "second one would count every engine's gradients twice. Call backward once per loss: loss.backward() "
            "or any one engine's backward(loss).")


def mark_backpropagated(engine, loss) -> None:
    try:
        setattr(loss, _BACKPROPAGATED, engine._engine_name())
    except (AttributeError, TypeError):  # a tensor subclass without a __dict__: nothing to remember
        pass


def refuse_engine_as_model(model, where: str) -> None:
    """deepspeed_multi.initialize(model=<an engine>)."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    if isinstance(model, DeepSpeedEngine):
        raise TypeError(
            f"{where}: model is already a {type(model).__name__} (for {type(model.module).__name__}); an engine "
            "around an engine would give the same parameters two optimizers. Use the engine you have, or pass its "
            "module (engine.module) to build a new one.")


def install_outer_engine_guard(engine) -> None:
    """Upstream deepspeed.initialize(model=<MultiEngine>) builds an engine around this one: refuse
    its first forward. A forward pre-hook on the MultiEngine looks a few frames up for another
    engine's DeepSpeedEngine.forward (a few microseconds per call)."""
    import sys
    from deepspeed.runtime.engine import DeepSpeedEngine

    def pre(module, args):
        frame = sys._getframe(1)
        for _ in range(8):
            if frame is None:
                return
            outer = frame.f_locals.get("self") if frame.f_code.co_name == "forward" else None
            if isinstance(outer, DeepSpeedEngine) and outer is not engine:
                raise TypeError(
                    f"MultiEngine ({engine._engine_name()}) is the model of another engine ({type(outer).__name__}): "
                    "deepspeed.initialize was given an engine as its model, so two optimizers would update the "
                    "same parameters. Use this engine as it is, or pass engine.module to deepspeed.initialize.")
            frame = frame.f_back

    engine.register_forward_pre_hook(pre)


def check_requires_grad_unchanged(engine) -> None:
    """Every parameter's requires_grad is what it was at initialize (called at each update)."""
    now = [p for p in engine.module.parameters() if p.requires_grad]
    if len(now) == len(engine._trainable_params) and all(a is b for a, b in zip(now, engine._trainable_params)):
        return
    was = {id(p) for p in engine._trainable_params}
    changed = [(n, id(p) not in was) for n, p in engine.module.named_parameters() if p.requires_grad != (id(p) in was)]
    detail = ", ".join(f"{n!r} ({'False -> True' if on else 'True -> False'})" for n, on in changed[:5])
    raise RuntimeError(
        f"MultiEngine ({engine._engine_name()}): requires_grad changed after deepspeed_multi.initialize on {detail}. "
        "The optimizer (and ZeRO's gradient and optimizer-state partitions) were built for the parameters that "
        "required grad at initialize, so this update would skip or corrupt them. Set requires_grad before "
        "initialize (build a new engine to train another subset), and freeze temporarily with torch.no_grad() "
        "or by detaching inputs instead.")


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


def check_dp_groups(engine) -> None:
    """One backward pass must not reach trainable engines on different data-parallel groups.

    Called by the boundary nodes (_boundary.py) whenever a gradient reaches an engine, first
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
    task = torch._C._current_graph_task_id()
    if task == _DpGroups.checked_task:
        return
    live = list(_DpGroups.engines.values())
    if not _update_mixed(live):
        return
    reached = [e for e in live if _any_param_in_current_graph(e._trainable_params)]
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
    saved = groups.mpu
    groups.mpu = _OwnDpGroup(engine)
    try:
        yield
    finally:
        groups.mpu = saved
