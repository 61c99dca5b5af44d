"""Skip groups: engines that skip their update together when any of them has non-finite gradients.

RLHF code skips the actor's and the critic's updates together when either overflows in fp16,
so that they stay in step. Engines whose configs carry the same
``"deepspeed_multi": {"skip_group": "<name>"}`` form one group.

[Note: how a skip group decides]
Each ZeRO 0-2 member watches the local gradients that reach its parameters (a pre-hook on every
parameter's AccumulateGrad node, so before ZeRO moves or reduces them) and keeps a device flag
of "some value was inf/nan"; a ZeRO-3 member checks its flat buffer of reduced gradient
partitions instead (an inf on any rank lands in some rank's partition). The first member of the group whose step() reaches its update in
round r all-reduces (MAX) the OR of every member's flag; that decision holds for every member
in round r. On a skip, no member updates: each drops its gradients, counts a skipped step and,
in fp16, lowers its loss scale as DeepSpeed does on an overflow. All members must have the same
gradient_accumulation_steps and step once per round. The watch reads every gradient once more,
so it costs one extra pass over the gradients per backward, for members of a group only.
"""
import weakref

import deepspeed.comm as dist
import torch

_GROUPS = {}


class SkipGroup:

    def __init__(self, name):
        self.name = name
        self._members = []

    @classmethod
    def named(cls, name) -> "SkipGroup":
        return _GROUPS.setdefault(name, cls(name))

    def members(self):
        alive = [ref() for ref in self._members]
        return [m for m in alive if m is not None]

    def add(self, engine) -> None:
        if self.members() and engine.gradient_accumulation_steps() != self.members()[0].gradient_accumulation_steps():
            raise ValueError(f"skip_group {self.name!r}: every member must have the same gradient_accumulation_steps; "
                             f"found {engine.gradient_accumulation_steps()} and "
                             f"{self.members()[0].gradient_accumulation_steps()}.")
        engine._nonfinite = torch.zeros((), dtype=torch.bool, device=engine.device)
        if engine.zero_optimization_stage() == 3:
            # Partitioned parameters have no stable AccumulateGrad node to watch; their reduced
            # gradients accumulate in their partition buffers instead, checked when the group decides.
            engine._skip_watch = None
        else:
            engine._skip_watch = [_watch(p, engine) for p in engine.module.parameters() if p.requires_grad]
        engine._updates_done = 0
        engine._skip_decisions = {}  # round -> decision, written by the member that decided first
        self._members.append(weakref.ref(engine))

    def remove(self, engine) -> None:
        """``engine`` leaves the group (``engine.destroy()``): its watches come off the parameters."""
        self._members = [ref for ref in self._members if ref() is not None and ref() is not engine]
        for _, handle in engine._skip_watch or ():
            handle.remove()
        engine._skip_watch = None

    def should_skip(self, engine) -> bool:
        """The group's decision for ``engine``'s current round (collective on the first ask)."""
        round_ = engine._updates_done
        if round_ not in engine._skip_decisions:
            members = self.members()
            flag = torch.stack([_nonfinite(m) for m in members]).any().to(torch.uint8).reshape(1)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            for member in members:
                member._skip_decisions[round_] = bool(flag.item())
        return engine._skip_decisions.pop(round_)


def _nonfinite(engine) -> torch.Tensor:
    if engine._skip_watch is None:
        from ..zero.stage3.lazy_grads import nonfinite
        found = nonfinite(engine.optimizer)
        return found if found is not None else engine._nonfinite
    return engine._nonfinite


def _watch(param, engine):
    """Pre-hook on ``param``'s AccumulateGrad node: OR "non-finite" into engine._nonfinite."""
    node = torch.autograd.graph.get_gradient_edge(param).node

    def prehook(grad_outputs):
        for g in grad_outputs:
            if g is not None:
                engine._nonfinite.logical_or_(~torch.isfinite(g).all())

    return node, node.register_prehook(prehook)  # keep the node alive with its hook
