"""Gradients that reach an engine's parameters without crossing its boundary: a clear error.

[Note: a parameter used directly as a tensor]
_region.py puts every *module call* of an engine's submodules inside its region. A parameter
used directly as a tensor, e.g. ``F.linear(x, engine.module.fc.weight)`` or a penalty summed
over ``engine.module.parameters()``, is not a module call: its gradient bypasses the boundary,
so it is not scaled by the engine's factor, and ZeRO's backward prologue may not have run.

When no boundary node of the engine runs in a backward pass that reaches its parameters, the
prologue has not run when the first parameter gradient arrives (the engine is not
IN_BACKWARD): that is detected here, at the first such backward, and raised before ZeRO (or the
gradient accumulator) takes the gradient. The check runs where a gradient meets its parameter
anyway: in DeepSpeed's own per-parameter hook methods for ZeRO-1/2 (``process_gradients``) and
ZeRO-3 (``reduce_ready_partitions_and_remove_grads``), bound on the optimizer instance; for
stage 0, and ZeRO-1 configured without gradient hooks, in a pre-hook on each parameter's
gradient accumulator.

Not detected: a direct use in the *same* backward as a boundary crossing of the same engine
(e.g. ``loss = mse(engine(x), y) + F.linear(h, engine.module.fc.weight).sum()``). The
parameter's gradient arrives as one sum, and telling its parts apart would need to see every
node of the graph. That term's gradient is then unscaled: exact only at
gradient_accumulation_steps 1 without fp16. The README lists it.

Reentrant activation checkpointing runs the checkpointed part's backward as a nested backward
pass. When every parameter of an engine sits inside checkpointed parts, the outer pass crosses
the boundary but reaches no parameter, so the prologue waits (``engine._boundary_crossed``);
the first parameter gradient of the nested pass then starts it.
"""
import types

import torch
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from ._state import TrainingState


def install(engine) -> None:
    """Check every gradient that reaches one of ``engine``'s trainable parameters."""
    if not engine.trains:
        return
    names = {id(p): n for n, p in engine.module.named_parameters()}
    optimizer = engine.optimizer
    if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        _wrap_method(optimizer, "reduce_ready_partitions_and_remove_grads", engine, names)
    elif isinstance(optimizer, DeepSpeedZeroOptimizer) and optimizer._grad_acc_hooks:
        _wrap_method(optimizer, "process_gradients", engine, names)
    else:
        engine._outside_use_hooks = [_prehook(p, engine, names) for p in engine._trainable_params]


def check(engine, param, names) -> None:
    """A gradient is about to reach ``param``: the engine's region must be in backward."""
    if engine._state is TrainingState.IN_BACKWARD:
        return
    if engine._boundary_crossed:
        engine._start_backward()  # the nested pass of reentrant checkpointing (see the Note)
        return
    raise RuntimeError(
        f"MultiEngine ({engine._engine_name()}): parameter {names.get(id(param), '<unnamed>')!r} received a "
        "gradient in a backward pass that never crossed this engine's boundary: it was used directly as a tensor "
        "(e.g. F.linear(x, engine.module.fc.weight), or a penalty over engine.module.parameters()) outside "
        "engine(...) and outside any call of one of its submodules. The engine's gradient scale "
        "(1/gradient_accumulation_steps, the fp16 loss scale) and ZeRO's backward handling apply only inside that "
        "region. Call the submodule that owns the parameter (e.g. engine.module.fc(x)), or compute the term inside "
        "the model's forward.")


def _wrap_method(optimizer, name, engine, names):
    original = getattr(optimizer, name)

    def checked(self, param, *args):
        check(engine, param, names)
        return original(param, *args)

    setattr(optimizer, name, types.MethodType(checked, optimizer))


def _prehook(param, engine, names):
    node = torch.autograd.graph.get_gradient_edge(param).node

    def before_accumulate(grad_outputs):
        check(engine, param, names)

    return node, node.register_prehook(before_accumulate)  # keep the node alive with its hook
