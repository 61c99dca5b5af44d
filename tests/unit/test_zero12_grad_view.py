"""zero12_step: the partition's gradients land in parameter order, and where it installs.

Single process, on fake ZeRO-1/2 optimizers (fake_zero.py) that run DeepSpeed's own
``copy_grads_in_partition`` underneath ours: whatever the order in which reductions finish, the
buffer ends up in ``params_in_partition`` order, so the partition's list is one run and the view
holds what DeepSpeed's flatten would. The update itself, against the flatten and plain PyTorch on
2 ranks, is tests/multi_gpu/test_zero12_step.py.
"""
import os
import types
from unittest import mock

import torch
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from hypothesis import given, settings
from hypothesis import strategies as st

from deepspeed_multi.zero.stage12 import grad_view as zero12_step
from deepspeed_multi.zero.runs import run_view
from fake_zero import fake


def _fake(group_sizes, cpu_offload=False, contiguous=True):
    groups = [[torch.nn.Parameter(torch.zeros(n)) for n in sizes] for sizes in group_sizes]
    # dtype fp32: fp32 weights, not DeepSpeed's compact fp32 buffer of 16-bit weights.
    return fake(DeepSpeedZeroOptimizer, cpu_offload=cpu_offload, contiguous_gradients=contiguous, dtype=torch.float32,
                grads_in_partition=None, grads_in_partition_offset=0, bit16_groups=groups, params_in_partition=groups,
                oracle=dict(use_grad_accum_attribute=False, gradient_accumulation_dtype=torch.float32,
                            param_id={id(p): i for i, p in enumerate(p for g in groups for p in g)}))


@settings(max_examples=100, deadline=None)
@given(group_sizes=st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=5), min_size=1, max_size=3),
       data=st.data())
def test_gradients_land_in_partition_order_whatever_the_reduction_order(group_sizes, data):
    opt = _fake(group_sizes)
    with mock.patch.dict(os.environ, {zero12_step.ENV: "1"}):
        assert zero12_step.install(opt)
    params = [p for g in opt.bit16_groups for p in g]
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, float(i + 1))
    for i in data.draw(st.permutations(range(len(params)))):  # the order in which reductions finish
        opt.copy_grads_in_partition(params[i])
    for group in opt.bit16_groups:
        grads = [p.grad for p in group]
        want = torch.cat([g.reshape(-1) for g in grads])
        view = run_view(grads, want.numel())
        if want.numel() == 0:
            assert view is None  # nothing to view; DeepSpeed's flatten of nothing stays
            continue
        assert view is not None and torch.equal(view, want)
        assert view.untyped_storage().data_ptr() == opt.grads_in_partition.untyped_storage().data_ptr()
    assert opt.grads_in_partition.numel() == sum(p.numel() for p in params)  # sized as DeepSpeed sizes it


def test_install_where_it_applies(monkeypatch):
    monkeypatch.delenv(zero12_step.ENV, raising=False)
    opt = _fake([[3, 4]])
    assert zero12_step.install(opt)
    assert not zero12_step.install(opt)  # once
    assert isinstance(opt.copy_grads_in_partition, types.MethodType)
    assert isinstance(opt._get_preflattened_grad_partition, types.MethodType)
    assert not zero12_step.install(_fake([[3]], cpu_offload=True))  # offload keeps its own fp32 buffer
    assert not zero12_step.install(_fake([[3]], contiguous=False))  # no grads_in_partition at all
    assert not zero12_step.install(object())
    monkeypatch.setenv(zero12_step.ENV, "0")
    assert not zero12_step.install(_fake([[3]]))
    monkeypatch.delenv(zero12_step.ENV)

    class Sub(DeepSpeedZeroOptimizer):

        def copy_grads_in_partition(self, param, group_idx=None):  # a subclass's own method is left alone
            pass

    sub = _fake([[3]])
    sub.__class__ = Sub
    assert not zero12_step.install(sub)


