"""``deepspeed_multi.initialize`` for a config that declares submodules: one MultiEngine per part."""
import copy

import torch

from ..autograd.tree import tree_tensors
from ..config import enabled
from ..zero.stage3 import joined_fetch as stage3_joined_fetch
from ..zero.stage3 import prefetch as stage3_prefetch
from . import clip, construct, optimizer as parts_optimizer
from .engine import PartedEngine, PartsOptimizer
from .plan import REST, Plan

_TRAINING_ONLY = ("optimizer", "scheduler")


def initialize_parts(initialize, model, config, declared, optimizer=None, model_parameters=None, lr_scheduler=None,
                     training_data=None, **kwargs):
    """Build every part with ``initialize`` (deepspeed_multi.initialize); return DeepSpeed's 4-tuple."""
    if model_parameters is not None:
        raise ValueError("deepspeed_multi: model_parameters is not supported with declared submodules: pass an "
                         "optimizer built over the model's parameters (with your param groups), or an \"optimizer\" "
                         "config section; each part takes its own share of either.")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"deepspeed_multi: with declared submodules the optimizer must be a torch.optim.Optimizer "
                        f"built over the model's parameters (it is split between the parts); got "
                        f"{type(optimizer).__name__}.")
    given = copy.deepcopy(config)
    given.setdefault("deepspeed_multi", {})["submodules"] = copy.deepcopy(declared)
    plan = Plan(model, config, declared)
    replaced = construct.gather_non_zero3(model, plan)  # built partitioned as a whole (parts/construct.py)
    if replaced:
        plan = Plan(model, config, declared)  # the rest holds references to the replaced parameters
        for group in optimizer.param_groups if optimizer is not None else ():
            group["params"] = [replaced.get(id(p), p) for p in group["params"]]
    if any(enabled(cfg.get("fp16")) for cfg in plan.configs.values()):
        for cfg in plan.configs.values():  # an overflow anywhere skips the whole model's update
            cfg.setdefault("deepspeed_multi", {}).setdefault("skip_group", f"deepspeed_multi.parts.{id(model):x}")
    split = parts_optimizer.split(optimizer, plan.owner_of(), list(plan.modules)) if optimizer is not None else {}
    engines, sources, loader = {}, {}, None
    for name, module in plan.modules.items():
        cfg = copy.deepcopy(plan.configs[name])
        part_optimizer, sources[name] = split.get(name, (None, []))
        trainable = any(p.requires_grad for p in module.parameters())
        if not trainable or (optimizer is not None and part_optimizer is None):
            for key in _TRAINING_ONLY:  # a frozen part (or one the optimizer leaves out) is inference-only
                cfg.pop(key, None)
            part_optimizer = None
        engine, _, part_loader, _ = initialize(model=module, optimizer=part_optimizer, config=cfg,
                                               training_data=training_data if loader is None else None, **kwargs)
        loader = loader or part_loader
        engine._part_name = f"{type(model).__name__}.{name}" if name != REST else f"{type(model).__name__} (rest)"
        clip.check_supported(name, engine)
        engines[name] = engine
    hooks = _reset_rest_trace_at_model_forward(model, engines.get(REST))
    hooks += _drain_zero3_parts_after_model_forward(model, engines)
    scheduler = lr_scheduler
    parted = PartedEngine(model, engines, optimizer, sources, config=given, model_hooks=hooks)
    # Nothing to optimize (every part frozen, no optimizer given): no optimizer, as DeepSpeed returns.
    facade = PartsOptimizer(parted, optimizer) if optimizer is not None or parted._training_parts else None
    if scheduler is not None and not hasattr(scheduler, "step"):
        scheduler = scheduler(facade)  # DeepSpeed's callable form: optimizer -> scheduler
    if scheduler is not None and optimizer is None:
        raise ValueError("deepspeed_multi: an lr_scheduler object with declared submodules needs the optimizer it "
                         "schedules passed too (optimizer=...); with a config \"optimizer\" section use a config "
                         "\"scheduler\" section instead.")
    parted.lr_scheduler = scheduler
    return parted, facade, loader, scheduler


def _reset_rest_trace_at_model_forward(model, rest):
    """ZeRO-3 resets its prefetch trace when its root module's forward starts; the rest's root (a
    container) is never called, so the model's forward starts it instead."""
    if rest is None or rest.zero_optimization_stage() != 3:
        return []
    coordinator = stage3_joined_fetch.coordinator_of(rest.optimizer)

    def _start_of_model_forward(module, args):
        coordinator.reset_step()

    return [model.register_forward_pre_hook(_start_of_model_forward)]


def _drain_zero3_parts_after_model_forward(model, engines):
    """MultiEngine.forward drains ZeRO-3 prefetches no backward will consume (a frozen engine, or
    outputs that need no gradient: see zero/stage3/prefetch.py); the parts' forwards are the
    model's, so the end of the model's forward does it for them."""
    zero3 = [e for e in engines.values() if e.zero_optimization_stage() == 3]
    if not zero3:
        return []

    def _end_of_model_forward(module, args, outputs):
        needs_grad = any(t.requires_grad for t in tree_tensors(outputs))
        for engine in zero3:
            if not engine.trains or not needs_grad:
                stage3_prefetch.drain(engine)

    return [model.register_forward_hook(_end_of_model_forward)]
