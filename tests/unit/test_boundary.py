"""The boundary nodes on a fake engine: scaling in and out, prologue once, double backward."""
import pytest
import torch

from deepspeed_multi.autograd.boundary import wrap_inputs, wrap_outputs
from deepspeed_multi.engine import _ForwardRecord


class FakeEngine:

    def __init__(self, factor):
        self.factor = factor
        self.prologues = 0
        self.checks = []
        self.weight = torch.nn.Parameter(torch.tensor([1.5, -2.0, 0.5]))

    def grad_scale_factor(self):
        return self.factor

    def _pre_backward(self):
        self.prologues += 1

    def _before_output_backward(self, record, create_graph):
        record.graph_tasks.add(torch._C._current_graph_task_id())
        self.checks.append((len(record.graph_tasks) > 1, create_graph))

    def __call__(self, x):
        (x, ), _ = wrap_inputs(self, (x, ), {})
        return wrap_outputs(self, {"y": torch.tanh(x * self.weight), "n": 1}, _ForwardRecord())


@pytest.mark.parametrize("factor", [1.0, 0.25, 1024.0])
def test_params_scaled_inputs_true(factor):
    x = torch.randn(3, requires_grad=True)
    engine = FakeEngine(factor)
    engine(x)["y"].pow(2).sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    w_ref = engine.weight.detach().clone().requires_grad_(True)
    torch.tanh(x_ref * w_ref).pow(2).sum().backward()
    torch.testing.assert_close(engine.weight.grad, w_ref.grad * factor)
    torch.testing.assert_close(x.grad, x_ref.grad)
    assert engine.prologues == 1 and engine.checks == [(False, False)]


def test_second_backward_through_retained_graph_is_reported():
    engine = FakeEngine(0.5)
    y = engine(torch.randn(3, requires_grad=True))["y"].sum()
    y.backward(retain_graph=True)
    y.backward()
    assert engine.checks == [(False, False), (True, False)]


@pytest.mark.parametrize("factor", [1.0, 0.5, 8.0])
def test_gradient_penalty_reaches_params_scaled_once(factor):
    """Double backward: the parameter gradient of d + |dd/dx|^2 is factor * the true one."""

    def loss_of(fn, x):
        d = fn(x)
        (gx, ) = torch.autograd.grad(d.sum(), x, create_graph=True)
        return d.sum() + gx.pow(2).sum(), gx

    engine = FakeEngine(factor)
    x = torch.randn(3, requires_grad=True)
    loss, gx = loss_of(lambda t: engine(t)["y"], x)
    loss.backward()
    w_ref = engine.weight.detach().clone().requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    loss_ref, gx_ref = loss_of(lambda t: torch.tanh(t * w_ref), x_ref)
    loss_ref.backward()
    torch.testing.assert_close(gx, gx_ref)  # what leaves the engine is the true gradient
    torch.testing.assert_close(engine.weight.grad, w_ref.grad * factor)
    torch.testing.assert_close(x.grad, x_ref.grad)
    assert (False, True) in engine.checks


def test_no_grad_forward_adds_no_nodes():
    engine = FakeEngine(0.5)
    with torch.no_grad():
        out = engine(torch.randn(3))
    assert out["y"].grad_fn is None and out["n"] == 1


def test_inplace_on_inputs_and_outputs_works_like_plain_pytorch():
    """A module may modify its input in place, the user the engine's output: gradients stay exact."""
    engine = FakeEngine(0.25)
    x = torch.randn(3, requires_grad=True)
    h = x * 2
    (hh, ), _ = wrap_inputs(engine, (h, ), {})
    hh.mul_(3)  # e.g. nn.ReLU(inplace=True) as a module's first op
    (out, ) = wrap_outputs(engine, (hh * engine.weight, ), _ForwardRecord())
    out.add_(1.0)
    out.sum().backward()
    torch.testing.assert_close(x.grad, 6 * engine.weight.detach())
    torch.testing.assert_close(engine.weight.grad, 0.25 * 6 * x.detach())
