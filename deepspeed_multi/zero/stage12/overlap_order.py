"""ZeRO-1 with ``overlap_comm``: the update reduces the gradients in the order upstream's hooks do.

[Note: overlap_comm below ZeRO-2] in config.py says why DeepSpeed never sees the key at stage 1
under a MultiEngine. Upstream with it reduces each gradient as its hook fires in the boundary
micro-step's backward, so the buckets fill in the order that backward accumulates gradients in;
without it, DeepSpeed's update loop (``reduce_gradients``) fills them in parameter-group order. The
sums are the same, but an all-reduce over more than two ranks adds up each element in an order
that depends on where the element lies in its bucket (a ring starts each chunk at another rank):
measured on 4 CPU ranks, the two layouts leave fp32 weights 3e-8 apart after 4 updates.

So where the config asked for ``overlap_comm`` at ZeRO-1, each backward pass through the engine
records the order in which its trainable parameters' gradients are accumulated (one
post-accumulate-grad hook per parameter; a new graph task starts a new record), and the update's
``reduce_gradients`` reduces the last pass's parameters in that order, then, in group order, every
other parameter that holds a gradient (one that only an earlier pass of the window reached).
The bucket bookkeeping stays DeepSpeed's: each parameter goes through
``reduce_ready_partitions_and_remove_grads``, as the loop it replaces does. Not installed where the
method differs from the checked source (the loop order is then DeepSpeed's: the same sums, rounded
as upstream without ``overlap_comm``).
"""
from __future__ import annotations

from ... import compat
from ...autograd import graph

FEATURE = "stage1_overlap_order"


def _record(optimizer, param, group):
    def hook(_):
        state = compat.state(optimizer, FEATURE)
        task = graph.current_task()
        if task != state["task"]:
            state["task"], state["order"] = task, []
        state["order"].append((param, group))
    return hook


def reduce_gradients(self, pipeline_parallel=False):
    """Replacement of ``DeepSpeedZeroOptimizer.reduce_gradients`` at ZeRO-1 (see the module doc)."""
    if pipeline_parallel:
        return compat.original(self, "reduce_gradients")(pipeline_parallel)
    state = compat.state(self, FEATURE)
    order, state["order"], state["task"] = state["order"], [], None
    done = set()
    for param, group in (*order, *state["all"]):
        if id(param) in done:
            continue
        done.add(id(param))
        if self.get_gradient_for_reduction(param) is not None:
            self.reduce_ready_partitions_and_remove_grads(param, group)
    self.overlapping_partition_gradients_reduce_epilogue()


def install(optimizer, overlap_requested: bool) -> bool:
    """Reduce ``optimizer``'s gradients in backward order at the update; return whether it did."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    if (not overlap_requested or not isinstance(optimizer, DeepSpeedZeroOptimizer) or optimizer.partition_gradients
            or not compat.fast_path_exact(optimizer, FEATURE)):
        return False
    trainable = [(p, i) for i, group in enumerate(optimizer.bit16_groups) for p in group if p.requires_grad]
    compat.state(optimizer, FEATURE, {"order": [], "task": None, "all": trainable,
                                      "hooks": [p.register_post_accumulate_grad_hook(_record(optimizer, p, i))
                                                for p, i in trainable]})
    compat.replace_method(optimizer, "reduce_gradients", reduce_gradients, FEATURE)
    return True


def forget(optimizer) -> None:
    """``engine.destroy()``: the hooks on the module's parameters go with the engine."""
    if compat.installed(optimizer, FEATURE):
        for handle in compat.state(optimizer, FEATURE)["hooks"]:
            handle.remove()
        compat.restore(optimizer, FEATURE)
