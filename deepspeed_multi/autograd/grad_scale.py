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
"""
import torch


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


def factor(engine) -> float:
    if not engine.trains:
        return 1.0
    if engine._caller_scales_loss:  # the caller divided the loss itself (integrations/engine_steps.py)
        return loss_scale(engine)
    return loss_scale(engine) / engine.gradient_accumulation_steps()


def back_off_after_overflow(engine):
    """After a ZeRO 1-3 update that DeepSpeed skipped for an overflow: back the autocast scaler off."""
    scaler = getattr(engine.optimizer, "torch_autocast_gradscaler", None)
    if scaler is None or not getattr(engine.optimizer, "overflow", False) or scaler._scale is None:
        return
    scaler.update(new_scale=scaler.get_scale() * scaler.get_backoff_factor())
    scaler._growth_tracker.zero_()
