"""What one forward armed in ZeRO-3's per-module counters, and re-arming it."""
import torch.nn as nn

from deepspeed_multi.zero.stage3 import counters as z3


def test_armed_by_forward_and_rearm():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    used, unused = model[0], model[1]
    used.applied_pre_backward_ref_cnt, used.ds_grads_remaining = 1, 0  # left by an earlier forward
    before = z3.snapshot(model)
    used.applied_pre_backward_ref_cnt += 1  # this forward arms one gather ...
    used.ds_grads_remaining = 1  # ... and resets then counts one input gradient
    armed = z3.armed_by_forward(before, model)
    assert armed == {used: (1, 1)} and unused not in armed
    used.applied_pre_backward_ref_cnt, used.ds_grads_remaining = 1, 0  # a backward consumed them
    z3.rearm(armed)
    assert (used.applied_pre_backward_ref_cnt, used.ds_grads_remaining) == (1, 1)
    z3.rearm(armed)  # idempotent: a submodule the backward did not reach is not armed twice
    assert (used.applied_pre_backward_ref_cnt, used.ds_grads_remaining) == (1, 1)
