"""Models, configs and the plain-PyTorch reference shared by the multi-process tests.

Every scenario is run twice on the same global batch: once through DeepSpeed engines on all
ranks, once as plain PyTorch modules on every rank (the reference sees the batches of all
ranks and averages the per-rank losses, which is what data-parallel averaging computes).
"""
import copy
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import torch
import torch.nn as nn

import deepspeed.comm as dist

FP32_TOL = 1e-5


class MLP(nn.Module):
    """Casts its input to its own dtype and returns float32, so engines of any dtype chain."""

    def __init__(self, d_in=8, d_hidden=16, d_out=8, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x):
        x = x.to(self.fc1.weight.dtype)
        return self.fc2(torch.tanh(self.fc1(x))).float()


def ds_config(stage=2, dtype="fp32", gas=1, micro_bs=4, **extra):
    cfg = {
        "train_micro_batch_size_per_gpu": micro_bs,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {
            "stage": stage,
            # Test models are tiny: without these, ZeRO-3 would keep every parameter whole and
            # ZeRO-2 would reduce everything in one bucket, hiding the code under test.
            "stage3_param_persistence_threshold": 0,
            "reduce_bucket_size": 64,
            "allgather_bucket_size": 64,
            "stage3_prefetch_bucket_size": 64,
        },
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000, "hysteresis": 2}
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


@dataclass
class Member:
    """One model of a scenario: how to build it, its config, whether it trains."""
    build: Callable[[], nn.Module]
    config: dict
    trainable: bool = True
    lr: float = 0.1

    @property
    def gas(self):
        return self.config.get("gradient_accumulation_steps", 1)


@dataclass
class Scenario:
    members: Dict[str, Member]
    # loss(models: dict name -> callable module, batch: dict) -> scalar loss
    loss: Callable
    # batch(step, rank) -> dict of tensors
    batch: Callable
    micro_steps: int = 4
    # Called instead of "loss.backward()" on the engine side when given: (engines, loss) -> None
    backward: Optional[Callable] = None
    # Called instead of stepping every trainable model after each micro-batch when given
    step: Optional[Callable] = None
    extra: dict = field(default_factory=dict)


def default_batch(step, rank, n=4, d=8):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"x": torch.randn(n, d, generator=g), "y": torch.randn(n, d, generator=g)}


def full_params(engine_or_module):
    """Name -> full fp32 copy of every parameter (ZeRO-3 partitions gathered)."""
    import deepspeed
    module = getattr(engine_or_module, "module", engine_or_module)
    params = list(module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        return {n: p.detach().float().clone().cpu() for n, p in module.named_parameters()}


def run_reference(scenario: Scenario, world_size: int):
    """Plain PyTorch on one process: the same micro-batches of every rank, the same updates."""
    models = {name: m.build() for name, m in scenario.members.items()}
    opts = {name: torch.optim.SGD(models[name].parameters(), lr=m.lr)
            for name, m in scenario.members.items() if m.trainable}
    for name, m in scenario.members.items():
        if not m.trainable:
            models[name].requires_grad_(False)
    for step in range(scenario.micro_steps):
        losses = [scenario.loss(models, scenario.batch(step, r)) for r in range(world_size)]
        (sum(losses) / world_size).backward()
        for name, opt in opts.items():
            gas = scenario.members[name].gas
            if (step + 1) % gas == 0:
                for p in models[name].parameters():
                    if p.grad is not None:
                        p.grad.div_(gas)
                opt.step()
                opt.zero_grad(set_to_none=True)
    return {name: {n: p.detach().float().clone() for n, p in mod.named_parameters()} for name, mod in models.items()}


def build_engines(scenario: Scenario, initialize):
    """``initialize`` is deepspeed_multi.initialize or deepspeed.initialize."""
    engines = {}
    for name, m in scenario.members.items():
        model = m.build()
        cfg = copy.deepcopy(m.config)
        if m.trainable:
            opt = torch.optim.SGD(model.parameters(), lr=m.lr)
            engines[name], _, _, _ = initialize(model=model, optimizer=opt, config=cfg)
        else:
            model.requires_grad_(False)
            engines[name], _, _, _ = initialize(model=model, config=cfg)
    return engines


def run_engines(scenario: Scenario, initialize):
    engines = build_engines(scenario, initialize)
    rank = dist.get_rank()
    device = next(iter(engines.values())).device
    for step in range(scenario.micro_steps):
        batch = {k: v.to(device) for k, v in scenario.batch(step, rank).items()}
        loss = scenario.loss(engines, batch)
        if scenario.backward is not None:
            scenario.backward(engines, loss)
        else:
            loss.backward()
        if scenario.step is not None:
            scenario.step(engines, step)
        else:
            for name, m in scenario.members.items():
                if m.trainable:
                    engines[name].step()
    return engines


def compare(engines, reference, members, dtype="fp32"):
    """Raise with the worst parameter when the engines' parameters differ from the reference."""
    report = {}
    for name, engine in engines.items():
        got = full_params(engine)
        want = reference[name]
        initial = {n: p.detach().float() for n, p in members[name].build().named_parameters()}
        if dtype == "fp32":
            err = max((got[n] - want[n]).abs().max().item() for n in want)
            report[name] = err
            assert err <= FP32_TOL, f"engine {name!r}: max abs error {err:.3e} > {FP32_TOL} vs plain PyTorch"
        else:
            du = torch.cat([(got[n] - initial[n]).flatten() for n in want])
            dr = torch.cat([(want[n] - initial[n]).flatten() for n in want])
            if dr.norm() == 0:
                assert du.norm() == 0, f"engine {name!r}: moved although the reference did not"
                report[name] = (1.0, 1.0)
                continue
            cos = torch.nn.functional.cosine_similarity(du, dr, dim=0).item()
            ratio = (du.norm() / dr.norm()).item()
            report[name] = (cos, ratio)
            assert cos > 0.99 and abs(ratio - 1) < 0.05, (
                f"engine {name!r}: update cosine {cos:.4f} (want > 0.99), norm ratio {ratio:.4f} (want 1 +- 0.05)")
    return report
