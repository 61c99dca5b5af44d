"""The gradient scale of an engine's region of the graph (see [Note: gradient scale] in autograd/boundary.py).

f = 1 / gradient_accumulation_steps, times the current dynamic (or static) loss scale for fp16;
f = 1 for an engine that trains nothing, whose gradients only pass through; no 1/gas when the
caller (the Trainer) divided the loss itself.

[Note: torch_autocast's GradScaler]
DeepSpeed's ``torch_autocast`` mode in fp16 keeps a ``torch.amp.GradScaler`` (on the engine at
ZeRO-0, on the ZeRO optimizer at 1-3) that ``engine.backward`` feeds through ``scaler.scale(loss)``
and the step unscales. A plain ``loss.backward()`` never calls ``scale``, so the scaler's step
failed (``_scale is None``); here the boundary multiplies by the scaler's scale instead, as it does
with DeepSpeed's own fp16 loss scale. At ZeRO 1-3 DeepSpeed finds an overflow in its all-reduced
gradient norm and skips the update on every rank before the scaler runs, so the scaler never
backs off and a scale that overflows keeps every later update skipped (upstream too, with
``engine.backward``); ``back_off_after_overflow`` backs it off as DDP's GradScaler does on a
skipped step (scale times ``backoff_factor``, growth count restarted).

[Note: a loss scaled by engine.backward]
``engine.backward(loss)`` knows the loss, so it scales it as upstream's does (divided by the
engine's gradient_accumulation_steps unless ``scale_wrt_gas=False``, then times DeepSpeed's loss
scale) and the whole backward pass carries that scale, the pass's *ambient* scale. The engine's
own boundary then passes gradients straight through (its factor is already in them), so a
parameter used directly as a tensor outside its region (TRL's distillation loss over
``lm_head.weight``) gets the same scale as upstream gives it, and the engine's arithmetic is
upstream's. Every other engine the pass reaches applies its own factor relative to the ambient
one (f_E / ambient into its region, ambient / f_E out), so its gradients are those a plain
``loss.backward()`` gives it. ``scale_wrt_gas=False`` says the caller owns the 1/gas (the Trainer
divided the loss): then no engine of the pass divides, each keeping only its loss scale. The
pass is process-wide, not per thread: on a GPU autograd runs the boundary nodes on its device
threads.
"""
import contextlib

import torch
from deepspeed.runtime.base_optimizer import ZeROOptimizer

_pass = None  # (engine, ambient scale, whether engines divide by their gas) while engine.backward runs (the Note)


def autocast_scaler(engine):
    """The GradScaler of DeepSpeed's fp16 torch_autocast mode, or None."""
    return getattr(engine, "torch_autocast_z0_gradscaler", None) or getattr(
        engine.optimizer, "torch_autocast_gradscaler", None)


def loss_scale(engine) -> float:
    scaler = autocast_scaler(engine)
    if scaler is not None:
        if scaler._scale is None:  # lazily created by its first scale(), which no one calls here
            scaler.scale(torch.ones((), device=engine.device))
        return float(scaler.get_scale())
    if not engine.fp16_enabled():
        return 1.0
    scale = engine._get_optimizer_loss_scale()
    return float(scale) if scale is not None else 1.0


def _own_factor(engine) -> float:
    if not engine.trains:
        return 1.0
    if engine._caller_scales_loss:  # the caller divided the loss itself (integrations/engine_steps.py)
        return loss_scale(engine)
    return loss_scale(engine) / engine.gradient_accumulation_steps()


def factor(engine) -> float:
    """The factor at ``engine``'s boundary: its own, relative to the ambient scale of an
    ``engine.backward`` pass ([Note: a loss scaled by engine.backward])."""
    if _pass is None:
        return _own_factor(engine)
    owner, ambient, divides = _pass
    if engine is owner:
        return 1.0
    own = _own_factor(engine) if divides or not engine.trains else loss_scale(engine)
    return 1.0 if own == ambient else own / ambient


def is_backward_of(engine) -> bool:
    """Whether the running backward pass is ``engine.backward(loss)``'s."""
    return _pass is not None and _pass[0] is engine


def scale_loss(engine, loss, scale_wrt_gas: bool):
    """``loss`` as upstream's ``engine.backward`` scales it before its backward.

    Returns:
        tuple: (``loss`` divided by gradient_accumulation_steps, or ``loss`` where ``scale_wrt_gas`` is False:
        what ``engine.backward`` returns; that times the loss scale: what it backpropagates; the ambient scale,
        None for an engine that trains nothing, whose loss is backpropagated as it is).
    """
    gas = engine.gradient_accumulation_steps()
    gas_scaled = loss / gas if scale_wrt_gas else loss
    if not engine.trains:  # nothing of this engine to scale: the other engines' own factors apply
        return gas_scaled, loss, None
    scale = loss_scale(engine)
    if isinstance(engine.optimizer, ZeROOptimizer):  # upstream's own scaling, for its bits
        scaled = engine.optimizer.scale_if_loss(gas_scaled)
    elif autocast_scaler(engine) is not None:
        scaled = autocast_scaler(engine).scale(gas_scaled)
    else:  # (ZeRO-0's fp16 optimizer: upstream does not scale there; its boundary factor does, so does this)
        scaled = gas_scaled if scale == 1.0 else gas_scaled * scale
    return gas_scaled, scaled, (scale / gas if scale_wrt_gas else scale)


@contextlib.contextmanager
def backward_of(engine, ambient: float, scale_wrt_gas: bool):
    """The backward pass of ``engine.backward(loss)``, whose loss carries ``ambient`` (see the Note; None: no
    scale of the engine's)."""
    global _pass
    if ambient is None:
        yield
        return
    if _pass is not None:
        raise RuntimeError(f"engine.backward() of {engine._engine_name()} was called inside the backward pass of "
                           f"{_pass[0]._engine_name()}.backward(): call it after that backward returns.")
    _pass = (engine, ambient, scale_wrt_gas)
    try:
        yield
    finally:
        _pass = None


def back_off_after_overflow(engine):
    """After a ZeRO 1-3 update that DeepSpeed skipped for an overflow: back the autocast scaler off."""
    scaler = getattr(engine.optimizer, "torch_autocast_gradscaler", None)
    if scaler is None or not getattr(engine.optimizer, "overflow", False) or scaler._scale is None:
        return
    scaler.update(new_scale=scaler.get_scale() * scaler.get_backoff_factor())
    scaler._growth_tracker.zero_()
