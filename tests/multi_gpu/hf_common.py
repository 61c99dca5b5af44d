"""Training loops written against Accelerate's API, run three ways on the same global batch:
through ``deepspeed_multi.accelerate.Accelerator``, through plain ``accelerate.Accelerator``
(recorded, not asserted), and as plain PyTorch on one process (the reference).

A loop is a set of members (model builder, DeepSpeed config, trainable or not, LR schedule) and
phases; each phase returns a loss for one ``accelerator.backward`` and lists the actions after it:
``("step", name)`` = ``optimizer.step(); scheduler.step()``, ``("zero_grad", name)`` =
``optimizer.zero_grad()``. The reference follows Accelerate's meaning of those calls under
gradient accumulation: gradients of a window's micro-batches add up, the update at the window's
end uses their mean, ``zero_grad`` inside a window does nothing, the schedule advances once per
update (``num_processes`` times for a scheduler the loop prepares, as Accelerate steps it). It sees
every rank's batch and averages the ranks' losses, as data parallelism does.
"""
import copy
import math
import os
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import torch

import deepspeed.comm as dist

from common import FP32_TOL, full_params, window_update

LR = 0.1


def lr_lambda(update):
    """Warm-up over 2 updates then decay: every update changes the LR, so a missed or doubled step shows."""
    return min(1.0, (update + 1) / 2) * 0.8**update


@dataclass
class Member:
    """``config`` may hold "optimizer"/"scheduler" sections (the guide's zero2_config): the loop then
    prepares ``DummyOptim``/``DummyScheduler`` and the reference builds the same torch optimizer and
    DeepSpeed schedule."""
    build: Callable[[], torch.nn.Module]
    config: dict
    trainable: bool = True
    schedule: bool = True

    @property
    def from_config(self):
        return "optimizer" in self.config

    @property
    def gas(self):
        return self.config.get("gradient_accumulation_steps", 1)


@dataclass
class Phase:
    loss: Callable                # (models, batch, cache) -> scalar loss
    after: tuple = ()


@dataclass
class Loop:
    name: str
    members: Dict[str, Member]
    phases: list
    batch: Callable               # (step, rank) -> dict of tensors
    steps: int = 4
    setup: Optional[Callable] = None   # (models, batch, cache) under no_grad, before the phases
    world_size: int = 2
    prepare: str = "select"       # "select": select_deepspeed_plugin(name); "per_call": prepare(..., deepspeed_plugin=cfg)
    extra: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- accelerate side
def reset_accelerate():
    """A fresh AcceleratorState (it is a process-wide singleton); the process group stays."""
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def build_prepared(loop: Loop, accelerator_cls):
    """Build and prepare every member the way the loop says; return (accelerator, models, opts, scheds)."""
    from accelerate.utils import DeepSpeedPlugin
    reset_accelerate()
    names = list(loop.members)
    if loop.prepare == "select":
        plugins = {n: DeepSpeedPlugin(hf_ds_config=copy.deepcopy(loop.members[n].config)) for n in names}
        accelerator = accelerator_cls(deepspeed_plugins=plugins)
    else:
        first = loop.members[names[0]].config
        accelerator = accelerator_cls(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=copy.deepcopy(first)))
    models, opts, scheds = {}, {}, {}
    for i, name in enumerate(names):
        member = loop.members[name]
        kw = {}
        if loop.prepare == "select":
            accelerator.state.select_deepspeed_plugin(name)
        elif i > 0:
            kw = {"deepspeed_plugin": copy.deepcopy(member.config)}
        torch.manual_seed(1234 + i)
        model = member.build()
        if not member.trainable:
            model.requires_grad_(False)
            models[name] = accelerator.prepare(model, **kw)
            continue
        if member.from_config:
            from accelerate.utils import DummyOptim, DummyScheduler
            opt = DummyOptim(model.parameters())
            models[name], opts[name], scheds[name] = accelerator.prepare(model, opt, DummyScheduler(opt), **kw)
            continue
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        if member.schedule:
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
            models[name], opts[name], scheds[name] = accelerator.prepare(model, opt, sched, **kw)
        else:
            models[name], opts[name] = accelerator.prepare(model, opt, **kw)
    return accelerator, models, opts, scheds


def _lr(sched):
    return [float(x) for x in sched.get_last_lr()]


def run_accelerate(loop: Loop, accelerator_cls):
    """Run ``loop`` through ``accelerator_cls``; return (initial params, final params, LR trace)."""
    accelerator, models, opts, scheds = build_prepared(loop, accelerator_cls)
    initial = {n: full_params(m) for n, m in models.items()}
    rank = dist.get_rank()
    lrs = {n: [] for n in scheds}
    for step in range(loop.steps):
        batch = loop.batch(step, rank)
        cache = {}
        if loop.setup is not None:
            with torch.no_grad():
                loop.setup(models, batch, cache)
        for phase in loop.phases:
            accelerator.backward(phase.loss(models, batch, cache))
            for action, name in phase.after:
                if action == "step":
                    opts[name].step()
                    if name in scheds:
                        scheds[name].step()
                        lrs[name].append(_lr(scheds[name]))
                else:
                    opts[name].zero_grad()
    final = {n: full_params(m) for n, m in models.items()}
    return initial, final, lrs, accelerator, models


