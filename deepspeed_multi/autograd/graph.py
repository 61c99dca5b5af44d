"""The private autograd-engine calls this package needs, in one place.

PyTorch exposes no public API for "which backward pass is running", "will this pass reach that
node" or "run this when the pass ends"; these wrappers name what each private call is used for,
so a PyTorch release that moves one is mended here.
"""
import torch
from torch.autograd.graph import _get_grad_fn_or_grad_acc


def current_task() -> int:
    """The id of the running autograd graph task (one ``backward()``), or -1 outside backward."""
    return torch._C._current_graph_task_id()


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def will_execute(node) -> bool:
    """Will the running backward pass execute ``node``? (Only valid inside backward.)"""
    return torch._C._will_engine_execute_node(node)


def at_end_of_backward(callback) -> None:
    """Run ``callback()`` once the running graph task has produced every gradient."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def grad_accumulator(param):
    """``param``'s AccumulateGrad node (its grad_fn for a non-leaf), created if need be."""
    with torch.enable_grad():  # leaf parameters need grad mode to hand out their AccumulateGrad
        return _get_grad_fn_or_grad_acc(param)


def any_param_in_current_graph(params) -> bool:
    """Will the running backward accumulate into any of ``params``? Stops at the first one."""
    for param in params:
        if not param.requires_grad:
            continue
        node = grad_accumulator(param)
        if node is not None and will_execute(node):
            return True
    return False
