"""ZeRO-3's per-module backward counters, so a retained graph can be backpropagated again.

[Note: a second backward through a ZeRO-3 forward]
DeepSpeed's ZeRO-3 hooks count, per submodule, how many backward gathers a forward armed
(``applied_pre_backward_ref_cnt``) and how many input gradients must arrive before the
submodule's parameters are released again (``ds_grads_remaining``); a backward consumes them.
A second backward through the same retained graph would find them spent and run on released
(empty) parameters. MultiEngine records what each forward added and, when a gradient reaches
that forward's outputs a second time, adds it back, so the parameters are gathered again.
"""
from typing import Dict, Tuple

import torch

_PRE, _POST = "applied_pre_backward_ref_cnt", "ds_grads_remaining"


def snapshot(module: torch.nn.Module) -> Dict[torch.nn.Module, Tuple[int, int]]:
    return {m: (m.__dict__.get(_PRE, 0), m.__dict__.get(_POST, 0)) for m in module.modules()}


def armed_by_forward(before, module: torch.nn.Module) -> Dict[torch.nn.Module, Tuple[int, int]]:
    """What one forward added to the counters (``before`` is ``snapshot`` taken before it)."""
    added = {}
    for m, (pre, post) in snapshot(module).items():
        pre0, post0 = before.get(m, (0, 0))
        # DeepSpeed resets ds_grads_remaining at each forward of the submodule, so what this
        # forward armed is the value it left (when it ran the submodule at all).
        d_pre, d_post = pre - pre0, (post if pre > pre0 else post - post0)
        if d_pre > 0 or d_post > 0:
            added[m] = (d_pre, d_post)
    return added


def rearm(added) -> None:
    for m, (d_pre, d_post) in added.items():
        m.__dict__[_PRE] = m.__dict__.get(_PRE, 0) + d_pre
        m.__dict__[_POST] = m.__dict__.get(_POST, 0) + d_post