# ----------------------------------------------------------------------------- reference
def run_reference(loop: Loop, initial):
    """Plain PyTorch on this process, starting from the engines' initial parameters."""
    from deepspeed_multi.integrations.hf_config import hf_deepspeed_config
    world = loop.world_size
    models, opts, scheds, windows = {}, {}, {}, {}
    for name, member in loop.members.items():
        with hf_deepspeed_config(None):
            model = member.build()
        model.load_state_dict(initial[name], strict=False)
        models[name] = model
        if not member.trainable:
            model.requires_grad_(False)
            continue
        windows[name] = 0
        if member.from_config:
            from deepspeed.runtime import lr_schedules
            section = member.config["optimizer"]
            opts[name] = getattr(torch.optim, section["type"])(model.parameters(), **section["params"])
            section = member.config["scheduler"]
            scheds[name] = getattr(lr_schedules, section["type"])(opts[name], **section["params"])
            continue
        opts[name] = torch.optim.SGD(model.parameters(), lr=LR)
        if member.schedule:
            scheds[name] = torch.optim.lr_scheduler.LambdaLR(opts[name], lr_lambda)
    lrs = {n: [] for n in scheds}
    for step in range(loop.steps):
        batches = [loop.batch(step, r) for r in range(world)]
        caches = [{} for _ in range(world)]
        if loop.setup is not None:
            with torch.no_grad():
                for r in range(world):
                    loop.setup(models, batches[r], caches[r])
        for phase in loop.phases:
            for r in range(world):
                (phase.loss(models, batches[r], caches[r]) / world).backward()
            for action, name in phase.after:
                gas = loop.members[name].gas
                if action == "zero_grad":
                    if windows[name] % gas == 0:   # Accelerate keeps a window's gradients
                        opts[name].zero_grad(set_to_none=True)
                    continue
                windows[name] += 1
                if windows[name] % gas == 0:
                    window_update(models[name], opts[name], gas)
                    # Accelerate steps a scheduler of the loop's num_processes times an update; the engine steps
                    # one from the config once.
                    for _ in range(0 if name not in scheds else 1 if loop.members[name].from_config else world):
                        scheds[name].step()
                if name in scheds:
                    lrs[name].append(_lr(scheds[name]))
    return {n: {k: v.detach().float().clone() for k, v in m.named_parameters()} for n, m in models.items()}, lrs


# ----------------------------------------------------------------------------- comparison
def max_errors(final, want, initial, loop):
    """Name -> max abs parameter error vs the reference (frozen members: vs their start)."""
    out = {}
    for name, member in loop.members.items():
        target = want[name] if member.trainable else initial[name]
        out[name] = max((final[name][k] - target[k]).abs().max().item() for k in target)
    return out


def lr_mismatch(got, want):
    """Name -> number of steps whose LR differs from the reference's (None when all agree)."""
    bad = {}
    for name, trace in want.items():
        g = got.get(name, [])
        diffs = sum(1 for a, b in zip(g, trace) if not all(math.isclose(x, y, rel_tol=1e-9) for x, y in zip(a, b)))
        diffs += abs(len(g) - len(trace))
        if diffs:
            bad[name] = diffs
    return bad


def check_ours(loop: Loop):
    """Run ``loop`` through deepspeed_multi's Accelerator; assert exact vs the reference; return errors."""
    from deepspeed_multi.accelerate import Accelerator
    initial, final, lrs, _, _ = run_accelerate(loop, Accelerator)
    want, want_lrs = run_reference(loop, initial)
    errors = max_errors(final, want, initial, loop)
    worst = max(errors.values())
    assert worst <= FP32_TOL, f"{loop.name}: max abs error vs plain PyTorch {errors} > {FP32_TOL}"
    bad = lr_mismatch(lrs, want_lrs)
    assert not bad, f"{loop.name}: learning rates differ from the reference at {bad} steps: ours {lrs} vs {want_lrs}"
    for name, member in loop.members.items():
        if member.trainable:
            moved = max((final[name][k] - initial[name][k]).abs().max().item() for k in initial[name])
            assert moved > 0, f"{loop.name}: {name} never moved"
    return {"errors": errors, "lr_steps_checked": {n: len(t) for n, t in lrs.items()}}


def record_upstream(loop: Loop):
    """The same loop through plain accelerate.Accelerator: what it gives (never raises).

    Plain Accelerate has no per-call config (``prepare(..., deepspeed_plugin=)``), so it gets the
    guide's way instead: ``select_deepspeed_plugin(name)`` before each ``prepare``.
    """
    import dataclasses

    import accelerate
    loop = dataclasses.replace(loop, prepare="select")
    try:
        initial, final, lrs, _, _ = run_accelerate(loop, accelerate.Accelerator)
    except Exception as e:  # noqa: BLE001 - recorded, not asserted
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}
    want, want_lrs = run_reference(loop, initial)
    errors = max_errors(final, want, initial, loop)
    out = {"errors": errors, "lr_mismatch": lr_mismatch(lrs, want_lrs)}
    for name, member in loop.members.items():
        if member.trainable and max((final[name][k] - initial[name][k]).abs().max().item()
                                    for k in initial[name]) == 0:
            out.setdefault("never_updated", []).append(name)
    return out


def run_loops(loops, with_upstream=None):
    """Rank function body: ours (asserted), then, with DSM_RECORD_UPSTREAM=1 (tests/multi_gpu/report.py
    --accelerate), the same loops through plain Accelerate (recorded)."""
    if with_upstream is None:
        with_upstream = os.environ.get("DSM_RECORD_UPSTREAM", "0") == "1"
    report = {}
    for loop in loops:
        report[loop.name] = {"ours": check_ours(loop)}
    if with_upstream:
        for loop in loops:
            report[loop.name]["upstream"] = record_upstream(loop)
    reset_accelerate()
    write_report(report)
    return report


def write_report(report):
    import json
    out = os.environ.get("DSM_REPORT_DIR")
    if out and dist.get_rank() == 0:
        os.makedirs(out, exist_ok=True)
        for name, entry in report.items():
            with open(os.path.join(out, f"accelerate-{name}.json"), "w") as f:
                json.dump(entry, f, indent=1)
