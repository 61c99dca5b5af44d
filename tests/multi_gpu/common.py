"""Models, configs and the plain-PyTorch reference shared by the multi-process tests.

Every scenario is run twice on the same global batch: once through DeepSpeed engines on all
ranks, once as plain PyTorch modules on every rank (the reference sees the batches of all
ranks and averages the per-rank losses, which is what data-parallel averaging computes).
"""
import copy
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import torch
import torch.nn as nn

import deepspeed.comm as dist

FP32_TOL = 1e-5
# Ranks of a scenario that names none. DSM_TEST_WORLD_SIZE=1 runs them on one rank, which is NCCL
# on a machine with one GPU (the launcher uses NCCL only when every rank has a GPU of its own).
WORLD_SIZE = int(os.environ.get("DSM_TEST_WORLD_SIZE", "2"))


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


@contextmanager
def record_found(module, name):
    """Patch ``module.<name>``, a function that returns a tensor or None, for the block; yield the
    list of what each call returned: True where it found one, False where it fell back."""
    found, original = [], getattr(module, name)

    def recording(*args, **kwargs):
        result = original(*args, **kwargs)
        found.append(result is not None)
        return result

    setattr(module, name, recording)
    try:
        yield found
    finally:
        setattr(module, name, original)


@dataclass
class Member:
    """One model of a scenario: how to build it, its config, whether it trains."""
    build: Callable[[], nn.Module]
    config: dict
    trainable: bool = True
    lr: float = 0.1
    param_groups: Callable = None  # trainable params -> the engine optimizer's param groups (e.g. MoE's)
    autocast: torch.dtype = None  # torch_autocast in the config: the reference's forward runs under torch.autocast

    @property
    def dtype(self):
        return "bf16" if "bf16" in self.config else "fp16" if "fp16" in self.config else "fp32"

    @property
    def gas(self):
        return self.config.get("gradient_accumulation_steps", 1)


@dataclass
class Phase:
    """One backward of a micro-step.

    ``loss(models, batch, cache)`` returns a scalar loss or ``(tensors, grad_tensors)`` for
    ``torch.autograd.backward``; ``cache`` is shared by the phases of one micro-step (so a
    later phase can reuse an earlier forward). ``after`` lists actions run after this backward:
    ``("step", name)`` or ``("zero_grad", name)``; ``None`` means step every trainable model.
    """
    loss: Callable
    retain_graph: bool = False
    after: Optional[tuple] = None


@dataclass
class Scenario:
    members: Dict[str, Member]
    phases: list
    batch: Callable = None
    micro_steps: int = 4
    dtype: str = "fp32"
    world_size: int = field(default_factory=lambda: WORLD_SIZE)
    took_effect: Callable = None  # engines -> None; raises if a configured knob did not take effect
    prepare: Callable = None  # engines -> None: after initialize, before the first forward (e.g. engine.compile())
    after_micro_step: Callable = None  # (engines, step, initialize) -> None: after a micro-step's actions

    def __post_init__(self):
        if self.batch is None:
            self.batch = default_batch

    def actions(self, phase):
        if phase.after is not None:
            return phase.after
        return tuple(("step", name) for name, m in self.members.items() if m.trainable)


def expect_error(exc_type, fn, *texts) -> str:
    """``fn()`` must raise ``exc_type`` with every one of ``texts`` in its message; returns the message."""
    try:
        fn()
    except exc_type as e:
        for text in texts:
            assert text in str(e), f"{text!r} not in: {e}"
        return str(e)
    raise AssertionError(f"{getattr(fn, '__name__', fn)} must raise {exc_type.__name__} containing {texts}")


def default_batch(step, rank, n=4, d=8):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"x": torch.randn(n, d, generator=g), "y": torch.randn(n, d, generator=g)}


def scale_in_place(module, factor):
    """Multiply a (frozen) module's parameters by ``factor`` in place, as an EMA teacher's update
    changes them: at ZeRO-3 gathered, rank 0's change broadcast (DeepSpeed's ``modifier_rank``);
    without ZeRO-3 on every rank."""
    import deepspeed
    params = list(module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0), torch.no_grad():
        for p in params:
            p.mul_(factor)


