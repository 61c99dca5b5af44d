"""ZeRO-1/2's update reads this rank's gradient partition as a view (zero/stage12/grad_view.py).

Per config, three models train on the same global batch: a ZeRO-1/2 engine with the view, one
with DeepSpeed's flatten (DSM_ZERO12_GRAD_VIEW=0 at construction), and plain PyTorch (AdamW,
gradient clipping by the global norm as ``clip_grad_norm_``). The two engines must be
bit-identical after every update, fp32 engines within 1e-5 of PyTorch, and each rank must have
taken the view, or fallen back, where the config says. The configs reach what the view changes:
the in-place unscale and clip (clipping that binds, fp16 loss scaling), gradient accumulation,
ZeRO-2's reduction in backward order over many small buckets (with and without overlap_comm),
two parameter groups, and the fallbacks: the last rank's zero padding (odd parameter count), a
parameter without a gradient, and DeepSpeed's own flat fp32 accumulation buffer. The overflow check
before each update reads the same view (``partition_has_overflow``): the engine with DeepSpeed's
flatten keeps DeepSpeed's per-tensor check, and in the fp16/bf16 configs where rank 0 alone
overflows both must skip the same updates. That check runs only where the gradient norm is off
(``compute_grad_norm`` false): with it on, the norm decides overflow (zero12_overflow.py, tested
in test_zero12_overflow.py).
"""
import copy
import os
from unittest import mock

import pytest
import torch

import deepspeed.comm as dist
import deepspeed_multi
from deepspeed_multi import compat
from common import FP32_TOL, MLP, ds_config, full_params, record_found
from harness import run_distributed

# name: (stage, dtype, gradient_clipping, gas, model kwargs, extra zero_optimization, options)
# options: "groups" (two optimizer param groups), "unused" (fc2.bias gets no gradient),
#          "fp32acc" (grad_accum_dtype fp32), "padded" (odd parameter count),
#          "overflow" (rank 0 alone feeds an inf at OVERFLOW_STEPS).
CONFIGS = {
    "z1-fp32-clip-gas2": (1, "fp32", 0.05, 2, {}, {}, ()),
    "z2-fp32-clip-gas2": (2, "fp32", 0.05, 2, {}, {}, ()),
    "z2-fp32-overlap-groups": (2, "fp32", 0.0, 1, {}, {"overlap_comm": True}, ("groups", )),
    "z1-fp32-groups-clip": (1, "fp32", 0.05, 1, {}, {}, ("groups", )),
    "z2-fp16-clip": (2, "fp16", 0.05, 2, {}, {}, ()),
    "z1-bf16": (1, "bf16", 0.0, 1, {}, {}, ()),
    "z2-bf16-clip": (2, "bf16", 0.05, 1, {}, {}, ()),
    "z2-fp32-padded": (2, "fp32", 0.05, 1, {"d_out": 7}, {}, ("padded", )),
    "z1-fp32-unused": (1, "fp32", 0.0, 1, {}, {}, ("unused", )),
    "z2-bf16-fp32acc": (2, "bf16", 0.0, 2, {}, {}, ("fp32acc", )),
    "z1-fp16-overflow": (1, "fp16", 0.05, 1, {}, {}, ("overflow", )),
    # Without the norm (compute_grad_norm false, ZeRO-1/2 only), which decides overflow where it
    # is on (zero12_overflow.py), the overflow check on the view decides.
    "z2-fp16-overflow-gas2-nonorm": (2, "fp16", 0.0, 2, {}, {"compute_grad_norm": False}, ("overflow", )),
    "z1-bf16-overflow-nonorm": (1, "bf16", 0.0, 1, {}, {"compute_grad_norm": False}, ("overflow", )),
}
UPDATES = 3
OVERFLOW_STEPS = (1, )


class _Net(MLP):

    def __init__(self, unused=False, **kwargs):
        super().__init__(d_in=8, d_hidden=32, seed=3, **kwargs)
        self.unused = unused

    def forward(self, x):
        if not self.unused:
            return super().forward(x)
        x = x.to(self.fc1.weight.dtype)
        return torch.nn.functional.linear(torch.tanh(self.fc1(x)), self.fc2.weight).float()  # no fc2.bias


def _batch(step, rank, d_out, overflow=False):
    g = torch.Generator().manual_seed(7 * step + rank)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, d_out, generator=g)
    if overflow and rank == 0 and step in OVERFLOW_STEPS:
        x[0, 0] = float("inf")  # non-finite gradients on this rank only
    return x, y


