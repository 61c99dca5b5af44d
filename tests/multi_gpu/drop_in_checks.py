"""Drop-in: an engine builds wherever upstream's builds and, trained as upstream's is (``engine.backward``,
``engine.step``), gives upstream's bits (rank functions for test_drop_in.py).

Each check builds the same model twice on every rank, through ``deepspeed.initialize`` and through
``deepspeed_multi.initialize``, trains both on the same batches and compares losses, gradient norms
and final weights with ``torch.equal``.
"""
import logging

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
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    if engine.optimizer is None or isinstance(engine.optimizer, DeepSpeedZeRoOffload):  # (no optimizer: no masters)
        return out
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


class _Warnings(logging.Handler):
    """The warnings one logger emits inside a ``with`` block."""

    def __init__(self, name):
        super().__init__(logging.WARNING)
        self.logger, self.messages = logging.getLogger(name), []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        self.logger.addHandler(self)
        return self.messages

    def __exit__(self, *exc):
        self.logger.removeHandler(self)


def _ema_step(model, ema, beta=0.5, modifier_rank=None):
    """DeepSpeed-Chat's ``moving_average`` (utils.py), one parameter pair per gather, written through ``.data``."""
    with torch.no_grad():
        for param, param_ema in zip(model.parameters(), ema.parameters()):
            with deepspeed.zero.GatheredParameters([param, param_ema], modifier_rank=modifier_rank):
                param_ema.data.copy_(torch.lerp(param.data, param_ema.data, beta))


def _ema_program(initialize, dtype, modifier_rank):
    """A trained ZeRO-3 engine and its ZeRO-3 EMA (no optimizer), the EMA moved after each update; returns
    (EMA weights after each of two moves, the trained engine's weights, the warnings)."""
    from deepspeed_multi.reliability import discarded_writes
    config = ds_config(3, dtype)
    model, ema = MLP(seed=0), MLP(seed=1)
    engine, *_ = initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    ema_engine, *_ = initialize(model=ema, config=ds_config(3, dtype))
    moved = []
    with _Warnings(discarded_writes.__name__) as warned:
        for step in range(2):
            batch = default_batch(step, dist.get_rank())
            engine.backward((engine(batch["x"]) - batch["y"]).pow(2).mean())
            engine.step()
            _ema_step(engine.module, ema_engine.module, modifier_rank=modifier_rank)
            moved.append(weights(ema_engine))
        trained = weights(engine)  # a read: gathers without modifier_rank, writes nothing
    engine.destroy()
    ema_engine.destroy()
    return moved, trained, list(warned)


def gathered_writes_warned():
    """[Note: writes that GatheredParameters discards]: DeepSpeed-Chat's EMA of a ZeRO-3 actor, written
    inside GatheredParameters without modifier_rank, is discarded on both sides, bit for bit as upstream,
    and ours warns once per parameter naming it and modifier_rank=0; with modifier_rank=0 the EMA moves
    on both sides, equally, and nothing warns; reads (the weights gathered for the comparison) never warn."""
    for dtype in ("fp32", "bf16"):
        for modifier_rank in (None, 0):
            want = _ema_program(deepspeed.initialize, dtype, modifier_rank)
            got = _ema_program(deepspeed_multi.initialize, dtype, modifier_rank)
            what = f"{dtype}, modifier_rank={modifier_rank}"
            for g, w in zip(got[0] + [got[1]], want[0] + [want[1]]):
                for name in w:
                    assert torch.equal(g[name], w[name]), f"{what}: {name} differs from upstream"
            initial = weights_of_mlp(MLP(seed=1), dtype)
            discarded = all(torch.equal(got[0][-1][n], initial[n]) for n in initial)
            assert discarded == (modifier_rank is None), f"{what}: EMA discarded {discarded}"
            if modifier_rank is None:  # one gather per parameter pair: one warning each, in the first move only
                names = [f"MLP: {n} was written" for n in initial]
                assert len(got[2]) == len(names) and all(n in w and "modifier_rank=0" in w for n, w in
                                                         zip(names, got[2])), f"{what}: warned {got[2]}"
            else:
                assert got[2] == [], f"{what}: warned {got[2]}"
    return dist.get_rank()


def weights_of_mlp(model, dtype):
    low = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    return {n: p.detach().to(low) for n, p in model.named_parameters()}
