"""ZeRO-1/2, bf16/fp16: the gradient norm's all-reduce also decides overflow (zero12_overflow.py).

Per config, two engines train on the same global batch: one where the norm decides (the default)
and one with DeepSpeed's two collectives, the overflow flag's and the norm's
(``DSM_ZERO12_OVERFLOW_BY_NORM=0`` at construction), beside plain PyTorch (AdamW, clipping as
``clip_grad_norm_``) that applies exactly the updates whose window saw no non-finite value.
Non-finite inputs (inf, nan, -inf) are fed at set micro-steps, on one rank or on both, in the
first or the last micro-step of a window. After every update the two engines must be
bit-identical and agree on the skipped updates, the loss scale and the global gradient norm; the
skipped updates must be exactly the fed ones; the whole run's update must match plain PyTorch's
(cosine > 0.99, norm within 5%). The engine where the norm decides must not have run the flag's
collective (``has_overflow``) at any update, the other at every one; where the norm is off
(``compute_grad_norm`` false) nothing is deferred and the flag decides, as in DeepSpeed.
"""
import copy
import os
from unittest import mock

import pytest
import torch

import deepspeed.comm as dist
import deepspeed_multi
from deepspeed_multi import compat
from common import MLP, ds_config, full_params
from harness import run_distributed

# name: (stage, dtype, gradient_clipping, gas, extra zero_optimization, two param groups)
CONFIGS = {
    "z1-bf16": (1, "bf16", 0.0, 1, {}, False),
    "z2-bf16-clip-gas2": (2, "bf16", 0.05, 2, {}, False),
    "z1-fp16-clip-groups": (1, "fp16", 0.05, 1, {}, True),
    "z2-fp16-overlap-gas2": (2, "fp16", 0.0, 2, {"overlap_comm": True}, False),
    "z1-bf16-nonorm": (1, "bf16", 0.0, 1, {"compute_grad_norm": False}, False),
}
UPDATES = 6
# update -> (micro-step within its window: "first" or "last", ranks fed, value)
FED = {1: ("first", (0, ), float("inf")), 3: ("last", (1, ), float("nan")), 4: ("first", (0, 1), float("-inf"))}


def _fed(update, micro, gas, rank):
    if update not in FED:
        return None
    where, ranks, value = FED[update]
    if rank in ranks and micro == (0 if where == "first" else gas - 1):
        return value
    return None


def _batch(update, micro, rank, gas, feed=True):
    g = torch.Generator().manual_seed(100 * update + 10 * micro + rank)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    value = _fed(update, micro, gas, rank) if feed else None
    if value is not None:
        x[0, 0] = value
    return x, y


def _optimizer(model, groups):
    if not groups:
        return torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    return torch.optim.AdamW([{"params": [model.fc1.weight, model.fc1.bias]},
                              {"params": [model.fc2.weight, model.fc2.bias], "lr": 0.01, "weight_decay": 0.0}],
                             lr=0.02)


def _engine(cfg, by_norm, groups):
    model = MLP(d_in=8, d_hidden=32, seed=5)
    with mock.patch.dict(os.environ, {"DSM_ZERO12_OVERFLOW_BY_NORM": "1" if by_norm else "0"}):
        engine, *_ = deepspeed_multi.initialize(model=model, optimizer=_optimizer(model, groups),
                                                config=copy.deepcopy(cfg))
    assert compat.installed(engine.optimizer, "stage12_overflow") == by_norm
    flags = []
    original = engine.optimizer.has_overflow

    def counting(*args, **kwargs):
        flags.append(True)
        return original(*args, **kwargs)

    engine.optimizer.has_overflow = counting  # the flag's collective runs inside has_overflow
    return engine, flags


def _norm(engine):
    norm = engine.optimizer._global_grad_norm
    return None if norm is None else float(norm)


def _check(name):
    stage, dtype, clip, gas, zero_extra, groups = CONFIGS[name]
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = ds_config(stage, dtype, gas=gas, gradient_clipping=clip, zero_optimization=zero_extra)
    engines = {"norm": _engine(cfg, True, groups), "flag": _engine(cfg, False, groups)}
    ref = MLP(d_in=8, d_hidden=32, seed=5)
    initial = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ref_opt = _optimizer(ref, groups)
    skipped_before = 0
    for update in range(UPDATES):
        for micro in range(gas):
            for engine, _ in engines.values():
                x, y = _batch(update, micro, rank, gas)
                ((engine(x) - y)**2).mean().backward()
                engine.step()
            if update not in FED:
                for r in range(world):  # the reference sees every rank's micro-batch
                    x, y = _batch(update, micro, r, gas, feed=False)
                    (((ref(x) - y)**2).mean() / (world * gas)).backward()
        if update not in FED:
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
        (by_norm, _), (by_flag, _) = engines["norm"], engines["flag"]
        got, want = full_params(by_norm), full_params(by_flag)
        for n in got:
            assert torch.equal(got[n], want[n]), (
                f"{name}: {n} differs between the norm deciding overflow and DeepSpeed's flag after update {update}: "
                f"max {(got[n] - want[n]).abs().max().item():.3e}")
        assert by_norm.skipped_steps == by_flag.skipped_steps, (
            f"{name} update {update}: skipped {by_norm.skipped_steps} (norm decides) vs {by_flag.skipped_steps}")
        assert by_norm.skipped_steps - skipped_before == (update in FED), (
            f"{name} update {update}: {'should' if update in FED else 'should not'} have been skipped "
            f"(skipped so far: {by_norm.skipped_steps})")
        skipped_before = by_norm.skipped_steps
        assert by_norm.optimizer.loss_scale == by_flag.optimizer.loss_scale, f"{name} update {update}: loss scale"
        assert _norm(by_norm) == _norm(by_flag), (
            f"{name} update {update}: global grad norm {_norm(by_norm)} (norm decides) vs {_norm(by_flag)}")

    deferred = compat.state(engines["norm"][0].optimizer, "stage12_overflow")["deferred"]
    flags_norm, flags_flag = engines["norm"][1], engines["flag"][1]
    if zero_extra.get("compute_grad_norm", True):
        assert deferred == UPDATES and not flags_norm, (
            f"{name}: the norm should have decided every update ({deferred} of {UPDATES}, flag collectives "
            f"{len(flags_norm)})")
    else:
        assert deferred == 0 and len(flags_norm) == UPDATES, (
            f"{name}: without the norm the flag must decide ({deferred} deferred, {len(flags_norm)} flag collectives)")
    assert len(flags_flag) == UPDATES, f"{name}: DeepSpeed's flag should have run at every update ({len(flags_flag)})"

    # The whole run's update against plain PyTorch, measured from the engine's rounded start.
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    got = full_params(engines["norm"][0])
    du = torch.cat([(got[n] - initial[n].to(low).float()).flatten() for n in initial])
    dr = torch.cat([(p.detach() - initial[n]).flatten() for n, p in ref.named_parameters()])
    cos = torch.nn.functional.cosine_similarity(du, dr, dim=0).item()
    ratio = (du.norm() / dr.norm()).item()
    assert cos > 0.99 and abs(ratio - 1) < 0.05, (
        f"{name}: update cosine {cos:.4f} (want > 0.99), norm ratio {ratio:.4f} (want 1 +- 0.05) vs plain PyTorch")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_norm_decides_overflow_as_deepspeeds_flag(name):
    run_distributed(_check, name, timeout_s=120)
