"""zero3_step: when the update may take a view of ZeRO-3's gradient buffer, and where it installs.

Single process: ``one_view`` on generated layouts (sizes around zero, gaps, reorders, dtypes),
and ``install`` on fake optimizers (fake_zero.py). The update itself, against
DeepSpeed's copy and plain PyTorch on 2 ranks, is tests/multi_gpu/test_zero3_step.py.
"""
import types

import pytest
import torch
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from hypothesis import given, settings
from hypothesis import strategies as st

from deepspeed_multi import compat
from deepspeed_multi.zero.stage3 import grad_view as zero3_step
from deepspeed_multi.zero.stage3.grad_view import one_view
from fake_zero import fake


def _views(buffer, sizes, gaps):
    out, offset = [], 0
    for size, gap in zip(sizes, gaps):
        offset += gap
        out.append(buffer.narrow(0, offset, size))
        offset += size
    return out


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 9), min_size=1, max_size=8), data=st.data())
def test_one_view_is_the_run_or_nothing(sizes, data):
    gaps = data.draw(st.lists(st.sampled_from([0, 0, 0, 1, 3]), min_size=len(sizes), max_size=len(sizes)))
    start = data.draw(st.integers(0, 4))
    buffer = torch.arange(sum(sizes) + sum(gaps) + start + 2, dtype=torch.float32)
    grads = _views(buffer.narrow(0, start, buffer.numel() - start), sizes, gaps)
    order = data.draw(st.permutations(range(len(grads))))
    grads = [grads[i] for i in order]
    total = sum(sizes)
    master = torch.zeros(total)
    view = one_view(grads, master)
    # The copy DeepSpeed would make: the oracle for what the view must hold.
    want = torch.cat([g.reshape(-1) for g in grads]) if grads else torch.zeros(0)
    nonempty = [g for g in grads if g.numel()]
    contiguous = all(b.data_ptr() == a.data_ptr() + a.numel() * 4 for a, b in zip(nonempty, nonempty[1:]))
    if contiguous and total > 0:
        assert view is not None and torch.equal(view, want)
        assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()  # a view, not a copy
    else:
        assert view is None


def test_one_view_refuses_other_dtype_device_or_size():
    buffer = torch.arange(12, dtype=torch.float32)
    grads = [buffer.narrow(0, 0, 5), buffer.narrow(0, 5, 7)]
    assert one_view(grads, torch.zeros(12)) is not None
    assert one_view(grads, torch.zeros(12, dtype=torch.float64)) is None  # the master needs a converted copy
    assert one_view(grads, torch.zeros(13)) is None  # not the master's partition
    assert one_view([], torch.zeros(0)) is None
    half = buffer.to(torch.bfloat16)
    assert one_view([half.narrow(0, 0, 5), half.narrow(0, 5, 7)], torch.zeros(12)) is None
    assert one_view([grads[0], torch.zeros(7)], torch.zeros(12)) is None  # a frozen parameter's zeros_like


def _fake(offload=False, cls=DeepSpeedZeroOptimizer_Stage3):
    return fake(cls, offload_optimizer=offload, fp32_partitioned_groups_flat=[])


def test_install_where_it_applies(monkeypatch):
    monkeypatch.delenv(zero3_step.ENV, raising=False)
    opt = _fake()
    assert zero3_step.install(opt)
    assert not zero3_step.install(opt)  # once
    assert isinstance(opt._prepare_fp32_grad_for_sub_group, types.MethodType)
    assert not zero3_step.install(_fake(offload=True))  # the offload path keeps its own gradient copy
    assert not zero3_step.install(object())
    monkeypatch.setenv(zero3_step.ENV, "0")
    assert not zero3_step.install(_fake())

    class Sub(DeepSpeedZeroOptimizer_Stage3):

        def _prepare_fp32_grad_for_sub_group(self, sub_group_id):  # a subclass's own method is left alone
            pass

    monkeypatch.delenv(zero3_step.ENV)
    sub = _fake(cls=Sub)
    assert not zero3_step.install(sub)


def test_update_gets_the_view_or_deepspeeds_copy(monkeypatch):
    monkeypatch.delenv(zero3_step.ENV, raising=False)
    opt = _fake()
    calls = []
    opt._prepare_fp32_grad_for_sub_group = lambda i: calls.append(i)  # stands in for DeepSpeed's method
    assert zero3_step.install(opt) is False  # an instance attribute is an override: left alone
    del opt._prepare_fp32_grad_for_sub_group
    assert zero3_step.install(opt)
    compat.set_original(opt, "_prepare_fp32_grad_for_sub_group", lambda i: calls.append(i))
    buffer = torch.arange(10, dtype=torch.float32)
    opt.fp32_partitioned_groups_flat = [torch.zeros(6), torch.zeros(4)]
    opt.averaged_gradients = {0: [buffer.narrow(0, 0, 2), buffer.narrow(0, 2, 4)], 1: [buffer.narrow(0, 6, 4)]}
    opt._prepare_fp32_grad_for_sub_group(1)
    assert opt.fp32_partitioned_groups_flat[1].grad.data_ptr() == buffer.narrow(0, 6, 4).data_ptr()
    assert opt.averaged_gradients[1] is None and calls == []
    opt.averaged_gradients[0] = [buffer.narrow(0, 2, 4), buffer.narrow(0, 0, 2)]  # out of order: copy
    opt._prepare_fp32_grad_for_sub_group(0)
    assert calls == [0] and opt.fp32_partitioned_groups_flat[0].grad is None
