"""ZeRO-1/2: DeepSpeed's per-parameter gradient hook, with the used-parameter count cached.

[Note: the used-parameter count]
DeepSpeed's gradient hook (``DeepSpeedZeroOptimizer.create_gradient_handling_hooks``) counts, at
the first hook of every backward, how many of the engine's parameters the running backward will
reach: ``count_used_parameters_in_backward`` finds each parameter's grad accumulator through an
``enable_grad`` context and a ``view_as`` per parameter, every backward (the cost against the
same count from kept accumulators: docs/design.md, Decisions). The count only feeds
DeepSpeed's hook-state bookkeeping for its own epilogue hooks, which MultiEngine unregisters and
replaces with its graph-task callback (engine.py), but the bookkeeping stays as DeepSpeed keeps it.

:func:`install` removes those hooks and registers hooks with the same body (the refresh test,
``reenter_backward_if_needed``, ``process_gradients``, ``update_hook_state_and_maybe_run_epilogue``)
whose count comes from the accumulators looked up once at install. Holding an accumulator keeps it
the parameter's accumulator (the tensor refers to it weakly and reuses it while it lives), so the
count is the same number: the nodes of the parameters that require grad, each asked
``torch._C._will_engine_execute_node``. Applies where DeepSpeed registered one hook per parameter
that requires grad and nothing overrides the methods involved; otherwise nothing changes.

Not at ZeRO-3: an accumulator records its parameter's shape when it is created, and a ZeRO-3
parameter is partitioned (empty) outside its module's forward, so an accumulator looked up then
and kept would reject the full-size gradient of the next backward.
"""
from __future__ import annotations


from ... import compat
from ...autograd import graph

FEATURE = "stage12_hook_count"


class UsedParameterCount:
    """``count_used_parameters_in_backward(params)`` from grad accumulators kept since install."""

    def __init__(self, params):
        self.params = list(params)
        self.nodes = [graph.grad_accumulator(p) for p in self.params]

    def __call__(self) -> int:
        if not graph.in_backward():
            raise RuntimeError("the used-parameter count must be taken during backward execution")
        will_execute = graph.will_execute
        seen = set()
        count = 0
        for param, node in zip(self.params, self.nodes):
            if node is None or not param.requires_grad or node in seen:
                continue
            seen.add(node)
            count += will_execute(node)
        return count


def _make_hook(optimizer, param, group_index, count):

    def grad_handling_hook(*_):
        refresh_expected = optimizer.should_refresh_expected_hook_count()  # before reentering
        optimizer.reenter_backward_if_needed()
        optimizer.process_gradients(param, group_index)
        expected = count() if refresh_expected else optimizer._max_expected_hooks_seen
        optimizer.update_hook_state_and_maybe_run_epilogue(expected)

    return grad_handling_hook


def install(optimizer) -> bool:
    """Re-register ``optimizer``'s gradient hooks with the cached count; return whether it did."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed.utils.torch import register_grad_hook
    if (not isinstance(optimizer, DeepSpeedZeroOptimizer) or compat.installed(optimizer, FEATURE)
            or not compat.fast_path_exact(optimizer, FEATURE)):
        return False
    params = [(i, p) for i, group in enumerate(optimizer.bit16_groups) for p in group if p.requires_grad]
    hooks = getattr(optimizer, "_grad_acc_hooks", None)
    if not hooks or len(hooks) != len(params):
        return False
    count = UsedParameterCount(p for _, p in params)
    for handle in hooks:
        handle.remove()
    hooks.clear()
    for i, param in params:
        hooks.append(register_grad_hook(param, _make_hook(optimizer, param, i, count)))
    compat.state(optimizer, FEATURE, {"count": count})
    return True
