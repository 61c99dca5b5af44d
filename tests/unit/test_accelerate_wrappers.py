"""EngineOptimizer / UpdateScheduler against a stand-in engine with MultiEngine's step() contract:
whatever the accumulation window, skipped updates and extra calls, the schedule advances exactly
once per applied update, and zero_grad() discards only outside a window."""
import pytest

pytest.importorskip("accelerate")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

import torch  # noqa: E402


class FakeEngine:
    """MultiEngine.step()'s bookkeeping: update at the end of each window, fp16-style skips counted."""

    def __init__(self, gas, skips):
        self.gas, self.skips = gas, list(skips)
        self.global_steps = self.skipped_steps = self._window_micro_steps = 0
        self.discards = 0

    def gradient_accumulation_steps(self):
        return self.gas

    def is_update_boundary(self):
        return (self._window_micro_steps + 1) % self.gas == 0

    def step(self):
        if not self.is_update_boundary():
            self._window_micro_steps += 1
            return
        self._window_micro_steps = 0
        self.global_steps += 1
        if self.skips and self.skips.pop(0):
            self.skipped_steps += 1

    def zero_grad(self):
        self.discards += 1


@pytest.fixture(scope="module")
def accelerator():
    from accelerate import Accelerator
    return Accelerator(cpu=True)


@settings(max_examples=60, deadline=None)
@given(gas=st.integers(1, 4), calls=st.lists(st.sampled_from(["loop", "extra_sched", "zero_grad"]), max_size=40),
       skips=st.lists(st.booleans(), max_size=20), steps=st.integers(1, 3))
def test_schedule_steps_per_applied_update(accelerator, gas, calls, skips, steps):
    """``steps`` scheduler steps per applied update (Accelerate's num_processes, 1 with split batches)."""
    from deepspeed_multi.accelerate.wrappers import EngineOptimizer, UpdateScheduler
    engine = FakeEngine(gas, skips)
    base = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(base, lambda u: 1.0)
    opt = EngineOptimizer(base, engine)
    wrapped = UpdateScheduler(sched, opt, steps_per_update=steps)
    expected_discards = 0
    for call in calls:
        if call == "loop":           # the RFC/guide loop body after accelerator.backward
            opt.step()
            wrapped.step()
            before = engine.discards
            opt.zero_grad()
            assert engine.discards - before == (1 if engine._window_micro_steps == 0 else 0)
            expected_discards += engine.discards - before
        elif call == "extra_sched":  # a second scheduler.step() never advances again
            wrapped.step()
        else:
            inside = engine._window_micro_steps > 0
            before = engine.discards
            opt.zero_grad()
            assert engine.discards - before == (0 if inside else 1)
    applied = engine.global_steps - engine.skipped_steps
    assert opt.updates == applied
    assert sched.last_epoch == applied * steps, (sched.last_epoch, applied, steps)
