"""ZeRO-3's update reads its fp32 gradient as a view of the partition buffer (zero/stage3/grad_view.py).

Per config, three models train on the same global batch: a ZeRO-3 engine with the view, one
with DeepSpeed's flattened copy (DSM_ZERO3_GRAD_VIEW=0 at construction), and plain PyTorch
(AdamW, gradient clipping by the global norm as ``clip_grad_norm_``). The two engines must be
bit-identical after every update, fp32 engines within 1e-5 of PyTorch, and the view must have
been taken. The configs reach what the view changes: the in-place unscale and clip (clipping
that binds, fp16 loss scaling), several optimizer sub-groups, gradient accumulation, and a
frozen parameter inside the engine. With a 16-bit gradient buffer the update needs DeepSpeed's
converting copy, and the last config checks that it keeps it.
"""
import copy
import os
from unittest import mock

import pytest
import torch

import deepspeed.comm as dist
import deepspeed_multi
from deepspeed_multi import compat
from deepspeed_multi.zero.stage3.lazy_grads import grad_buffers
from common import FP32_TOL, MLP, ds_config, full_params, record_found
from harness import run_distributed

CONFIGS = {
    # name: (dtype, gradient_clipping, gas, sub_group_size, frozen fc1.bias, fp32 gradient accumulation)
    "fp32-clip-gas2": ("fp32", 0.05, 2, 1_000_000_000, False, False),
    "fp32-subgroups": ("fp32", 0.0, 1, 64, False, False),
    "fp32-frozen-clip": ("fp32", 0.05, 1, 64, True, False),
    "fp16-fp32acc-clip": ("fp16", 0.05, 2, 64, False, True),
    "bf16-fp32acc": ("bf16", 0.0, 2, 1_000_000_000, False, True),
    # 16-bit gradient buffer: the master needs fp32, so DeepSpeed's converting copy stays.
    "bf16": ("bf16", 0.05, 1, 64, False, False),
}
UPDATES = 3


def _batch(step, rank):
    g = torch.Generator().manual_seed(7 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)


def _model(frozen):
    model = MLP(d_in=8, d_hidden=32, d_out=8, seed=3)
    if frozen:
        model.fc1.bias.requires_grad_(False)
    return model


def _engine(model, cfg, view):
    with mock.patch.dict(os.environ, {"DSM_ZERO3_GRAD_VIEW": "1" if view else "0"}):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.02)
        engine, *_ = deepspeed_multi.initialize(model=model, optimizer=opt, config=copy.deepcopy(cfg))
    assert compat.installed(engine.optimizer, "stage3_grad_view") == view
    return engine


def _check(name):
    from deepspeed_multi.zero.stage3 import grad_view as zero3_step
    dtype, clip, gas, sub_group_size, frozen, fp32_accum = CONFIGS[name]
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = ds_config(3, dtype, gas=gas, gradient_clipping=clip, zero_optimization={"sub_group_size": sub_group_size})
    if fp32_accum:
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    engines = {"view": _engine(_model(frozen), cfg, True), "copy": _engine(_model(frozen), cfg, False)}
    ref = _model(frozen)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=0.02)

    with record_found(zero3_step, "one_view") as taken:
        for step in range(UPDATES * gas):
            for engine in engines.values():
                x, y = (t.to(engine.device) for t in _batch(step, rank))
                ((engine(x) - y)**2).mean().backward()
                engine.step()
            for r in range(world):  # the reference sees every rank's micro-batch: DP averages over ranks
                x, y = _batch(step, r)
                (((ref(x) - y)**2).mean() / (world * gas)).backward()
            if (step + 1) % gas == 0:
                if clip > 0:
                    torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
                ref_opt.step()
                ref_opt.zero_grad(set_to_none=True)
                got = {k: full_params(e) for k, e in engines.items()}
                for n in got["view"]:
                    assert torch.equal(got["view"][n], got["copy"][n]), (
                        f"{name}: {n} differs between the view and DeepSpeed's copy after update "
                        f"{(step + 1) // gas}: max {(got['view'][n] - got['copy'][n]).abs().max().item():.3e}")
                if dtype == "fp32":
                    err = max((got["view"][n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
                    assert err <= FP32_TOL, f"{name}: max abs error {err:.3e} vs plain PyTorch"
                # The view's in-place unscale/clip landed in the buffer; the next window starts from zeros.
                assert not any(b.any() for b in grad_buffers(engines["view"].optimizer))
    if dtype == "fp32" or fp32_accum:
        assert taken and all(taken), f"{name}: the update fell back to DeepSpeed's copy ({taken})"
    else:
        assert taken and not any(taken), f"{name}: a view of a 16-bit buffer was handed to the fp32 master"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_zero3_update_reads_gradient_buffer(name):
    run_distributed(_check, name, timeout_s=120)
