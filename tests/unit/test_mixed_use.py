"""MixedUseCheck on a fake engine: a parameter's gradient from outside the region is caught,
the region's own (several calls, tied uses, a retained graph) is not, and the check ends."""
import pytest
import torch
import torch.nn.functional as F

from deepspeed_multi.autograd.boundary import wrap_inputs, wrap_outputs
from deepspeed_multi.autograd.outside_use import MixedUseCheck
from deepspeed_multi.engine import _ForwardRecord


class FakeEngine:
    """A region around ``module`` with boundary nodes, as MultiEngine.forward makes it."""

    def __init__(self, factor, updates=1):
        torch.manual_seed(0)
        self.module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
        self.factor = factor
        self._trainable_params = list(self.module.parameters())
        names = {id(p): n for n, p in self.module.named_parameters()}
        self.check = MixedUseCheck(self, names, updates)

    def _engine_name(self):
        return "Fake"

    def grad_scale_factor(self):
        return self.factor

    def _pre_backward(self):
        pass

    def _before_output_backward(self, record, create_graph):
        pass

    def __call__(self, x):
        (x, ), _ = wrap_inputs(self, (x, ), {})
        out = wrap_outputs(self, self.module(x), _ForwardRecord())
        if self.check.active:
            self.check.watch_region(out)
        return out


def _x():
    return torch.randn(3, 4, requires_grad=True)


def test_direct_use_beside_the_region_is_refused_naming_the_parameter():
    engine = FakeEngine(factor=0.5)
    w = engine.module[0].weight
    with pytest.raises(RuntimeError, match=r"parameter '0.weight' received part of its gradient .* from outside"):
        (engine(_x()).sum() + F.linear(_x(), w).pow(2).sum()).backward()


def test_parameter_passed_as_an_input_is_refused():
    engine = FakeEngine(factor=0.25)
    w = engine.module[2].weight
    with pytest.raises(RuntimeError, match=r"'2.weight' received part of its gradient"):
        engine(w[:3]).sum().backward()


@pytest.mark.parametrize("program", ["twice", "chain", "retain", "grad_of_inputs"])
def test_the_regions_own_gradients_pass(program):
    engine = FakeEngine(factor=0.5)
    x = _x()
    if program == "twice":
        (engine(x).sum() + engine(x * 2).pow(2).sum()).backward()
    elif program == "chain":
        engine(engine(x)).sum().backward()
    elif program == "retain":
        loss = engine(x).pow(2).sum()
        loss.backward(retain_graph=True)
        loss.backward()
    else:
        torch.autograd.grad(engine(x).sum(), x)
        engine(x).sum().backward()
    assert engine.module[0].weight.grad is not None


def test_factor_one_lets_a_direct_use_through():
    engine = FakeEngine(factor=1.0)
    (engine(_x()).sum() + F.linear(_x(), engine.module[0].weight).sum()).backward()


def test_parameter_with_its_own_tensor_hook_is_not_compared():
    engine = FakeEngine(factor=0.5)
    w = engine.module[0].weight
    w.register_hook(lambda g: g * 3)
    (engine(_x()).sum()).backward()  # the hook changed the sum: not a direct use


def test_check_ends_after_its_updates():
    engine = FakeEngine(factor=0.5, updates=2)
    engine.check.after_update()
    assert engine.check.active
    engine.check.after_update()
    assert not engine.check.active and not engine.check._handles  # its accumulator pre-hooks are gone
    (engine(_x()).sum() + F.linear(_x(), engine.module[0].weight).sum()).backward()  # no longer checked


def test_an_overflowed_window_is_not_compared_and_not_counted():
    """fp16 overflow: inf/nan gradients cannot be compared (nan != nan); the window does not count."""
    engine = FakeEngine(factor=0.5, updates=1)
    x = _x()
    (engine(x).sum() * float("nan")).backward()  # every gradient nan, region's and accumulated alike
    engine.check.after_update()
    assert engine.check.active, "an overflowed window must not end the check"
    with pytest.raises(RuntimeError, match=r"received part of its gradient"):
        (engine(_x()).sum() + F.linear(_x(), engine.module[0].weight).sum()).backward()


def test_sparse_gradients_are_not_compared():
    engine = FakeEngine(factor=0.5)
    emb = torch.nn.Embedding(5, 4, sparse=True)
    engine.module = torch.nn.Sequential(emb)
    engine._trainable_params = [emb.weight]
    engine.check = MixedUseCheck(engine, {}, 1)
    ids = torch.tensor([[0, 3]])
    (engine(ids).sum() + emb.weight[1].sum()).backward()  # a sparse sum: let through, never a crash
    assert emb.weight.grad is not None