def full_params(engine_or_module):
    """Name -> full fp32 copy of every parameter (ZeRO-3 partitions gathered).

    For a trainable bf16/fp16 engine these are the fp32 master weights, where updates smaller
    than a half-precision step are still visible.
    """
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param
    parts = getattr(engine_or_module, "parts", None)
    if isinstance(parts, dict):  # a PartedEngine: each part's, under the model's own names
        from deepspeed_multi.parts import REST
        return {("" if name == REST else name + ".") + n.replace("/", "."): v
                for name, part in parts.items() for n, v in full_params(part).items()}
    module = getattr(engine_or_module, "module", engine_or_module)
    trains = getattr(engine_or_module, "trains", False)
    if trains and (engine_or_module.bfloat16_enabled() or engine_or_module.fp16_enabled()):
        master = {n: safe_get_full_fp32_param(p) for n, p in module.named_parameters()}
        if all(v is not None for v in master.values()):
            return {n: v.detach().float().clone().cpu() for n, v in master.items()}
        opt = engine_or_module.optimizer  # stage 0: DeepSpeed's FP16_UnfusedOptimizer keeps fp32 copies
        if hasattr(opt, "fp16_groups") and hasattr(opt, "fp32_groups"):
            copies = {id(lp): hp for lg, hg in zip(opt.fp16_groups, opt.fp32_groups) for lp, hp in zip(lg, hg)}
            if all(id(p) in copies for p in module.parameters()):
                return {n: copies[id(p)].detach().float().clone().cpu() for n, p in module.named_parameters()}
    params = list(module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        return {n: p.detach().float().clone().cpu() for n, p in module.named_parameters()}


def _backward(result, retain_graph, weight=1.0):
    if result is None:  # the phase ran no backward of its own (e.g. torch.autograd.grad of inputs only)
        return
    if isinstance(result, tuple):
        tensors, grads = result
        torch.autograd.backward(list(tensors), [g * weight for g in grads], retain_graph=retain_graph)
    else:
        (result * weight).backward(retain_graph=retain_graph)


def window_update(model, optimizer, gas):
    """The reference's update at the end of an accumulation window: the mean over its micro-steps."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad.div_(gas)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _autocast_forward(model, dtype):
    """``model`` whose forward runs under torch.autocast(dtype), as DeepSpeed's torch_autocast runs it."""
    if dtype is not None:
        model.forward = torch.autocast("cpu", dtype=dtype)(model.forward)
    return model


def run_reference(scenario: Scenario):
    """Plain PyTorch on one process: the same micro-batches of every rank, the same updates."""
    world = scenario.world_size
    models = {name: _autocast_forward(m.build(), m.autocast) for name, m in scenario.members.items()}
    opts = {name: torch.optim.SGD(models[name].parameters(), lr=m.lr)
            for name, m in scenario.members.items() if m.trainable}
    windows = {name: 0 for name in opts}
    for name, m in scenario.members.items():
        if not m.trainable:
            models[name].requires_grad_(False)
    for step in range(scenario.micro_steps):
        batches = [scenario.batch(step, r) for r in range(world)]
        caches = [{} for _ in range(world)]
        for phase in scenario.phases:
            # Data parallelism averages the ranks' gradients: one backward per rank, weight 1/world.
            for r in range(world):
                _backward(phase.loss(models, batches[r], caches[r]), phase.retain_graph, 1.0 / world)
            for action, name in scenario.actions(phase):
                if action == "zero_grad":
                    opts[name].zero_grad(set_to_none=True)
                    continue
                gas = scenario.members[name].gas
                windows[name] += 1
                if windows[name] % gas == 0:
                    window_update(models[name], opts[name], gas)
    return {name: {n: p.detach().float().clone() for n, p in mod.named_parameters()} for name, mod in models.items()}


def build_engines(scenario: Scenario, initialize):
    """``initialize`` is deepspeed_multi.initialize or deepspeed.initialize."""
    return {name: build_engine(m, m.build(), initialize) for name, m in scenario.members.items()}


def build_engine(m: Member, model: nn.Module, initialize):
    """Member ``m``'s engine over ``model`` (a new SGD optimizer for a trainable member)."""
    cfg = copy.deepcopy(m.config)
    if m.trainable:
        # The trainable parameters only, as Trainer passes them (a PEFT model's base weights are frozen).
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.SGD(m.param_groups(params) if m.param_groups else params, lr=m.lr)
        return initialize(model=model, optimizer=opt, config=cfg)[0]
    model.requires_grad_(False)
    return initialize(model=model, config=cfg)[0]


def run_engines(scenario: Scenario, initialize, engines=None):
    engines = engines or build_engines(scenario, initialize)
    if scenario.prepare is not None:
        scenario.prepare(engines)
    rank = dist.get_rank()
    device = next(iter(engines.values())).device
    for step in range(scenario.micro_steps):
        batch = {k: v.to(device) for k, v in scenario.batch(step, rank).items()}
        cache = {}
        for phase in scenario.phases:
            _backward(phase.loss(engines, batch, cache), phase.retain_graph)
            for action, name in scenario.actions(phase):
                getattr(engines[name], action)()
        if scenario.after_micro_step is not None:
            scenario.after_micro_step(engines, step, initialize)
    return engines


def compare(engines, reference, members, dtype="fp32"):
    """Raise with the worst parameter when the engines' parameters differ from the reference."""
    report = {}
    for name, engine in engines.items():
        got = full_params(engine)
        want = reference[name]
        initial = {n: p.detach().float() for n, p in members[name].build().named_parameters()}
        if not members[name].trainable:
            # A frozen engine never moves; its parameters are only rounded to its dtype.
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(members[name].dtype, torch.float32)
            err = max((got[n] - initial[n].to(dtype).float()).abs().max().item() for n in want)
            report[name] = err
            assert err == 0, f"frozen engine {name!r} moved by {err:.3e}"
            continue
        if dtype == "fp32":
            err = max((got[n] - want[n]).abs().max().item() for n in want)
            report[name] = err
            assert err <= FP32_TOL, f"engine {name!r}: max abs error {err:.3e} > {FP32_TOL} vs plain PyTorch"
        else:
            # The engine starts from its weights rounded to its dtype (DeepSpeed builds the fp32
            # master copy from them): its update is measured from there, the reference's from
            # the fp32 start. Otherwise the rounding counts as update error when updates are small.
            low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(members[name].dtype, torch.float32)
            du = torch.cat([(got[n] - initial[n].to(low).float()).flatten() for n in want])
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


class Records(logging.Handler):
    """A logging handler that keeps each record's message (attach it to the logger under test)."""

    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())
