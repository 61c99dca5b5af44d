"""fp16 at ZeRO-0 with an unfused optimizer: the gradient norm the update keeps, unscaled.

DeepSpeed's ``FP16_UnfusedOptimizer`` (ZeRO-0 fp16 with a client optimizer that is not fused)
keeps as ``_global_grad_norm``, which ``engine.get_global_grad_norm()`` (and so the Trainer's
``grad_norm``) reads, the norm of the gradients as they are, before it unscales them: the norm
times the loss scale (its ``unscale_and_clip_grads`` says so: "norm is in fact norm*scale").
Every other DeepSpeed optimizer keeps the true norm (``FP16_Optimizer`` divides by the scale, the
ZeRO optimizers unscale first). A MultiEngine applies the loss scale at its boundary, as a loss
scaler must, so the unfused optimizer's norm would be 65536 times the gradient's at the default
scale. Upstream 0.19.8 shows the true norm there only because its ``engine.backward`` no longer
scales the loss for these optimizers (only for ZeRO optimizers) while the step still divides by
the scale: its fp16 ZeRO-0 updates are the loss scale times too small (measured: SGD leaves the
weights unchanged). Here the norm is divided by the scale the gradients carried, the scale before
the update, so the logged norm is the gradient's.
"""
from __future__ import annotations

import math

from ... import compat

FEATURE = "stage0_fp16_norm"


def step(self, *args, **kwargs):
    """Replacement of ``FP16_UnfusedOptimizer.step``: DeepSpeed's, then its kept norm unscaled."""
    scale = float(self.loss_scale_config.cur_scale)
    overflow = compat.original(self, "step")(*args, **kwargs)
    norm = self._global_grad_norm
    if not overflow and scale > 0 and isinstance(norm, (int, float)) and math.isfinite(norm):
        self._global_grad_norm = norm / scale
    return overflow


def install(optimizer) -> bool:
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    if type(optimizer) is not FP16_UnfusedOptimizer or optimizer.fused_lamb_legacy:
        return False
    compat.replace_method(optimizer, "step", step, FEATURE)
    return True
