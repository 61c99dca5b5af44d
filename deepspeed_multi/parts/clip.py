"""Gradient clipping on the norm of the whole model, across its parts.

[Note: clipping a model whose parts are separate ZeRO optimizers]
Plain PyTorch (and a DDP Trainer) clips on the norm of every gradient of the model. Each part's
DeepSpeed optimizer computes the norm of its own gradients and clips on that, which scales each
part by its own factor: not the same update. So at an update the parted engine does each part's
step in two halves:

1. for every part that takes an update: finish its gradient reduction (what DeepSpeed's step
   does first: ``allreduce_gradients`` at ZeRO 0/1, ``finalize_gradient_accumulation_boundary``
   at ZeRO 2/3) and compute its norm with DeepSpeed's own function for that optimizer (scaled by
   the part's loss scale in fp16);
2. combine them into the whole model's norm, ``sqrt(sum_i (norm_i / scale_i) ** 2)``, and run
   each part's own ``step()`` with its reduction made a no-op (it is done) and its norm function
   answering the whole model's norm times its own loss scale. DeepSpeed then clips by
   ``max_norm / norm`` exactly as it would, and reports the whole model's norm from
   ``get_global_grad_norm()``, as a DDP Trainer logs it.

The norm functions, by optimizer: ZeRO-1/2 ``scaled_global_norm``, ZeRO-3 ``_get_norm_groups``,
ZeRO-0 bf16 ``get_global_norm_of_tensors`` in ``bf16_optimizer``, ZeRO-0 fp32 the engine's
``clip_fp32_gradients`` (DeepSpeed's ``clip_grad_norm_`` on the reduced gradients). ZeRO-0
fp16 (DeepSpeed's FP16_Optimizer) is refused at initialize.
"""
import contextlib
import math

import torch
from deepspeed.runtime import bf16_optimizer
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from .. import compat


def check_supported(name, engine) -> None:
    """Refuse a part whose optimizer this module cannot clip on the whole model's norm."""
    if engine.gradient_clipping() > 0 and engine.trains and _kind(engine) is None:
        raise NotImplementedError(
            f"deepspeed_multi: part {name!r} (ZeRO stage {engine.zero_optimization_stage()}, optimizer "
            f"{type(engine.optimizer).__name__}) cannot clip on the whole model's gradient norm "
            "(gradient_clipping > 0 with declared submodules). Give this part ZeRO stage >= 1 (or bf16 / fp32 at "
            "stage 0), or set gradient_clipping to 0.")


def _kind(engine):
    opt = engine.optimizer
    if isinstance(opt, DeepSpeedZeroOptimizer_Stage3):
        return "zero3"
    if isinstance(opt, DeepSpeedZeroOptimizer):
        return "zero12"
    if isinstance(opt, BF16_Optimizer):
        return "bf16"
    if not (engine.fp16_enabled() or engine.bfloat16_enabled()) and isinstance(opt, torch.optim.Optimizer):
        return "fp32"
    return None


def _reduce(engine) -> None:
    if engine.zero_optimization_partition_gradients():
        engine.optimizer.finalize_gradient_accumulation_boundary()
    elif engine.enable_backward_allreduce:
        # DeepSpeed reduces ZeRO-0/1 gradients only "at the boundary", which with unmanaged
        # accumulation means while its step() runs; this is that step's first act, run early.
        with compat.swapped(engine, "_running_engine_step", True):
            engine.allreduce_gradients()


def _own_norm(engine, kind):
    """(the part's gradient norm as DeepSpeed computes it, its loss scale)."""
    opt = engine.optimizer
    if kind == "zero3":
        return compat.combine_grad_norm_groups(opt._get_norm_groups()), float(opt.loss_scale)
    if kind == "zero12":
        return opt.scaled_global_norm(), float(opt.loss_scale)
    if kind == "bf16":
        grads, _ = opt.get_grads_for_norm()
        return bf16_optimizer.get_global_norm_of_tensors(input_tensors=grads, mpu=opt.mpu,
                                                          norm_type=opt.norm_type), 1.0
    grads = [p.grad.detach().float() for p in engine.module.parameters() if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])) if grads else 0.0
    return norm, 1.0


def _invalid(norm) -> bool:
    value = float(norm)
    return not math.isfinite(value) or value < 0


def _like(norm, value):
    return torch.full_like(norm, value) if torch.is_tensor(norm) else value


class WholeModelNorm:
    """Reduce, measure and combine every updating part's norm; then ``during_step(engine)`` around
    each part's own ``step()`` makes it clip on ``self.total`` (the whole model's unscaled norm)."""

    def __init__(self, engines):
        self._measured = {}
        for engine in engines:
            kind = _kind(engine)
            _reduce(engine)
            self._measured[engine] = (kind, *_own_norm(engine, kind))
        values = self._measured.values()
        if any(_invalid(norm) for _, norm, _ in values):
            self.total = float("inf")
        else:
            self.total = math.sqrt(sum((float(norm) / scale)**2 for _, norm, scale in values))

    @contextlib.contextmanager
    def during_step(self, engine):
        if engine not in self._measured:
            yield
            return
        kind, norm, scale = self._measured[engine]
        answer = _like(norm, self.total * scale)
        opt = engine.optimizer
        with contextlib.ExitStack() as stack:
            if engine.zero_optimization_partition_gradients():
                stack.enter_context(compat.swapped(opt, "finalize_gradient_accumulation_boundary", lambda: None))
            else:
                stack.enter_context(compat.swapped(engine, "enable_backward_allreduce", False))
            if kind == "zero3":
                stack.enter_context(compat.swapped(opt, "_get_norm_groups", lambda: [answer]))
            elif kind == "zero12":
                stack.enter_context(compat.swapped(opt, "scaled_global_norm", lambda norm_type=2: answer))
            elif kind == "bf16":
                stack.enter_context(compat.swapped(bf16_optimizer, "get_global_norm_of_tensors",
                                                   lambda *args, **kwargs: answer))
            else:
                stack.enter_context(compat.swapped(engine, "clip_fp32_gradients", lambda: _clip_fp32(engine,
                                                                                                    self.total)))
            yield


def _clip_fp32(engine, total) -> None:
    """DeepSpeed's clip_grad_norm_ of the engine's gradients, with the whole model's norm."""
    coef = min(1.0, engine.gradient_clipping() / (total + 1e-6))
    for p in engine.module.parameters():
        if p.grad is not None:
            p.grad.data.mul_(coef)