def _optimizer(model, groups, unused=False):
    if not groups:
        # A parameter without a gradient is skipped by PyTorch's AdamW but sits in DeepSpeed's flat
        # partition, where a zero gradient still decays it: compare that case without weight decay.
        return torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.0 if unused else 0.01)
    return torch.optim.AdamW([{"params": [model.fc1.weight, model.fc1.bias]},
                              {"params": [model.fc2.weight, model.fc2.bias], "lr": 0.01, "weight_decay": 0.0}],
                             lr=0.02)


def _engine(model, cfg, view, groups, unused):
    with mock.patch.dict(os.environ, {"DSM_ZERO12_GRAD_VIEW": "1" if view else "0"}):
        engine, *_ = deepspeed_multi.initialize(model=model, optimizer=_optimizer(model, groups, unused),
                                                config=copy.deepcopy(cfg))
    assert compat.installed(engine.optimizer, "stage12_grad_view") == view
    return engine


def _expected(options, rank, world):
    """What each update's groups must do on this rank: True view, False flatten, None DeepSpeed's own."""
    if "fp32acc" in options:
        return None
    if "unused" in options:
        return False if rank == world - 1 else True  # fc2.bias is in the last rank's partition
    if "padded" in options:
        return False if rank == world - 1 else True
    return True


def _check(name):
    from deepspeed_multi.zero.stage12 import grad_view as zero12_step
    stage, dtype, clip, gas, model_kwargs, zero_extra, options = CONFIGS[name]
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = ds_config(stage, dtype, gas=gas, gradient_clipping=clip, zero_optimization=zero_extra)
    if "fp32acc" in options:
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    groups, unused = "groups" in options, "unused" in options
    make = lambda: _Net(unused=unused, **model_kwargs)  # noqa: E731
    engines = {"view": _engine(make(), cfg, True, groups, unused), "copy": _engine(make(), cfg, False, groups, unused)}
    ref = make()
    ref_opt = _optimizer(ref, groups, unused)
    d_out = model_kwargs.get("d_out", 8)
    overflow = "overflow" in options

    with record_found(zero12_step, "run_view") as taken, record_found(zero12_step, "partition_views") as checked:
        for step in range(UPDATES * gas):
            for engine in engines.values():
                x, y = (t.to(engine.device) for t in _batch(step, rank, d_out, overflow))
                ((engine(x) - y)**2).mean().backward()
                engine.step()
            for r in range(world):  # the reference sees every rank's micro-batch: DP averages over ranks
                x, y = _batch(step, r, d_out)
                (((ref(x) - y)**2).mean() / (world * gas)).backward()
            if (step + 1) % gas == 0:
                if clip > 0:
                    torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
                ref_opt.step()
                ref_opt.zero_grad(set_to_none=True)
                got = {k: full_params(e) for k, e in engines.items()}
                for n in got["view"]:
                    assert torch.equal(got["view"][n], got["copy"][n]), (
                        f"{name}: {n} differs between the view and DeepSpeed's flatten after update "
                        f"{(step + 1) // gas}: max {(got['view'][n] - got['copy'][n]).abs().max().item():.3e}")
                if dtype == "fp32":
                    err = max((got["view"][n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
                    assert err <= FP32_TOL, f"{name}: max abs error {err:.3e} vs plain PyTorch"
    expected = _expected(options, rank, world)
    per_update = 2 if groups else 1
    skipped = [e.skipped_steps for e in engines.values()]
    assert skipped[0] == skipped[1] and (skipped[0] > 0) == overflow, f"{name}: skipped updates {skipped}"
    applied = UPDATES - skipped[0]  # an overflowed update reads no gradient partition
    if expected is None:
        assert not taken, f"{name}: DeepSpeed's own flat fp32 buffer should have been used ({taken})"
    else:
        assert taken == [expected] * (applied * per_update), (
            f"{name} rank {rank}: expected {'the view' if expected else 'the flatten'} at every update, got {taken}")
        # DeepSpeed checks for overflow before every 16-bit update (bf16's check_grad_overflow, fp16), not at fp32;
        # with the norm on, the norm decides instead and no flag is computed (zero12_overflow.py).
        flag_decides = dtype != "fp32" and zero_extra.get("compute_grad_norm") is False
        want = [expected] * UPDATES if flag_decides else []
        assert checked == want, (
            f"{name} rank {rank}: expected the overflow check {'on the view' if expected else 'per tensor'} at "
            f"every 16-bit update, got {checked}")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_zero12_update_reads_gradient_partition(name):
    run_distributed(_check, name, timeout_s=120)
