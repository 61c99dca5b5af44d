"""Engines on DeepSpeed's own managed path: the features that own the accumulation boundary.

[Note: the drop-in rule]
``deepspeed_multi.initialize`` builds an engine wherever ``deepspeed.initialize`` builds one, and
trained as upstream's is (``engine.backward(loss)``, ``engine.step()``) it gives upstream's bits.
Almost every feature runs in the MultiEngine's hook-driven path, where DeepSpeed's accumulation is
unmanaged and the engine decides the boundary at ``step()`` ([Note: who owns the gradient-
accumulation boundary] in config.py). A few features decide it inside DeepSpeed's managed
accumulation, and DeepSpeed refuses them unmanaged: DeepCompile (it compiles the backward with the
boundary in it), ZenFlow (its ``update_interval`` replaces ``gradient_accumulation_steps`` and it
steps a selective optimizer on every micro-step), SuperOffload (it steps the CPU optimizer inside
the backward, as each group of gradients completes), the hybrid engine (DeepSpeed-Chat's actor,
which switches between training and inference containers) and pipeline engines (``train_batch``
runs its own schedule and backward). Those are built here as upstream builds them, managed, in a
subclass that adds one check and changes nothing else.

The check: on DeepSpeed's managed path the gradient at the engine's outputs is divided by its
``gradient_accumulation_steps`` (``engine.backward`` divides the loss; a plain ``loss.backward()``
divides at each output), so every engine behind it in the graph would receive that division too,
and the engine counts its micro-steps itself. So a backward pass that reaches such an engine and any
other engine is refused at its first gradient, naming the feature; so is a plain ``loss.backward()``
where upstream needs ``engine.backward(loss)`` (no ZeRO optimizer: stage 0), which upstream refuses
without naming the feature. Every engine reached by a backward reports it to :func:`reached`: a
MultiEngine at its outputs' first gradient, a managed engine in ``_backward_prologue``.
"""
from __future__ import annotations

import functools
import weakref
from typing import Optional

from ..autograd import graph

_LIVE = weakref.WeakSet()  # the managed engines alive in this process: reached() does nothing without one
_REACHED = {"task": None, "engines": []}  # the running backward pass and the engines it reached (weak refs)


def feature_of(model, config: dict) -> Optional[str]:
    """The boundary-owning feature ``model`` with ``config`` uses, named as the config writes it, or None."""
    from deepspeed.runtime.pipe.module import PipelineModule
    if isinstance(model, PipelineModule):
        return "pipeline parallelism (a PipelineModule)"
    zero = config.get("zero_optimization") or {}
    if (config.get("compile") or {}).get("deepcompile") is True:
        return "DeepCompile (compile.deepcompile)"
    if zero.get("zenflow"):
        return "ZenFlow (zero_optimization.zenflow)"
    if (zero.get("offload_optimizer") or {}).get("super_offload"):
        return "SuperOffload (zero_optimization.offload_optimizer.super_offload)"
    if (config.get("hybrid_engine") or {}).get("enabled") is True:
        return "the hybrid engine (hybrid_engine.enabled)"
    return None


def engine_name(engine) -> str:
    name = getattr(engine, "_engine_name", None)
    return name() if callable(name) else type(getattr(engine, "module", engine)).__name__


class ManagedPath:
    """Mixed in before DeepSpeed's engine class: the engine trains as upstream's (see the Note)."""

    def __init__(self, *args, managed_feature: str, **kwargs):
        self.managed_feature = managed_feature
        super().__init__(*args, **kwargs)
        _LIVE.add(self)

    def _backward_prologue(self):
        reached(self)
        if not self._support_torch_style_backward and not self._running_engine_backward:
            raise RuntimeError(
                f"deepspeed_multi: {engine_name(self)} uses {self.managed_feature} at ZeRO stage "
                f"{self.zero_optimization_stage()}, which DeepSpeed trains with engine.backward(loss) only: without a "
                "ZeRO optimizer (stage 0) it cannot run its backward prologue from a plain loss.backward() (upstream "
                "refuses it too: 'Direct calls to tensor.backward() are not supported in this configuration'). Call "
                "engine.backward(loss) for this engine's loss, or use ZeRO stage 1-3.")
        super()._backward_prologue()


def reached(engine) -> None:
    """A backward pass reached ``engine``; refuse it where a managed engine and another engine meet in it."""
    if not _LIVE:
        return
    task = graph.current_task()
    if task != _REACHED["task"]:
        _REACHED["task"], _REACHED["engines"] = task, []
    engines = [e for e in (ref() for ref in _REACHED["engines"]) if e is not None]
    if any(e is engine for e in engines):
        return
    _REACHED["engines"].append(weakref.ref(engine))
    engines.append(engine)
    managed = next((e for e in engines if isinstance(e, ManagedPath)), None)
    if managed is None or len(engines) < 2:
        return
    others = ", ".join(engine_name(e) for e in engines if e is not managed)
    raise RuntimeError(
        f"deepspeed_multi: one backward pass reached {engine_name(managed)}, which uses {managed.managed_feature}, and "
        f"{others}. That feature owns DeepSpeed's gradient-accumulation boundary, so its engine runs on DeepSpeed's "
        "managed path, where the gradient at the engine's outputs is divided by its gradient_accumulation_steps: every "
        "engine behind it in the graph would get that division too, and it counts its micro-steps itself. Give "
        f"{engine_name(managed)} a loss of its own (engine.backward(loss), as upstream DeepSpeed trains it), or drop "
        f"{managed.managed_feature.split(' (')[0]} from its config to train it with other engines in one backward.")


@functools.lru_cache(maxsize=None)
def _classes() -> dict:
    """``{name in deepspeed's namespace: our managed subclass}`` for each engine class deepspeed.initialize picks."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.hybrid_engine import DeepSpeedHybridEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine
    found = {"DeepSpeedEngine": DeepSpeedEngine, "DeepSpeedHybridEngine": DeepSpeedHybridEngine,
             "PipelineEngine": PipelineEngine}
    try:
        from deepspeed.runtime.pipe.dualpipev import DualPipeVEngine
        found["DualPipeVEngine"] = DualPipeVEngine
    except ImportError:  # (before 0.19.8)
        pass
    return {name: type(f"Managed{name}", (ManagedPath, cls), {"__module__": __name__,
                                                               "__doc__": f"{name} on DeepSpeed's managed path "
                                                                          "([Note: the drop-in rule])."})
            for name, cls in found.items()}


def engine_classes(feature: str) -> dict:
    """The swaps for ``deepspeed.initialize``: each engine class it may pick -> ours, told ``feature``."""
    return {name: functools.partial(cls, managed_feature=feature) for name, cls in _classes().items()}


def is_managed(engine) -> bool:
    return isinstance(engine, ManagedPath)
