"""The gradient scale of an engine's region of the graph (see [Note: gradient scale] in autograd/boundary.py).

f = 1 / gradient_accumulation_steps, times the current dynamic (or static) loss scale for fp16;
f = 1 for an engine that trains nothing, whose gradients only pass through; no 1/gas when the
caller (the Trainer) divided the loss itself.
"""


def loss_scale(engine) -> float:
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
