"""stage12_overflow: where the norm is let decide overflow, and that only step()'s own check defers.

Single process, on fake ZeRO-1/2 optimizers (fake_zero.py). The decisions
themselves, against DeepSpeed's flag and plain PyTorch on 2 ranks, are
tests/multi_gpu/test_zero12_overflow.py.
"""
import os
from unittest import mock

import pytest
import torch
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from deepspeed_multi import compat
from deepspeed_multi.zero.stage12 import overflow as zero12_overflow
from fake_zero import fake


def _fake(**overrides):
    attrs = dict(cpu_offload=False, has_moe_layers=False, model_parallel_group=None, compute_grad_norm=True,
                 check_grad_overflow=True, groups_lacking_loss_scale=set(),
                 bit16_groups=[[torch.nn.Parameter(torch.zeros(3))]])
    return fake(DeepSpeedZeroOptimizer, **{**attrs, **overrides})


def _install(opt):
    with mock.patch.dict(os.environ, {zero12_overflow.ENV: "1"}):
        return zero12_overflow.install(opt)


def _flagging(opt, calls):
    """DeepSpeed's flag, as if some rank had an inf: records each time the flag's collective would run."""

    def has_overflow(partition_gradients=True):
        calls.append(partition_gradients)
        return True

    opt.has_overflow = has_overflow  # read through self by DeepSpeed's _check_overflow


def _run_step(opt):
    """step() as DeepSpeed runs it, reduced to its overflow check; returns the overflow it saw."""
    seen = []

    def step(*args, **kwargs):
        opt.overflow = False
        opt.check_overflow(partition_gradients=True)
        seen.append(opt.overflow)

    compat.set_original(opt, "step", step)
    opt.step()
    return seen[0]


def test_step_defers_to_the_norm_and_other_callers_get_deepspeeds_flag():
    opt = _fake()
    assert _install(opt)
    calls = []
    _flagging(opt, calls)
    assert _run_step(opt) is False and calls == []  # the norm, computed next in step(), decides
    assert compat.state(opt, zero12_overflow.FEATURE)["deferred"] == 1
    opt.check_overflow()  # outside step(): DeepSpeed's check, with its collective
    assert opt.overflow is True and calls == [True]
    assert not compat.state(opt, zero12_overflow.FEATURE)["in_step"]


@pytest.mark.parametrize("attr,value", [("compute_grad_norm", False), ("check_grad_overflow", False),
                                        ("groups_lacking_loss_scale", {0})])
def test_flag_decides_where_the_norm_does_not_settle_it(attr, value):
    opt = _fake()
    assert _install(opt)
    setattr(opt, attr, value)  # read at every call, not only at install
    calls = []
    _flagging(opt, calls)
    assert _run_step(opt) is True and calls == [True]
    assert compat.state(opt, zero12_overflow.FEATURE)["deferred"] == 0


def test_step_leaves_in_step_cleared_when_it_raises():
    opt = _fake()
    assert _install(opt)

    def step(*args, **kwargs):
        raise RuntimeError("boom")

    compat.set_original(opt, "step", step)
    with pytest.raises(RuntimeError, match="boom"):
        opt.step()
    assert not compat.state(opt, zero12_overflow.FEATURE)["in_step"]


class _OwnFlag(DeepSpeedZeroOptimizer):

    def has_overflow(self, partition_gradients=True):
        return False


class _OwnNorm(DeepSpeedZeroOptimizer):

    def get_grad_norm_direct(self, gradients, params, norm_type=2):
        return torch.tensor(0.0)


def _pipe_replicated():
    p = torch.nn.Parameter(torch.zeros(2))
    p.ds_pipe_replicated = True
    return [[p]]


@pytest.mark.parametrize("case", ["cpu_offload", "moe", "model_parallel", "pipe_replicated", "own_flag", "own_norm",
                                  "env_off"])
def test_not_installed_where_the_containment_is_not_known_to_hold(case):
    overrides = {"cpu_offload": {"cpu_offload": True}, "moe": {"has_moe_layers": True},
                 "pipe_replicated": {"bit16_groups": _pipe_replicated()}}.get(case, {})
    opt = _fake(**overrides)
    if case in ("own_flag", "own_norm"):
        opt.__class__ = _OwnFlag if case == "own_flag" else _OwnNorm
    if case == "model_parallel":
        with mock.patch("deepspeed.comm.pg_utils.is_parallel", return_value=True):
            assert not _install(opt)
    elif case == "env_off":
        with mock.patch.dict(os.environ, {zero12_overflow.ENV: "0"}):
            assert not zero12_overflow.install(opt)
    else:
        assert not _install(opt)
    assert not compat.installed(opt, zero12_overflow.FEATURE)
    assert "step" not in vars(opt) and "check_overflow" not in vars(opt)


def test_installed_once():
    opt = _fake()
    assert _install(opt)
    assert not _install(opt)
