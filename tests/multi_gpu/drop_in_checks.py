"""Drop-in: an engine builds wherever upstream's builds and, trained as upstream's is (``engine.backward``,
``engine.step``), gives upstream's bits (rank functions for test_drop_in.py).

Each check builds the same model twice on every rank, through ``deepspeed.initialize`` and through
``deepspeed_multi.initialize``, trains both on the same batches and compares losses, gradient norms
and final weights with ``torch.equal``.
"""
import torch

import deepspeed
import deepspeed.comm as dist

import deepspeed_multi
from common import MLP, default_batch, ds_config


def weights(engine):
    """Name -> the module's full parameters (ZeRO-3 gathered) and, where DeepSpeed keeps them, the fp32
    masters (``master/<name>``): the same function for both sides' engines."""
    from deepspeed.utils import safe_get_full_fp32_param
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        out = {n: p.detach().clone() for n, p in params.items()}
    for n, p in params.items():
        master = safe_get_full_fp32_param(p)
        if master is not None:
            out[f"master/{n}"] = master.detach().clone()
    return out


def train_alone(initialize, config, updates=3, seed=0, width=16):
    """One MLP engine trained with ``engine.backward``/``engine.step`` for ``updates`` windows; returns
    (losses, gradient norms at each update, full weights) and destroys the engine."""
    model = MLP(d_hidden=width, seed=seed)
    engine, *_ = initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), config=config)
    gas = engine.gradient_accumulation_steps()
    losses, norms = [], []
    for step in range(updates * gas):
        batch = default_batch(step, dist.get_rank())
        loss = (engine(batch["x"].to(engine.device)) - batch["y"].to(engine.device)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if (step + 1) % gas == 0:
            norm = engine.get_global_grad_norm()
            norms.append(None if norm is None else float(norm))
    found = weights(engine)
    engine.destroy()
    return losses, norms, found


def same_as_upstream(config, what, updates=3, **model):
    """``config`` trained alone through ours and upstream: bit-identical losses, norms and weights."""
    want = train_alone(deepspeed.initialize, config, updates, **model)
    got = train_alone(deepspeed_multi.initialize, config, updates, **model)
    assert got[0] == want[0], f"{what}: losses {got[0]} vs upstream {want[0]}"
    assert got[1] == want[1], f"{what}: gradient norms {got[1]} vs upstream {want[1]}"
    assert got[2].keys() == want[2].keys(), f"{what}: weights {sorted(got[2])} vs upstream {sorted(want[2])}"
    for name, w in want[2].items():
        assert torch.equal(got[2][name], w), \
            f"{what}: {name} differs from upstream by {(got[2][name].double() - w.double()).abs().max().item():.3e}"


def overlap_below_stage2(stages=(0, 1), dtypes=("fp32", "bf16"), gases=(1, 2)):
    """``overlap_comm: true`` at ZeRO-0 and ZeRO-1 (DeepSpeed-Chat's and axolotl's configs): upstream
    trains it; so do ours, with upstream's bits ([Note: overlap_comm below ZeRO-2]: at ZeRO-1 on more
    than two ranks only the backward's bucket order gives them)."""
    for stage in stages:
        for dtype in dtypes:
            for gas in gases:
                # Buckets of several parameters (of 8 x 96, 96, 96 x 8, 8 elements), each flushed part full.
                config = ds_config(stage, dtype, gas, zero_optimization={"overlap_comm": True, "reduce_bucket_size": 900})
                same_as_upstream(config, f"ZeRO-{stage} {dtype} gas {gas} overlap_comm, {dist.get_world_size()} ranks",
                                 width=96)
    return dist.get_rank()
