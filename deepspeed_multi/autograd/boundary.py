"""The engine boundary: autograd nodes on an engine's inputs and outputs.

[Note: gradient scale is a property of the engine's region of the graph]
Each engine E has a factor f_E (1/gradient_accumulation_steps, times E's dynamic loss scale in
fp16; 1 for an engine that trains nothing). Every gradient that crosses into E's region (an
output of E) is multiplied by f_E, every gradient that crosses out of it (an input of E) is
divided by f_E. So E's parameters see f_E times the true gradient, exactly what E's optimizer
expects, and what leaves E is the true gradient again, whatever the stages, dtypes and
accumulation of the engines around it. Under ``create_graph=True`` the scaling ops become part
of the new graph and are crossed in the opposite direction by a double backward, so each one
is a ``_ScaleGrad`` node. What E's backward computes from a scaled gradient carries f_E in
its value (V = f_E * T), so a double backward that crosses back over the boundary must pass
the gradient straight through: a gradient penalty then reaches E's parameters scaled by f_E
exactly once, and what leaves E is unscaled.

[Note: when the prologue and epilogue run]
The first gradient that reaches any boundary node of E in a backward pass calls
``E._pre_backward()``; it runs E's backward prologue and queues E's epilogue as a final
callback of the autograd graph task, which runs once the whole backward has produced every
gradient (whatever the order of hooks, parameters used twice, or reentrant checkpointing,
whose inner backward runs nested inside the outer task). Before it, and before anything
else of the pass, ``dp_groups.check_dp_groups`` refuses a pass that reaches engines on different
data-parallel groups.
"""
import torch

from ..reliability.dp_groups import check_dp_groups
from .tree import tree_map


class _ScaleGrad(torch.autograd.Function):
    """``grad * scale`` inside a backward pass, straight-through in a double backward.

    Every quantity the engine's own backward computes from a scaled gradient already carries
    the factor in its value, so a double backward must not apply it again when it crosses back
    over the boundary; it only has to start the engine's backward (see the Note above).
    """

    @staticmethod
    def forward(ctx, engine, grad, scale):
        ctx.engine = engine
        return grad * scale

    @staticmethod
    def backward(ctx, grad):
        check_dp_groups(ctx.engine)
        ctx.engine._pre_backward()
        return None, grad, None


def _alias(tensors):
    """Same storage, not an autograd view: a module may modify its input (or the user the
    engine's output) in place, as with a plain nn.Module; a view returned by a custom Function
    would refuse that. The shared version counter still catches a modified saved tensor."""
    return tuple(t.detach() for t in tensors)


def _scale(engine, grad, scale):
    if grad is None:
        return None
    if torch.is_grad_enabled():  # create_graph=True: keep the op differentiable both ways
        return _ScaleGrad.apply(engine, grad, scale)
    return grad if scale == 1.0 else grad * scale


class _OutputBoundary(torch.autograd.Function):
    """Identity on an engine's outputs; in backward, starts the engine's backward and scales in."""

    @staticmethod
    def forward(ctx, engine, forward_record, *outputs):
        ctx.engine, ctx.forward_record = engine, forward_record
        ctx.set_materialize_grads(False)
        return _alias(outputs)

    @staticmethod
    def backward(ctx, *grads):
        engine = ctx.engine
        check_dp_groups(engine)  # first: before anything of this backward pass starts
        engine._before_output_backward(ctx.forward_record, create_graph=torch.is_grad_enabled())
        engine._pre_backward()
        factor = engine.grad_scale_factor()
        return (None, None, *(_scale(engine, g, factor) for g in grads))


class _InputBoundary(torch.autograd.Function):
    """Identity on an engine's inputs; in backward, scales the gradient leaving the engine out."""

    @staticmethod
    def forward(ctx, engine, *inputs):
        ctx.engine = engine
        ctx.set_materialize_grads(False)
        return _alias(inputs)

    @staticmethod
    def backward(ctx, *grads):
        engine = ctx.engine
        factor = engine.grad_scale_factor()
        return (None, *(_scale(engine, g, 1.0 / factor) for g in grads))


def _apply_boundary(fn, engine, tree, *extra):
    """Pass every tensor of ``tree`` that requires grad through its own ``fn`` node.

    One node per tensor, not one for all: a node joining several tensors would make the
    subgraph behind every one of them reachable from a loss that uses only one, and autograd
    then runs the AccumulateGrad nodes there with no gradient (ZeRO's hooks on them fail).
    """
    if not torch.is_grad_enabled():
        return tree
    replaced = {}

    def wrap(t):
        if not t.requires_grad:
            return t
        if id(t) not in replaced:
            (replaced[id(t)], ) = fn.apply(engine, *extra, t)
        return replaced[id(t)]

    return tree_map(wrap, tree)


def wrap_inputs(engine, inputs, kwargs):
    return _apply_boundary(_InputBoundary, engine, (inputs, kwargs))


def wrap_outputs(engine, outputs, forward_record=None):
    """``forward_record`` is handed back to ``engine._before_output_backward`` on every backward."""
    return _apply_boundary(_OutputBoundary, engine, outputs, forward_record)
