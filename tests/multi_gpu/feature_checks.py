"""Rank functions for DeepSpeed's newer training features in multi-engine programs (test_deepspeed_api.py):
torch_autocast's fp16 GradScaler and its scope, and Muon. The matrix's ``knob-torch-autocast-*`` rows
measure torch_autocast's gradients; these check what a row cannot (ZenFlow's and SuperOffload's refusals
are unit tests: tests/unit/test_config.py)."""
import deepspeed.comm as dist
import torch

import deepspeed_multi
from deepspeed_multi.autograd.grad_scale import autocast_scaler
from common import FP32_TOL, MLP, ds_config, full_params


def _batch(step, rank=None):
    rank = dist.get_rank() if rank is None else rank
    g = torch.Generator().manual_seed(300 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)


def autocast_fp16_overflow_skips_on_every_rank(stage):
    """One rank's gradient overflows in one element: every rank skips the update and halves the scale,
    as DDP's GradScaler on the all-reduced gradient ([Note: torch_autocast's GradScaler]; DeepSpeed
    skipped without backing off, so the same scale overflowed again)."""
    rank = dist.get_rank()
    cfg = ds_config(stage, torch_autocast={"enabled": True, "dtype": "float16"})
    model = MLP(seed=1)
    poison = {"on": False}

    def overflow_here(grad):
        if poison["on"] and rank == 0:
            grad = grad.clone()
            grad[0, 0] = float("inf")
        return grad

    model.fc2.weight.register_hook(overflow_here)
    engine = deepspeed_multi.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                        config=cfg)[0]
    scaler = autocast_scaler(engine)
    x, y = _batch(0)
    ((engine(x) - y) ** 2).mean().backward()
    engine.step()
    before, scale = full_params(engine), scaler.get_scale()
    assert any((v != 0).any() for v in before.values())
    poison["on"] = True
    x, y = _batch(1)
    ((engine(x) - y) ** 2).mean().backward()
    engine.step()
    after = full_params(engine)
    moved = max((after[n] - before[n]).abs().max().item() for n in before)
    scales = [None] * dist.get_world_size()
    dist.all_gather_object(scales, scaler.get_scale())
    assert moved == 0, (f"ZeRO-{stage} fp16 torch_autocast, rank {rank}: rank 0 overflowed but the update "
                        f"moved parameters by {moved:.3e} (the ranks must skip together)")
    assert scales == [scale / 2] * len(scales), f"ZeRO-{stage}: loss scales after the overflow {scales}, want {scale / 2}"
    engine.destroy()


def _muon_exact(stages, gas):
    from deepspeed.runtime.zero.muon import original_muon
    from deepspeed_multi.switches import MUON_COMPILE_AT_FIRST_CALL, switch_on
    # The engines built before these imported DeepSpeed's Muon kernels compiled at their first call
    # ([Note: Muon's kernels compiled at their first call]): these engines train through them.
    assert getattr(original_muon.muon_update, "compiled_at_first_call", False) == switch_on(MUON_COMPILE_AT_FIRST_CALL)
    exact = original_muon.ns_compute_dtype("gram") == torch.float32
    for name, got in muon_diamond(stages, gas=gas).items():
        what = f"Muon, engines at ZeRO {stages}, gas {gas}, engine {name}"
        if exact:
            assert got["err"] <= FP32_TOL, f"{what}: max abs error {got['err']:.3e} vs plain PyTorch"
        else:  # Newton-Schulz in fp16 (the accelerator reports fp16 support)
            assert got["cos"] > 0.99 and abs(got["ratio"] - 1) < 0.05, f"{what}: {got}"


def all_features():
    for stage in (0, 1, 2, 3):
        # These leave DeepSpeed's torch_autocast initialized in the process: the Muon engines below are
        # built after them, as in a program whose first engine uses it ([Note: torch_autocast is per engine]).
        autocast_fp16_overflow_skips_on_every_rank(stage)
    for stage in (1, 2, 3):
        autocast_stays_in_its_engine(stage)
    for stages, gas in (((1, 2, 3), 1), ((3, 1, 2), 2), ((2, 3, 1), 2)):
        _muon_exact(stages, gas)


