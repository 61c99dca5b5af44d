"""ZeRO-3's per-module backward counters, so a retained graph can be backpropagated again.

[Note: a second backward through a ZeRO-3 forward]
DeepSpeed's ZeRO-3 hooks count, per submodule, how many backward gathers a forward armed
(``applied_pre_backward_ref_cnt``) and how many input gradients must arrive before the
submodule's parameters are released again (``ds_grads_remaining``); a backward consumes them.
A second backward through the same retained graph would find them spent and run on released
(empty) parameters. MultiEngine records what each forward armed and, when a later backward pass
(a new autograd graph task) first reaches that forward's outputs, arms it again, so the
parameters are gathered again.
"""
import weakref
from typing import Dict, List, Tuple

import torch

from ...autograd.tree import tree_map

_PRE, _POST = "applied_pre_backward_ref_cnt", "ds_grads_remaining"
_BACKWARD_FUNCTIONS = ("pre_bwd_fn", "post_bwd_fn")


def cover_outputs(module: torch.nn.Module, outputs):
    """Give ZeRO-3's pre-backward gather to output tensors its own forward hook could not see.

    ZeRO-3's forward hook applies the module's ``pre_bwd_fn`` (gather before this module's
    backward, counted in ``applied_pre_backward_ref_cnt``) to the tensors of tuples, lists and
    dicts only; tensors inside a dataclass output get none. The module's post-backward release
    (on its inputs) still fires, on parameters that were never gathered for backward: DeepSpeed
    asserts "active_backward_submodules is empty" (or the backward runs on released parameters).
    Our tree walk sees every tensor, so the ones ZeRO-3 missed get the same node here.
    """
    fn = module.__dict__.get("pre_bwd_fn")
    if fn is None:
        return outputs
    covered = fn._backward_cls

    def cover(t):
        if t.requires_grad and not isinstance(t.grad_fn, covered):
            return fn.apply(t)
        return t

    return tree_map(cover, outputs)


_SUBMODULES: "weakref.WeakKeyDictionary[torch.nn.Module, List[torch.nn.Module]]" = weakref.WeakKeyDictionary()


def _submodules(module: torch.nn.Module) -> List[torch.nn.Module]:
    """``list(module.modules())``, walked once per module: ZeRO-3 registers its counting hooks at
    initialization, on the modules that exist then, so the list the counters live on is fixed."""
    found = _SUBMODULES.get(module)
    if found is None:
        found = _SUBMODULES[module] = list(module.modules())
    return found


def snapshot(module: torch.nn.Module) -> List[Tuple[int, int]]:
    """The two counters of every submodule of ``module`` (in ``module.modules()`` order)."""
    return [(d.get(_PRE, 0), d.get(_POST, 0)) for d in [m.__dict__ for m in _submodules(module)]]


def armed_by_forward(before, module: torch.nn.Module) -> Dict[torch.nn.Module, Tuple[int, int]]:
    """What one forward added to the counters (``before`` is ``snapshot`` taken before it)."""
    added = {}
    for m, (pre0, post0) in zip(_submodules(module), before):
        d = m.__dict__
        pre, post = d.get(_PRE, 0), d.get(_POST, 0)
        # DeepSpeed resets ds_grads_remaining at each forward of the submodule, so what this
        # forward armed is the value it left (when it ran the submodule at all).
        d_pre, d_post = pre - pre0, (post if pre > pre0 else post - post0)
        if d_pre > 0 or d_post > 0:
            added[m] = (d_pre, d_post)
    return added


def rearm(added) -> None:
    """Arm again what one forward armed, for the submodules whose counters a backward spent.

    A counter that is not spent (zero) is left alone: the earlier backward did not reach that
    submodule, or reached it through only some of its outputs, and what is left is what the
    remaining outputs need. Arming more would make ZeRO-3 gather spuriously or, for
    ds_grads_remaining, never release the submodule's parameters. Idempotent.
    """
    for m, (d_pre, d_post) in added.items():
        if m.__dict__.get(_PRE, 0) == 0:
            m.__dict__[_PRE] = d_pre
        if m.__dict__.get(_POST, 0) == 0:
            m.__dict__[_POST] = d_post


def forget(module: torch.nn.Module) -> None:
    """At ``engine.destroy()`` and before a ZeRO-3 engine is built: take ZeRO-3's per-module
    backward functions and counters off ``module``.

    ZeRO-3 creates a module's ``pre_bwd_fn``/``post_bwd_fn`` once ("not in module.__dict__"), as
    closures over the ``DeepSpeedZeRoOffload`` that created them, and its destroy() leaves them.
    An engine built later over the module would reuse them: its backward gathers would be recorded
    on the destroyed engine's coordinator, which also stays alive. The new engine's end-of-backward
    release then finds none of them, so a first submodule whose input needs no gradient keeps its
    parameters active ("Cannot free a ZeRO-3 parameter while it is still active in submodules" at
    the next ``GatheredParameters``). Without them the new engine creates its own.
    """
    for m in module.modules():
        for name in (*_BACKWARD_FUNCTIONS, _PRE, _POST):
            m.__dict__.pop(name, None)
