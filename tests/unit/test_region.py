"""The region's submodule hooks: out of the submodules while engine(...) runs, back (last) after."""
import pytest
import torch

from deepspeed_multi.autograd.region import Region


class _Engine:
    """What the region hooks need of an engine: its module (no outside call is made here)."""

    def __init__(self):
        self.module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2)))


def _ours(region, module):
    (entry, ) = [h for h in region._hooks if h[0] is module]
    return entry[1], entry[3]


def test_hooks_leave_every_submodule_inside_forward_and_come_back_last():
    engine = _Engine()
    region = Region()
    region.install(engine)
    modules = list(engine.module.modules())
    user = modules[1].register_forward_hook(lambda m, a, o: None)  # registered after ours
    region.enter_forward()
    assert region.depth == 1
    for m in modules:
        pre_id, post_id = _ours(region, m)
        assert pre_id not in m._forward_pre_hooks and post_id not in m._forward_hooks
    assert user.id in modules[1]._forward_hooks  # other hooks stay
    assert not modules[2]._forward_hooks and not modules[2]._forward_pre_hooks  # torch's fast call path
    region.enter_forward()  # nested: only the outermost exit restores
    region.exit_forward()
    assert _ours(region, modules[0])[0] not in modules[0]._forward_pre_hooks
    region.exit_forward()
    assert region.depth == 0
    for m in modules:
        pre_id, post_id = _ours(region, m)
        assert list(m._forward_pre_hooks)[-1] == pre_id and list(m._forward_hooks)[-1] == post_id


def test_restored_after_a_forward_that_raised():
    engine = _Engine()
    region = Region()
    region.install(engine)
    with pytest.raises(ValueError):
        region.enter_forward()
        try:
            raise ValueError("forward failed")
        finally:
            region.exit_forward()
    for m in engine.module.modules():
        pre_id, post_id = _ours(region, m)
        assert pre_id in m._forward_pre_hooks and post_id in m._forward_hooks


def test_remove_leaves_nothing():
    engine = _Engine()
    region = Region()
    region.install(engine)
    region.remove()
    region.enter_forward()
    region.exit_forward()
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in engine.module.modules())
