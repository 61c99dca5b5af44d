"""Gradients that reach an engine's parameters from outside its region: a clear error.

[Note: a parameter used directly as a tensor]
region.py puts every *module call* of an engine's submodules inside its region. A parameter
used directly as a tensor, e.g. ``F.linear(x, engine.module.fc.weight)`` or a penalty summed
over ``engine.module.parameters()``, is not a module call: its gradient bypasses the boundary,
so it is not scaled by the engine's factor, and ZeRO's backward prologue may not have run.

Under ``engine.backward(loss)`` the loss carries the engine's scale from the top ([Note: a loss
scaled by engine.backward]), so such a gradient is scaled as upstream scales it: the engine's
backward starts at the first one, and nothing is refused.

When no boundary node of the engine runs in a backward pass that reaches its parameters, the
prologue has not run when the first parameter gradient arrives (the engine is not
IN_BACKWARD): that is detected here, at the first such backward, and raised before ZeRO (or the
gradient accumulator) takes the gradient. The check runs where a gradient meets its parameter
anyway: in DeepSpeed's own per-parameter hook methods for ZeRO-1/2 (``process_gradients``) and
ZeRO-3 (``reduce_ready_partitions_and_remove_grads``), bound on the optimizer instance; for
stage 0, and ZeRO-1 configured without gradient hooks, in a pre-hook on each parameter's
gradient accumulator.

[Note: a direct use in the same backward as the region]
A direct use in the *same* backward as a boundary crossing of the same engine (e.g. ``loss =
mse(engine(x), y) + F.linear(h, engine.module.fc.weight).sum()``) gives the parameter one
gradient sum whose parts the per-parameter hooks cannot tell apart. :class:`MixedUseCheck`
tells them apart while it is on: at the end of each forward of the region it walks the autograd
graph from the region's output boundary nodes down to its input boundary nodes, and puts a
post-hook on every node with an edge into a trainable parameter's gradient accumulator; in
backward those hooks sum what the region sends to each parameter, and a pre-hook on the
accumulator compares that sum with what arrives (the same additions in the same order, so equal
bit for bit when nothing else contributes). A difference is a gradient from outside the region,
unscaled by the engine's factor: raised, naming the parameter, unless the factor is exactly 1
(gradient_accumulation_steps 1 without fp16), where it is harmless. The walk costs one pass over
the region's graph per forward, so the check runs during the engine's first
``direct_use_check_updates`` updates (1 by default; -1 always; 0 never) and then removes its
hooks: a direct use that first appears later is not seen. A gradient that is not finite (an fp16
overflow, whose step is skipped) cannot be compared (nan != nan): that window does not count
towards the updates. Not checked: ZeRO-3 (its parameters
are partitioned outside module calls, and torch fails first), parameters with tensor hooks of
their own (they change the sum before the pre-hook sees it), and gradients of reentrant
checkpointing's nested pass (its recomputed nodes were never walked; such a pass is skipped),
sparse gradients, and a backward after a ``create_graph`` backward of the same forward (a
gradient penalty): there the second-order part can reach a parameter from a node that backward
made, never walked, though it is scaled like the rest (a custom autograd Function that saves the
parameter itself, as DeepSpeed's ZeRO-3 ``memory_efficient_linear`` does: it replaces
``torch.nn.functional.linear`` in the whole process once a ZeRO-3 engine is built, so this
happened to ZeRO-1/2 engines beside any ZeRO-3 engine). Such a mismatch is not counted.

Reentrant activation checkpointing runs the checkpointed part's backward as a nested backward
pass. When every parameter of an engine sits inside checkpointed parts, the outer pass crosses
the boundary but reaches no parameter, so the prologue waits (``engine._boundary_crossed``);
the first parameter gradient of the nested pass then starts it, and the epilogue runs at the end
of the outer pass, once every nested pass has given its gradients (PEFT LoRA adapters inside
checkpointed layers: at ZeRO-3 an epilogue after the first nested pass released the submodules
the outer pass still had to, "active_backward_submodules is empty during backward pass").
"""
import torch
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from .. import compat
from ..state import TrainingState
from . import grad_scale, graph
from .tree import tree_tensors

FEATURE = "outside_use"


def install(engine) -> None:
    """Check every gradient that reaches one of ``engine``'s trainable parameters."""
    engine._mixed_use = None
    if not engine.trains:
        return
    names = {id(p): n for n, p in engine.module.named_parameters()}
    optimizer = engine.optimizer
    updates = engine.options.direct_use_check_updates
    if not isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3) and updates != 0:
        engine._mixed_use = MixedUseCheck(engine, names, updates)
    if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        _wrap_method(optimizer, "reduce_ready_partitions_and_remove_grads", engine, names)
    elif isinstance(optimizer, DeepSpeedZeroOptimizer) and optimizer._grad_acc_hooks:
        _wrap_method(optimizer, "process_gradients", engine, names)
    else:
        engine._outside_use_hooks = [_prehook(p, engine, names) for p in engine._trainable_params]


def uninstall(engine) -> None:
    """Take the checks' hooks off the parameters (``engine.destroy()``); the optimizer's goes with it."""
    for _, handle in engine._outside_use_hooks or ():
        handle.remove()
    engine._outside_use_hooks = None
    if engine._mixed_use is not None:
        engine._mixed_use.remove()
        engine._mixed_use = None


