"""ZeRO-3 engines that generate inside a training loop: no hang on uneven lengths, near an unsharded model's speed.

[Note: generation from a ZeRO-3 engine]
Transformers' ``generate()`` runs one forward per new token, and under ZeRO-3 every forward gathers
each module's parameters, a collective on the engine's data-parallel group. A rank whose sequences
end first stops calling forward while the others wait in a gather: the run hangs (DeepSpeed issue
#8262 for a student/teacher pair, DeepSpeed-Chat's actor). Transformers' remedy, ``synced_gpus``
(a finished rank keeps running forwards until every rank has finished), is on only where its
process-wide DeepSpeed config says ZeRO-3: never in a loop of one's own, and in a multi-model
Accelerator only when the selected plugin is the ZeRO-3 one. Gathering module by module is slow as
well: every module's hooks run at every token, also inside ``GatheredParameters`` (measured: a
6-layer Llama at 4.7 times its unsharded time on 2 CPU ranks, gathered or not).

So the module of every ZeRO-3 MultiEngine gets a ``generate`` of its own (an instance attribute,
taken off at ``destroy()``), which is what ``engine.module.generate``, ``engine.generate`` and the
module a front end hands out (Accelerate's ``unwrap_model``, a LightningModule's attribute) call:

- where the whole model fits the engine's ``generation_gather_bytes`` (no bound by default: the
  whole model, as TRL's ``unwrap_model_for_generation`` gathers it), Transformers' ``generate``
  runs inside :func:`generation_mode` with ``synced_gpus=False``: no collective runs until it
  returns, so each rank stops at its own length;
- otherwise, and where the parameters are gathered already (TRL's own gather), with
  ``synced_gpus=True`` at world size > 1, whatever the caller or Transformers passed.

:func:`generation_mode` (``engine.generation_mode()``) drains the prefetch and releases what ZeRO-3
holds, gathers every parameter once (``GatheredParameters``, ``modifier_rank=None``: a write is
discarded at the exit as DeepSpeed discards it, and warned) and, for its duration, takes the forward
hooks of DeepSpeed's parameter coordinator and of this package off the module's submodules (other
hooks, such as Transformers' output capturing, stay): the module runs as a plain ``nn.Module`` over
whole parameters, under ``torch.no_grad()``. At the exit the hooks go back in their places, in order,
and the parameters are partitioned again. Nothing else of the engine changes: gradients pending in an
accumulation window stay in the optimizer's partitions, which the mode neither reads nor writes, so
the next update is the one without a generation (bit for bit: tests/multi_gpu/generation_checks.py).
The entry's gather is a collective: every rank of the data-parallel group enters the mode together,
as every rank calls ``generate`` in a loop.
"""
from __future__ import annotations

import contextlib
import functools
import weakref

import torch

from . import prefetch as stage3_prefetch

FEATURE = "stage3_generation"
_ACTIVE = "_dsm_generation_mode"  # on the engine: True while generation_mode() runs


def _offload(engine):
    """DeepSpeed's parameter coordinator of a ZeRO-3 engine (trained: the optimizer's; frozen: the optimizer)."""
    return getattr(engine.optimizer, "parameter_offload", engine.optimizer)


def _coordinator_hooks(engine) -> list:
    """The forward hooks that gather, release and watch, by their handles: DeepSpeed's and this package's."""
    offload = _offload(engine)
    handles = [*getattr(offload, "forward_hooks", ()), *getattr(offload, "backward_hooks", ())]
    if getattr(offload, "fwd_pre_hook", None) is not None:
        handles.append(offload.fwd_pre_hook)
    return handles + list(getattr(engine.watchdog, "hooks", ()))


@contextlib.contextmanager
def _hooks_off(handles):
    """Take each hook out of its module's hook dict for the block; put every one back in its place after.

    A dict's own order is the order its hooks run in, so each dict touched is rebuilt as it was, and a hook
    added to it meanwhile is kept, after them."""
    saved = {}
    for handle in handles:
        hooks = handle.hooks_dict_ref()
        if hooks is not None and handle.id in hooks:
            saved.setdefault(id(hooks), (hooks, list(hooks.items())))
            del hooks[handle.id]
    try:
        yield
    finally:
        for hooks, before in saved.values():
            known = {key for key, _ in before}
            added = [(key, hook) for key, hook in hooks.items() if key not in known]
            hooks.clear()
            hooks.update(before)
            hooks.update(added)


def whole_bytes(module) -> int:
    """The bytes of ``module``'s parameters gathered whole (ZeRO-3's full sizes, in their dtype)."""
    return sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in module.parameters())


def fits(engine) -> bool:
    bound = engine.options.generation_gather_bytes
    return bound is None or whole_bytes(engine.module) <= bound


def active(engine) -> bool:
    return getattr(engine, _ACTIVE, False)


@contextlib.contextmanager
def generation_mode(engine):
    """The module over whole parameters, without ZeRO-3's per-module gathers (see the Note)."""
    import deepspeed
    if engine.zero_optimization_stage() != 3:  # nothing is partitioned: the module is whole already
        with torch.no_grad():
            yield engine.module
        return
    if active(engine):
        raise RuntimeError(f"MultiEngine ({engine._engine_name()}): generation_mode() is already active for this "
                           "engine; enter it once around the generation.")
    stage3_prefetch.drain(engine)
    engine.empty_partition_cache()  # what ZeRO-3 keeps gathered between forwards, released before the gather
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None), torch.no_grad():
        engine._region.enter_forward()  # our outside-call hooks off the submodules
        try:
            with _hooks_off(_coordinator_hooks(engine)):
                setattr(engine, _ACTIVE, True)
                try:
                    yield engine.module
                finally:
                    setattr(engine, _ACTIVE, False)
        finally:
            engine._region.exit_forward()


def _all_gathered(module) -> bool:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    return all(getattr(p, "ds_status", ZeroParamStatus.AVAILABLE) == ZeroParamStatus.AVAILABLE
               for p in module.parameters())


def install(engine) -> bool:
    """Give a ZeRO-3 engine's module a ``generate`` that neither hangs nor gathers per token (see the Note)."""
    module = engine.module
    original = getattr(module, "generate", None)
    if not callable(original) or getattr(original, "_dsm_engine", None) is not None:
        return False
    engine_ref = weakref.ref(engine)

    @functools.wraps(original)
    def generate(*args, **kwargs):
        engine = engine_ref()
        if engine is None:
            return original(*args, **kwargs)
        import deepspeed.comm as dist
        if active(engine):  # the caller's generation_mode(): no collective runs inside it
            return original(*args, **dict(kwargs, synced_gpus=False))
        if fits(engine) and not _all_gathered(module):
            with generation_mode(engine):
                return original(*args, **dict(kwargs, synced_gpus=False))
        return original(*args, **dict(kwargs, synced_gpus=dist.get_world_size() > 1))

    generate._dsm_engine = engine_ref
    module.generate = generate
    return True


def forget(engine) -> None:
    """``engine.destroy()``: the module's own ``generate`` shows through again."""
    generate = engine.module.__dict__.get("generate")
    if generate is not None and getattr(generate, "_dsm_engine", None) is not None:
        del engine.module.__dict__["generate"]
