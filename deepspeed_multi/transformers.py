"""Transformers ``Trainer`` (and the TRL trainers built on it) over MultiEngines.

One change for the user: ``from deepspeed_multi.transformers import Trainer`` instead of
``transformers.Trainer``, or ``multi_engine_trainer(DPOTrainer)`` for any Trainer subclass; the
DeepSpeed config comes as before (``TrainingArguments(deepspeed=...)`` or ``accelerate launch``).
The trainer then builds a :class:`TrainerAccelerator` instead of ``accelerate.Accelerator``.

[Note: the Trainer owns gradient accumulation]
``Trainer`` runs its own accumulation: it divides each micro-batch's loss by its accumulation
count (or normalizes by the tokens of the window), calls ``accelerator.backward(loss,
scale_wrt_gas=False)`` for each micro-batch, then, once per window, ``clip_grad_norm_``,
``optimizer.step()``, the scheduler and ``model.zero_grad()``. A MultiEngine left to itself
would count each ``optimizer.step()`` as one micro-step of its ``gradient_accumulation_steps``
window and divide the loss again. So every engine prepared with an optimizer by a
TrainerAccelerator updates at each ``optimizer.step()`` on the gradients of the backward passes
since its last update, and applies no 1/gas of its own (its loss scale for fp16 stays).
``clip_grad_norm_`` is where Trainer reads the window's gradient norm, before its
``optimizer.step()``; DeepSpeed computes that norm (and clips at the config's
``gradient_clipping``) inside the update, so the update runs there, and the following
``optimizer.step()`` of that window does nothing, as under upstream DeepSpeed, where Accelerate
updates inside ``backward``.
"""
from __future__ import annotations

import functools
import math

import torch

from . import compat
from .accelerate.accelerator import Accelerator
from .accelerate.wrappers import EngineOptimizer
from .engine import MultiEngine


class TrainerAccelerator(Accelerator):
    """The Accelerator a Trainer builds: the Trainer owns accumulation (see the Note)."""

    def _prepare_deepspeed(self, *args):
        result = super()._prepare_deepspeed(*args)
        for obj in result:
            if isinstance(obj, MultiEngine) and obj.has_optimizer:
                if obj.zero_optimization_stage() == 0:
                    raise ValueError(
                        f"deepspeed_multi.transformers: {type(obj.module).__name__} is configured at ZeRO stage 0, "
                        "where DeepSpeed computes no gradient norm, and the Trainer reads one at every update "
                        "(grad_norm, clipping). Use ZeRO stage 1-3 for models the Trainer trains.")
                caller_owns_accumulation(obj)
        return result

    def backward(self, loss, **kwargs):
        if self._uses_deepspeed:
            if kwargs.pop("scale_wrt_gas", False):
                raise ValueError("backward(loss, scale_wrt_gas=True) under a Trainer: the Trainer divides the loss "
                                 "by its gradient accumulation itself, so the engines do not divide again. Pass "
                                 "the loss as Trainer.training_step computes it (scale_wrt_gas=False).")
        return super().backward(loss, **kwargs)

    def _optimizer_of(self, engine) -> EngineOptimizer:
        for opt in self._optimizers:
            if isinstance(opt, EngineOptimizer) and opt.engine is engine:
                return opt
        raise ValueError(f"clip_grad_norm_: {type(engine.module).__name__} was prepared without its optimizer; "
                         "prepare the model and its optimizer together.")

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """The gradient norm of the current window, clipped at the config's ``gradient_clipping``.

        ``max_norm=inf`` asks for the norm without clipping (the Trainer does so when
        ``max_grad_norm`` is 0). The update runs here (see the Note).
        """
        if not self._uses_deepspeed:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        engine = self._engine_of("clip_grad_norm_", params=list(parameters))
        configured = engine.gradient_clipping()
        if math.isinf(max_norm):
            if configured:
                raise ValueError(
                    f"clip_grad_norm_(max_norm=inf) for {type(engine.module).__name__}: the Trainer asks for the norm "
                    f"without clipping (TrainingArguments.max_grad_norm is 0), but this engine's DeepSpeed config "
                    f"clips at gradient_clipping={configured}. Set TrainingArguments(max_grad_norm={configured}), or "
                    "\"gradient_clipping\": \"auto\" (or 0) in the config.")
        elif norm_type != 2 or not configured or not math.isclose(configured, max_norm):
            raise ValueError(
                f"clip_grad_norm_(max_norm={max_norm}, norm_type={norm_type}) for {type(engine.module).__name__}: "
                f"DeepSpeed clips the 2-norm inside the update at the config's gradient_clipping, which is "
                f"{configured} for this engine. Set \"gradient_clipping\": \"auto\" (or {max_norm}) in its config.")
        self._optimizer_of(engine).step_now()
        norm = engine.get_global_grad_norm()
        if norm is None:
            raise RuntimeError(f"clip_grad_norm_: DeepSpeed computed no gradient norm for {type(engine.module).__name__} "
                               f"at ZeRO stage {engine.zero_optimization_stage()}. Use ZeRO stage 1-3.")
        return torch.as_tensor(float(norm))


def caller_owns_accumulation(engine: MultiEngine) -> None:
    """``engine`` updates at every ``step()`` and leaves the 1/gas to its caller (see the Note)."""
    if engine._window_backwards or engine._window_micro_steps:
        raise RuntimeError(f"{type(engine.module).__name__}: the Trainer must own accumulation from the first backward "
                           "pass; prepare the model before training it.")
    engine._user_managed_boundary = True
    engine._caller_scales_loss = True


def _create_accelerator_and_postprocess(self):
    import transformers.trainer as hf_trainer
    with compat.swapped(hf_trainer, "Accelerator", TrainerAccelerator):
        return self._dsm_base.create_accelerator_and_postprocess(self)


@functools.lru_cache(maxsize=None)
def multi_engine_trainer(cls):
    """``cls`` (``transformers.Trainer`` or a subclass, e.g. TRL's ``DPOTrainer``) on MultiEngines.

    Built once per class, as ``MultiEngine<cls>``; the DeepSpeed config is given as for ``cls``.
    """
    import transformers
    if not (isinstance(cls, type) and issubclass(cls, transformers.Trainer)):
        raise TypeError(f"multi_engine_trainer: expected transformers.Trainer or a subclass of it, got {cls!r}.")
    return type(f"MultiEngine{cls.__name__}", (cls,), {
        "__doc__": f"{cls.__name__} whose DeepSpeed models are MultiEngines (deepspeed_multi.transformers).",
        "__module__": __name__,
        "_dsm_base": cls,
        "create_accelerator_and_postprocess": _create_accelerator_and_postprocess,
    })


def __getattr__(name):
    if name == "Trainer":  # built on first use, so importing this module does not import transformers
        import transformers
        return multi_engine_trainer(transformers.Trainer)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