def test_update_gets_deepspeeds_flat_partition_first(monkeypatch):
    """DeepSpeed's own flat partition (DeepCompile, the fp32 buffer of 16-bit weights) wins; a list
    that is not one run (a zeros_like for a parameter without gradient) gets None: the flatten."""
    monkeypatch.delenv(zero12_step.ENV, raising=False)
    opt = _fake([[3, 4]])
    opt.partition_size = [7]
    assert zero12_step.install(opt)
    buffer = torch.arange(7.0)

    class Flat(list):
        flat_partition = buffer

    opt.averaged_gradients = {0: Flat([torch.zeros(7)])}
    assert opt._get_preflattened_grad_partition(0).data_ptr() == buffer.data_ptr()
    opt.averaged_gradients = {0: [buffer.narrow(0, 0, 3), buffer.narrow(0, 3, 4)]}
    assert torch.equal(opt._get_preflattened_grad_partition(0), buffer)
    opt.averaged_gradients = {0: [buffer.narrow(0, 0, 3), torch.zeros(4)]}
    assert opt._get_preflattened_grad_partition(0) is None
    opt.averaged_gradients = {0: [buffer.narrow(0, 0, 3), buffer.narrow(0, 3, 3)]}  # short of the partition
    assert opt._get_preflattened_grad_partition(0) is None


_NONFINITE = st.sampled_from([None, float("inf"), float("-inf"), float("nan")])


@settings(max_examples=200, deadline=None)
@given(group_sizes=st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=5), min_size=1, max_size=3),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), separate=st.booleans(),
       data=st.data())
def test_overflow_check_decides_as_deepspeeds_per_tensor_check(group_sizes, dtype, separate, data):
    """The partition's inf/nan test on one view per group gives DeepSpeed's per-tensor answer, for
    any sizes (empty tensors, None entries), dtypes and position of a non-finite value, and falls
    back to DeepSpeed's own where a group's tensors are not one run."""
    opt = _fake(group_sizes)
    with mock.patch.dict(os.environ, {zero12_step.ENV: "1"}):
        assert zero12_step.install(opt)
    assert isinstance(opt.has_overflow_partitioned_grads_serial, types.MethodType)
    opt.averaged_gradients = {}
    for i, sizes in enumerate(group_sizes):
        buffer = torch.randn(sum(sizes)).to(dtype)
        grads, offset = [], 0
        for n in sizes:
            grads.append(torch.randn(n).to(dtype) if separate else buffer.narrow(0, offset, n))
            offset += n
        if data.draw(st.booleans(), label="a None entry"):
            grads.insert(data.draw(st.integers(0, len(grads)), label="at"), None)
        opt.averaged_gradients[i] = grads
    value = data.draw(_NONFINITE, label="non-finite value")
    tensors = [g for grads in opt.averaged_gradients.values() for g in grads if g is not None and g.numel() > 0]
    if value is not None and tensors:
        t = data.draw(st.sampled_from(tensors), label="in tensor")
        t.view(-1)[data.draw(st.integers(0, t.numel() - 1), label="at element")] = value
    want = DeepSpeedZeroOptimizer.has_overflow_partitioned_grads_serial(opt)
    got = opt.has_overflow_partitioned_grads_serial()
    assert got.dtype == want.dtype and got.shape == want.shape and bool(got) == bool(want)
    assert bool(got) == (value is not None and bool(tensors))
    one_run = zero12_step.partition_views(opt) is not None
    several = any(len([g for g in grads if g is not None and g.numel() > 0]) > 1
                  for grads in opt.averaged_gradients.values())
    assert one_run == (not separate or not several)


def test_overflow_check_left_alone_where_overridden(monkeypatch):
    monkeypatch.delenv(zero12_step.ENV, raising=False)

    class Sub(DeepSpeedZeroOptimizer):

        @staticmethod
        def _has_inf_or_nan(x, j=None):  # a subclass's own test is kept, per tensor
            return torch.tensor(False)

    sub = _fake([[3]])
    sub.__class__ = Sub
    assert zero12_step.install(sub)  # the view is installed, the overflow check is not replaced
    assert "has_overflow_partitioned_grads_serial" not in vars(sub)
