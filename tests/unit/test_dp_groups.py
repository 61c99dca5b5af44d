"""dp_groups.check_dp_groups on fake engines: one backward through trainable engines on different
data-parallel groups is refused before any engine's backward starts, unless all opted in; the
check costs nothing while every engine is on one group and scans once per backward pass."""
import gc
import weakref

import pytest
import torch

from deepspeed_multi.reliability import dp_groups
from deepspeed_multi.autograd.boundary import wrap_inputs, wrap_outputs
from deepspeed_multi.config import MultiOptions
from deepspeed_multi.engine import _ForwardRecord


class Engine:
    trains = True

    def __init__(self, name, dp_ranks, allow=False, autotp=None):
        self.name, self.prologues, self.autotp = name, 0, autotp
        self.weight = torch.nn.Parameter(torch.tensor([1.5, -2.0, 0.5]))
        self._trainable_params = [self.weight]
        self.options = MultiOptions(allow_mixed_dp_groups=allow)
        self.seq_data_parallel_group = dp_ranks  # read through the patched _dp_group_ranks

    def _engine_name(self):
        return self.name

    def grad_scale_factor(self):
        return 1.0

    def _pre_backward(self):
        self.prologues += 1

    def _before_output_backward(self, record, create_graph):
        pass

    def __call__(self, x):
        (x, ), _ = wrap_inputs(self, (x, ), {})
        return wrap_outputs(self, torch.tanh(x * self.weight), _ForwardRecord())


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    monkeypatch.setattr(dp_groups._DpGroups, "engines", weakref.WeakValueDictionary())
    monkeypatch.setattr(dp_groups._DpGroups, "mixed", False)
    monkeypatch.setattr(dp_groups._DpGroups, "checked_task", None)
    monkeypatch.setattr(dp_groups._DpGroups, "verified", set())
    monkeypatch.setattr(dp_groups, "_dp_group_ranks", lambda e: tuple(e.seq_data_parallel_group))
    monkeypatch.setattr(dp_groups, "_autotp_block", lambda e: e.autotp)  # (DeepSpeed's AutoTP block size)
    scans = []
    real = dp_groups.graph.any_param_in_current_graph
    monkeypatch.setattr(dp_groups.graph, "any_param_in_current_graph", lambda params: scans.append(1) or real(params))
    return scans


def _engines(*specs):
    engines = [Engine(*spec) for spec in specs]
    for e in engines:
        dp_groups.register_dp_group(e)
    return engines


def test_refused_before_any_engine_starts():
    a, b = _engines(("Enc", (0, 1)), ("Dec", (0, )))
    with pytest.raises(RuntimeError) as info:
        b(a(torch.randn(3))).sum().backward()
    msg = str(info.value)
    assert ("MultiEngine (Enc) averages its gradients over ranks [0, 1], MultiEngine (Dec) over ranks [0]" in msg
            and "the same mpu" in msg and "not set on: Enc, Dec" in msg), msg
    assert a.prologues == b.prologues == 0 and a.weight.grad is None and b.weight.grad is None


def test_all_opted_in_is_not_checked(fresh_registry):
    a, b = _engines(("Enc", (0, 1), True), ("Dec", (0, ), True))
    b(a(torch.randn(3))).sum().backward()
    assert not dp_groups._DpGroups.mixed and fresh_registry == [] and a.prologues == b.prologues == 1


def test_one_opted_out_is_refused_naming_it():
    a, b = _engines(("Enc", (0, 1), True), ("Dec", (0, )))
    with pytest.raises(RuntimeError, match=r"not set on: Dec\)"):
        b(a(torch.randn(3))).sum().backward()


def test_one_group_costs_nothing(fresh_registry):
    a, b = _engines(("Enc", (0, 1)), ("Dec", (0, 1)))
    b(a(torch.randn(3))).sum().backward()
    assert not dp_groups._DpGroups.mixed and fresh_registry == [] and a.prologues == b.prologues == 1


def test_a_loss_per_group_is_fine_and_scanned_once_per_pass(fresh_registry):
    a, b = _engines(("Enc", (0, 1)), ("Dec", (0, )))
    x = torch.randn(3, requires_grad=True)
    (a(x).sum() + a(x).sum()).backward()  # two forwards of Enc: two boundary crossings in one pass
    assert len(fresh_registry) == 2, fresh_registry  # one scan per pass: Enc's and Dec's parameters, once
    b(x).sum().backward()
    assert len(fresh_registry) == 4 and b.prologues == 1
    del b  # the engines left are on one group again: nothing is scanned
    gc.collect()
    a(x).sum().backward()
    assert len(fresh_registry) == 4 and not dp_groups._DpGroups.mixed


# [Note: AutoTP engines beside engines without tensor parallelism], on 4 ranks with autotp_size 2:
# blocks {0, 1} and {2, 3}; the AutoTP engine's data-parallel group on rank 0 is (0, 2).
def test_autotp_beside_the_world_needs_no_opt_in_and_costs_nothing(fresh_registry):
    a, t = _engines(("Enc", (0, 1, 2, 3)), ("Llama", (0, 2), False, 2))
    t(a(torch.randn(3))).sum().backward()
    assert not dp_groups._DpGroups.mixed and fresh_registry == [] and a.prologues == t.prologues == 1


def test_autotp_beside_an_engine_on_part_of_its_blocks_is_refused():
    """(0, 1) is block 0 twice and block 1 never: it averages other data than the AutoTP engine."""
    a, t = _engines(("Enc", (0, 1)), ("Llama", (0, 2), False, 2))
    with pytest.raises(RuntimeError, match=r"MultiEngine \(Enc\) averages its gradients over ranks \[0, 1\], "
                       r"MultiEngine \(Llama\) over ranks \[0, 2\]"):
        t(a(torch.randn(3))).sum().backward()
    assert a.prologues == t.prologues == 0


def test_engines_without_tp_on_different_groups_are_refused_beside_autotp(fresh_registry):
    """The replication comes from the AutoTP engine being in the loss: two engines without tensor
    parallelism on different groups (a user mpu) are refused when the backward skips it, allowed with it."""
    a, c, t = _engines(("Enc", (0, 1, 2, 3)), ("Head", (0, 2)), ("Llama", (0, 2), False, 2))
    assert dp_groups._DpGroups.mixed
    x = torch.randn(3)
    with pytest.raises(RuntimeError, match=r"MultiEngine \(Enc\) averages .* MultiEngine \(Head\) over ranks \[0, 2\]"):
        c(a(x)).sum().backward()
    c(t(a(x))).sum().backward()
    assert a.prologues == c.prologues == t.prologues == 1


def test_autotp_not_on_deepspeeds_groups_is_compared_by_ranks():
    a, t = _engines(("Enc", (0, 1, 2, 3)), ("Llama", (0, 2)))  # no block: a user mpu, say
    with pytest.raises(RuntimeError, match="different data-parallel groups"):
        t(a(torch.randn(3))).sum().backward()