def check(engine, param, names) -> None:
    """A gradient is about to reach ``param``: the engine's region must be in backward."""
    if engine._state is TrainingState.IN_BACKWARD:
        return
    if engine._boundary_crossed:
        engine._start_backward()  # the nested pass of reentrant checkpointing (see the Note)
        return
    if grad_scale.is_backward_of(engine):  # the loss carries the engine's scale ([Note: a loss scaled by
        engine._pre_backward()             # engine.backward]): the prologue runs at its first gradient
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

    def checked(self, param, *args):
        check(engine, param, names)
        return compat.original(self, name)(param, *args)

    compat.replace_method(optimizer, name, checked, FEATURE)


def _prehook(param, engine, names):
    node = torch.autograd.graph.get_gradient_edge(param).node

    def before_accumulate(grad_outputs):
        check(engine, param, names)

    return node, node.register_prehook(before_accumulate)  # keep the node alive with its hook


class MixedUseCheck:
    """Gradients from outside the region mixed into a parameter's sum (see the Note above)."""

    def __init__(self, engine, names, updates):
        from .boundary import _InputBoundary, _OutputBoundary
        self.engine_name = engine._engine_name
        self.scale_factor = engine.grad_scale_factor
        self.names = names
        self.updates_left = updates  # -1: always
        self._stops = (_InputBoundary._backward_cls, _OutputBoundary._backward_cls)
        self._acc = {}  # gradient accumulator node -> parameter
        self._handles = []
        for param in engine._trainable_params:
            node = torch.autograd.graph.get_gradient_edge(param).node
            self._acc[node] = param
            self._handles.append(node.register_prehook(self._make_before_accumulate(param)))
        self._task, self._sums = None, {}  # the recording graph task, {parameter: what the region sent it}
        self._inconclusive = False  # a gradient of this window was not finite: compared nothing
        self._double = False  # a create_graph backward ran since the region's last forward

    @property
    def active(self) -> bool:
        return self.updates_left != 0

    def watch_region(self, outputs) -> None:
        """A forward of the region ended with ``outputs`` (its output boundary tensors)."""
        acc, stops = self._acc, self._stops
        self._double = False
        stack = [t.grad_fn for t in tree_tensors(outputs) if t.grad_fn is not None]
        seen = set()
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            edges = []
            for k, (nxt, _) in enumerate(node.next_functions):
                if nxt is None:
                    continue
                param = acc.get(nxt)
                if param is not None:
                    edges.append((k, param))
                elif not isinstance(nxt, stops):  # another region's boundary: not this region's graph
                    stack.append(nxt)
            if edges:
                node.register_hook(self._make_record(edges))

    def _make_record(self, edges):

        def record_region_gradient(grad_inputs, grad_outputs):
            task = graph.current_task()
            if task != self._task:  # a new backward pass (only one records at a time: see the Note)
                self._task, self._sums = task, {}
            if torch.is_grad_enabled():  # create_graph: later passes may carry second-order parts
                self._double = True
            sums = self._sums
            for k, param in edges:
                g = grad_inputs[k]
                if g is not None:
                    sums[param] = g if param not in sums else sums[param] + g

        return record_region_gradient

    def _make_before_accumulate(self, param):

        def before_accumulate(grad_outputs):
            if graph.current_task() != self._task:
                return  # the region sent nothing in this pass (reentrant checkpointing's nested pass)
            got, region = grad_outputs[0], self._sums.pop(param, None)
            if got is None or param._backward_hooks:
                return  # (the parameter's own tensor hooks ran first and may have changed the sum)
            if got.layout != torch.strided or (region is not None and region.is_sparse):
                return  # sparse: torch.equal has no sparse kernel; not compared
            if region is not None and torch.equal(got, region):
                return
            if not bool(torch.isfinite(got).all()):
                self._inconclusive = True  # an fp16 overflow: nan != nan; this window does not count
                return
            factor = self.scale_factor()
            if factor == 1.0:
                return
            if self._double:  # not comparable (see the Note): this window does not count
                self._inconclusive = True
                return
            raise RuntimeError(
                f"MultiEngine ({self.engine_name()}): parameter {self.names.get(id(param), '<unnamed>')!r} received "
                "part of its gradient in this backward pass from outside the engine's region: it was used directly as "
                "a tensor (e.g. F.linear(x, engine.module.fc.weight), a penalty over engine.module.parameters(), or "
                "passed to engine(...) as an input) besides its use inside engine(...) or a call of one of its "
                f"submodules. Only the region applies the engine's gradient scale ({factor:g}: 1/"
                "gradient_accumulation_steps, times the fp16 loss scale), so that part would be off by that factor. "
                "Call the submodule that owns the parameter (e.g. engine.module.fc(x)), or compute the term inside the "
                "model's forward. (This check runs during the engine's first direct_use_check_updates updates, 1 by "
                'default: {"deepspeed_multi": {"direct_use_check_updates": N}} in its config.)')

        return before_accumulate

    def end_backward(self) -> None:
        """The engine's epilogue: release the gradients held for the comparison."""
        self._task, self._sums = None, {}

    def after_update(self) -> None:
        """End of an accumulation window; a window whose gradients overflowed is not counted."""
        if self._inconclusive:
            self._inconclusive = False
            return
        if self.updates_left > 0:
            self.updates_left -= 1
            if self.updates_left == 0:
                self.remove()

    def remove(self) -> None:
        self.updates_left = 0
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._acc.clear()
        self.end_backward()