def autocast_stays_in_its_engine(stage):
    """An fp16 torch_autocast engine built first: a bf16 engine built after it keeps its own
    ``communication_data_type: fp32`` and gets no GradScaler ([Note: torch_autocast is per engine])."""
    first = MLP(seed=1)
    a = deepspeed_multi.initialize(model=first, optimizer=torch.optim.SGD(first.parameters(), lr=0.1),
                                   config=ds_config(stage, torch_autocast={"enabled": True, "dtype": "float16"}))[0]
    second = MLP(seed=2)
    b = deepspeed_multi.initialize(model=second, optimizer=torch.optim.SGD(second.parameters(), lr=0.1),
                                   config=ds_config(stage, "bf16", communication_data_type="fp32"))[0]
    assert a.optimizer.torch_autocast_gradscaler is not None
    assert b.optimizer.torch_autocast_gradscaler is None, f"ZeRO-{stage}: the bf16 engine got the fp16 GradScaler"
    dtypes = {b.optimizer.get_param_comm_dtype(p) for p in second.parameters()} | set(b.optimizer.ipg_buckets)
    assert dtypes == {torch.float32}, f"ZeRO-{stage}: the bf16 engine communicates in {dtypes}, configured fp32"
    for e in (a, b):
        e.destroy()


# --------------------------------------------------------------- Muon
# torch_adam: the Adam half is torch's AdamW (DeepSpeed's FusedAdam would be JIT-built on CPU: 90 s in a fresh clone).
_MUON = {"type": "Muon", "params": {"lr": 0.02, "momentum": 0.9, "weight_decay": 0.01, "betas": [0.9, 0.99],
                                    "torch_adam": True}}


def _muon_reference(models):
    """Plain PyTorch: DeepSpeed's MuonWithAuxAdam over each model's parameters, grouped and tagged as
    deepspeed.initialize groups and tags them (matrices Muon, the rest Adam), its Adam half torch's AdamW."""
    from types import SimpleNamespace

    import deepspeed
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    opts = []
    for model in models:
        deepspeed.set_optimizer_flags(SimpleNamespace(optimizer_name="muon", optimizer_params=_MUON["params"]), model)
        groups = DeepSpeedEngine._muon_param_groups(list(model.parameters()), dict(_MUON["params"]))
        opts.append(MuonWithAuxAdam(groups, adam_optimizer=torch.optim.AdamW, adam_optimizer_kwargs={"foreach": None}))
    return opts


def muon_diamond(stages, initialize=None, steps=3, gas=1):
    """Three engines with DeepSpeed's Muon (a feeds b and c, one loss.backward()), against plain PyTorch
    with the same optimizer on the averaged gradients. Returns the max abs error and the update's
    cosine and norm ratio of each engine (Newton-Schulz runs in fp16 where the accelerator says it
    can: the tolerance is then the low-precision one)."""
    initialize = initialize or deepspeed_multi.initialize
    world = dist.get_world_size()
    engines = []
    for i, stage in enumerate(stages):
        cfg = ds_config(stage, gas=gas, optimizer=_MUON)
        if stage == 3:
            cfg["zero_optimization"]["reduce_scatter"] = False  # DeepSpeed's Muon at ZeRO-3 needs it
        engines.append(initialize(model=MLP(seed=i + 1), config=cfg)[0])
    refs = [MLP(seed=i + 1) for i in range(3)]
    start = [{n: p.detach().clone() for n, p in r.named_parameters()} for r in refs]
    opts = _muon_reference(refs)

    def loss(m, x, y):
        h = m[0](x)
        return ((m[1](h) + m[2](h) - y) ** 2).mean()

    for step in range(steps * gas):
        loss(engines, *_batch(step)).backward()
        for e in engines:
            e.step()
        for r in range(world):
            (loss(refs, *_batch(step, r)) / (world * gas)).backward()
        if (step + 1) % gas == 0:
            for o in opts:
                o.step()
                o.zero_grad(set_to_none=True)
    out = {}
    for i, (e, ref) in enumerate(zip(engines, refs)):
        got, want = full_params(e), dict(ref.named_parameters())
        du = torch.cat([(got[n] - start[i][n]).flatten() for n in want])
        dr = torch.cat([(want[n].detach() - start[i][n]).flatten() for n in want])
        out["abc"[i]] = {"err": max((got[n] - want[n].detach()).abs().max().item() for n in want),
                         "cos": torch.nn.functional.cosine_similarity(du, dr, dim=0).item(),
                         "ratio": (du.norm() / dr.norm()).item()}
        e.destroy()
    return out
