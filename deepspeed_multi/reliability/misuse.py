"""Misuse that would otherwise hang or give wrong gradients: each check raises an error that
names the engine and the fix.

[Note: the misuse catalogue]
What each mistake meets (docs/limits.md, "Misuse", lists upstream's behaviour beside it):

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
* a trainable engine built over parameters that a ZeRO-2/3 MultiEngine, not destroyed, trains:
  refused at initialize (:func:`refuse_parameters_of_live_engine`); the old engine's gradient
  hooks would run in the new one's backward ([Note: destroy() hands the module back]). Any engine
  built over a module that a ZeRO-3 MultiEngine (trained or not), not destroyed, still hooks:
  refused too; its hooks would gather and release the parameters inside the new one's forward
  (upstream fails in ZeRO-3's trace: "IndexError: pop from an empty deque").
* ``requires_grad`` changed on a parameter after initialize: refused at the next update
  (:func:`check_requires_grad_unchanged`, one pass over the parameters per update); the
  optimizer and ZeRO's partitions were built for the parameters that required grad then.
  Except True -> False at ZeRO-1/2/3: the parameter keeps its place in the flat partition and
  gets a zero gradient for the window, as an unused parameter does.
* one backward through trainable engines on different data-parallel groups (``mpu``): refused
  before any engine's backward starts (``dp_groups.check_dp_groups``) unless every engine it reaches
  opted in with ``allow_mixed_dp_groups``; each engine averages over its own group, so the
  gradients are right only when the data is replicated across each model-parallel group.
* the watchdog (watchdog.py) and the rank-agreement check at ZeRO 0/1 (rank_agreement.py) catch
  engines reached on some ranks only; skip groups (skip_group.py) keep fp16 overflows in one
  engine isolated or shared as configured.
"""
import functools
import gc
import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..autograd.graph import any_param_in_current_graph, in_backward
from ..state import TrainingState


def refuse_inside_backward(engine, what: str) -> None:
    """``what`` (step()/zero_grad()) inside a backward that produces, or will reach, this engine's gradients."""
    if not in_backward() or not engine.trains:
        return
    if engine._state is TrainingState.IN_BACKWARD:
        when = "while a backward pass is still producing this engine's gradients"
    elif any_param_in_current_graph(engine._trainable_params):
        when = "inside a backward pass that has yet to reach this engine (from a hook?)"
    else:
        return
    raise RuntimeError(f"MultiEngine ({engine._engine_name()}): {what} called {when}; its gradients would "
                       f"{'land in the next window' if what == 'step()' else 'be partly discarded'}. Call {what} "
                       "after loss.backward() returns.")


def refuse_if_destroyed(engine, what: str) -> None:
    if engine._state is TrainingState.DESTROYED:
        raise RuntimeError(
            f"MultiEngine ({engine._engine_name()}): {what} called after engine.destroy() (Accelerate's free_memory() "
            "calls it, as does the start of Trainer.train()): its hooks and buffers are gone. Build a new engine over "
            "engine.module with deepspeed_multi.initialize, as the Trainer does.")


def refuse_step_now(engine) -> None:
    """``step()`` on a destroyed engine, inside a backward, or after a backward through it failed part way."""
    refuse_if_destroyed(engine, "step()")
    refuse_inside_backward(engine, "step()")
    if engine._state is TrainingState.IN_BACKWARD:
        raise RuntimeError(f"MultiEngine ({engine._engine_name()}): step() called after a backward pass through "
                           "this engine failed part way; call engine.zero_grad() to discard its partial "
                           "gradients, then run it again.")


def refuse_double_backward_at_zero3(engine) -> None:
    raise RuntimeError(
        f"MultiEngine ({engine._engine_name()}, ZeRO stage 3): backward with create_graph=True (double "
        "backward, e.g. a gradient penalty from torch.autograd.grad) is not supported; ZeRO-3 partitions "
        "the parameters that the double backward needs as soon as the first backward leaves them. Use "
        "ZeRO stage <= 2 for this engine.")


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


# Each trainable parameter -> a weak reference to the MultiEngine that trains it; keyed by identity and
# held weakly (no attribute on the parameter: a deepcopy of the model is not the engine's).
_TRAINED_BY = WeakIdKeyDictionary()


# Each submodule of a ZeRO-3 MultiEngine's module -> a weak reference to that engine, whose ZeRO-3
# hooks are on it until destroy(); trained or not (DeepSpeed's own hooks keep an engine that was
# dropped without destroy() alive as long as its module).
_ZERO3_HOOKED = WeakIdKeyDictionary()


def claim_parameters(engine) -> None:
    """At initialize: ``engine`` trains its trainable parameters and, at ZeRO-3, hooks its module's
    submodules (see :func:`refuse_parameters_of_live_engine`)."""
    owner = weakref.ref(engine)
    if engine.trains:
        for p in engine._trainable_params:
            _TRAINED_BY[p] = owner
    if engine.zero_optimization_stage() == 3:
        for m in engine.module.modules():
            _ZERO3_HOOKED[m] = owner


