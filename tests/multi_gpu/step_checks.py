"""Rank functions for test_step.py: step() with nothing accumulated, and a step() that raises."""
import copy

import torch

import deepspeed.comm as dist
import deepspeed_multi
from common import FP32_TOL, MLP, ds_config, full_params


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)


def _schedule(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


# What each micro-step does: "backward" (loss.backward()), "input-grad" (torch.autograd.grad of the
# input only: no parameter gradient), "none" (no backward at all). step() follows every micro-step.
PLAN = ["backward", "none", "input-grad", "backward", "none", "none", "backward", "backward"]


def _micro_step(model, kind, step, rank):
    x, y = (t.to(model.device) for t in _batch(step, rank))
    if kind == "backward":
        ((model(x) - y)**2).mean().backward()
    elif kind == "input-grad":
        x = x.clone().requires_grad_(True)
        torch.autograd.grad(((model(x) - y)**2).mean(), x)


def step_without_backward(stage, gas):
    """Parameters and Adam state stay put, the LR schedule and counters advance, as in PyTorch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = MLP(seed=1)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    engine, _, _, sched = deepspeed_multi.initialize(model=model, optimizer=opt, lr_scheduler=_schedule(opt),
                                                     config=ds_config(stage, gas=gas))
    ref = MLP(seed=1)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.05)
    ref_sched = _schedule(ref_opt)
    for step, kind in enumerate(PLAN):
        before = full_params(engine)
        updates_before = engine.global_steps
        _micro_step(engine, kind, step, rank)
        boundary = engine.is_update_boundary()
        engine.step()
        for r in range(world):
            if kind == "backward":
                x, y = _batch(step, r)
                (((ref(x) - y)**2).mean() / world / gas).backward()
        if boundary:
            ref_opt.step()  # skips parameters whose .grad is None
            ref_sched.step()
            ref_opt.zero_grad(set_to_none=True)
            assert engine.global_steps == updates_before + 1, "an update boundary must count a step"
        window = PLAN[step - gas + 1:step + 1] if boundary else []
        if boundary and all(k != "backward" for k in window):
            after = full_params(engine)
            moved = max((after[n] - before[n]).abs().max().item() for n in after)
            assert moved == 0, f"step {step} ({kind}): no backward in the window, yet parameters moved by {moved:.3e}"
        got_lr, want_lr = engine.get_lr()[0], ref_sched.get_last_lr()[0]
        assert abs(got_lr - want_lr) < 1e-12, f"step {step}: lr {got_lr} != reference {want_lr}"
        got = full_params(engine)
        err = max((got[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
        assert err <= FP32_TOL, f"stage {stage} gas {gas} step {step} ({kind}): max abs error {err:.3e} vs PyTorch"


class FlakySGD(torch.optim.SGD):
    """Raises from its ``fail_on``-th call of step(), before changing anything."""

    def __init__(self, params, fail_on, **kw):
        super().__init__(params, **kw)
        self.calls, self.fail_on = 0, fail_on

    def step(self, closure=None):
        self.calls += 1
        if self.calls == self.fail_on:
            raise RuntimeError("forced failure inside the optimizer step")
        return super().step(closure)


def step_exception_recovers(stage):
    """An exception inside DeepSpeed's step() leaves an engine that, after zero_grad(), trains exactly."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = MLP(seed=1)
    engine = deepspeed_multi.initialize(model=model, optimizer=FlakySGD(model.parameters(), fail_on=2, lr=0.1),
                                        config=ds_config(stage))[0]
    ref = copy.deepcopy(MLP(seed=1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(5):
        x, y = (t.to(engine.device) for t in _batch(step, rank))
        ((engine(x) - y)**2).mean().backward()
        failed = False
        try:
            engine.step()
        except RuntimeError as e:
            assert "forced failure" in str(e), e
            failed = True
            assert not engine.is_gradient_accumulation_boundary(), "DeepSpeed's step flag was left set"
            engine.zero_grad()
        assert failed == (step == 1), f"step {step}: failed={failed}"
        for r in range(world):
            xr, yr = _batch(step, r)
            (((ref(xr) - yr)**2).mean() / world).backward()
        if not failed:
            ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    got = full_params(engine)
    err = max((got[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    assert err <= FP32_TOL, f"stage {stage}: after a failed step, max abs error {err:.3e} vs PyTorch"