def release_parameters(engine) -> None:
    """``engine.destroy()``: its parameters and modules are free for a new engine."""
    for registry, keys in ((_TRAINED_BY, engine._trainable_params), (_ZERO3_HOOKED, engine.module.modules())):
        for key in keys:
            ref = registry.get(key)
            if ref is not None and ref() is engine:
                del registry[key]


def refuse_parameters_of_live_engine(model, trains: bool, where: str) -> None:
    """A new trainable engine over parameters that a ZeRO-2/3 MultiEngine still trains.

    That engine's ZeRO-2/3 gradient hooks stay on the parameters until its ``destroy()``, and they
    run in the new engine's backward: a ZeRO-3 owner fails there, a ZeRO-2 owner under a ZeRO-1
    engine changes its updates silently (measured: 6.5e-2 off after two SGD steps). ZeRO-0/1
    owners do nothing in backward that a new engine notices, so those are left as upstream has them.
    Any new engine, trained or not, over submodules that a ZeRO-3 engine still hooks is refused too.
    """
    if not isinstance(model, torch.nn.Module):
        return
    find = functools.partial(_live_owners, model, trains)
    owners = find()
    if owners:
        gc.collect()  # an engine dropped without destroy() lives until its reference cycles are collected
        owners = find()
    if owners:
        (kind, name), owner = next(iter(owners.items()))
        what = (f"parameter {name!r} of {type(model).__name__} is still trained by" if kind == "parameter" else
                f"{type(model).__name__}{f' (submodule {name!r})' if name else ''} is still hooked by")
        hooks = ("gradient hooks would run in this engine's backward" if kind == "parameter" else
                 "ZeRO-3 hooks would gather and release the parameters inside this engine's forward and backward")
        raise RuntimeError(
            f"{where}: {what} a MultiEngine ({owner._engine_name()}, ZeRO stage {owner.zero_optimization_stage()}, "
            f"{'trained' if owner.trains else 'inference-only'}) that was not destroyed; its {hooks} too. Call "
            "that engine's destroy() first (Accelerate's free_memory() does, as does the start of Trainer.train()), "
            "then build this one.")


def _live_owners(model, trains: bool) -> dict:
    """``{("parameter" | "module", name): live engine}``: the ZeRO-2/3 engines training ``model``'s
    parameters (when the new engine trains) and the ZeRO-3 engines hooking its submodules."""
    found = {}
    if trains:
        for name, p in model.named_parameters():
            owner = _live(_TRAINED_BY.get(p) if p.requires_grad else None)
            if owner is not None and owner.zero_optimization_stage() >= 2:
                found["parameter", name] = owner
    for name, m in model.named_modules():
        owner = _live(_ZERO3_HOOKED.get(m))
        if owner is not None:
            found["module", name] = owner
    return found


def _live(ref):
    owner = ref() if ref is not None else None
    return owner if owner is not None and owner._state is not TrainingState.DESTROYED else None


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
    """Every parameter's requires_grad is what it was at initialize (called at each update).

    [Note: requires_grad turned off after initialize]
    ZeRO-1/2/3 keep every parameter that required grad at initialize in flat fp32 partitions
    and step whole partitions; a parameter whose requires_grad was then turned off gets no
    gradient in the window, so its slice holds zeros: exactly a parameter the window's backward
    did not reach (docs/limits.md), and the update equals PyTorch's with a zero gradient for it
    (tests/multi_gpu/deepspeed_api_checks.py, requires_grad_off, fp32 Adam at each of the three
    stages). DeepSpeed's own tests toggle it that way (half the parameters per iteration).
    False -> True (the optimizer has no state or partition for it) stays refused, and so does any
    change at ZeRO-0, where the optimizer steps the parameters themselves and a parameter
    without a gradient is skipped (not measured here).
    """
    now = [p for p in engine.module.parameters() if p.requires_grad]
    if len(now) == len(engine._trainable_params) and all(a is b for a, b in zip(now, engine._trainable_params)):
        return
    was = {id(p) for p in engine._trainable_params}
    changed = [(n, id(p) not in was) for n, p in engine.module.named_parameters() if p.requires_grad != (id(p) in was)]
    if engine.zero_optimization_stage() in (1, 2, 3):
        changed = [(n, on) for n, on in changed if on]
        if not changed:
            return
    detail = ", ".join(f"{n!r} ({'False -> True' if on else 'True -> False'})" for n, on in changed[:5])
    raise RuntimeError(
        f"MultiEngine ({engine._engine_name()}): requires_grad changed after deepspeed_multi.initialize on {detail}. "
        "The optimizer (and ZeRO's gradient and optimizer-state partitions) were built for the parameters that "
        "required grad at initialize, so this update would skip or corrupt them. Set requires_grad before "
        "initialize (build a new engine to train another subset), and freeze temporarily with torch.no_grad() "
        "or by detaching inputs instead.")
