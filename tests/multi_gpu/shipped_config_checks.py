"""Rank functions for test_shipped_configs.py: every distinct config of shipped_configs.py, through
deepspeed_multi and through upstream on the same job, and through deepspeed_multi in a program of two
engines under one ``loss.backward()`` against plain PyTorch.

A user brings the config file (or config builder) of the project they train with; ``deepspeed_multi``
is a drop-in only if each of those runs through it as it runs upstream. For each config, two checks:

- ``upstream``: the job that config's project runs, 3 optimizer steps on 2 ranks, through ours and through
  upstream, bit for bit. A config with ``"auto"`` values (``TRAINER``, and TRL's Accelerate configs,
  ``ACCELERATE``) trains a tiny Llama under ``deepspeed_multi.transformers.Trainer`` and under
  ``transformers.Trainer`` (each logged loss, ``grad_norm`` and learning rate, the final weights gathered);
  a builder's config (``INITIALIZE``) trains it through ``deepspeed_multi.initialize`` and
  ``deepspeed.initialize`` with ``engine.backward(loss); engine.step()`` and the optimizer and schedule
  that project passes (each loss, ``engine.get_global_grad_norm()`` and ``engine.get_lr()`` at each
  update, the final weights); an ``eval`` builder's config (no optimizer) runs 3 forwards (losses and
  logits). The weights compared are the module's, gathered (what a saved model holds, and what the
  Trainer check compares), and for a builder's job the fp32 masters too. Where upstream refuses the
  config, ours must refuse it with the same error, except ZeRO-1/2 without an optimizer, which ours builds
  as the stage-0 engine it documents: compared with upstream's. Where upstream is wrong, ours is compared
  with upstream with that fixed, and the outcome says so: fp16 at ZeRO-0 (DeepSpeed-Chat's stage-0 default),
  where upstream 0.19.8's ``engine.backward`` no longer scales the loss for its FP16 optimizers but their
  step still divides by the scale (``_restore_loss_scale``).
- ``two_engines``: the config's engine, through ours, trained between two calls of a frozen ZeRO-3 reference
  engine (no optimizer) of the same dtype, ``ref(trained(ref(x)))``: it feeds the reference and is fed by
  it under one ``loss.backward()``, at its own accumulation, clipping and optimizer, against the same
  program in plain PyTorch (every rank's batch, gradients averaged): 1e-5 in fp32, the update's cosine and
  norm in bf16/fp16 (common.compare, as the matrix). A Trainer config runs as the Trainer filled it (the
  upstream Trainer's DeepSpeed config after training). An ``eval`` config is the frozen engine itself,
  around the same builder's ZeRO-2 training config, as those projects pair a reference with a policy.

Each config's checks run inside one pool function per group and every outcome is returned, failures
included (a failing config does not stop the others). ``EXPECTED_FAILURES`` lists the failures known on
deepspeed_multi now, each with the text its message must hold and why; ``judge`` fails on any other
failure and on an expected one that passed (strict, as ``xfail(strict=True)``: remove the entry then).
"""
import copy
import math
import os
import time
from collections import namedtuple
from dataclasses import replace
from functools import partial

import torch

import deepspeed.comm as dist

import shipped_configs as table
from drop_in import initialize_swapped, launcher_env
from common import FP32_TOL, MLP, Member, compare, default_batch, ds_config
from hf_models import causal_lm, tokens
from trainer_checks import SEQ, TokenData, _args, _clear_ds_env, _fresh_process_state, _shared_tmp, _train, _weights_of

STEPS = 3           # optimizer steps per job
GAS = 2             # the Trainer's gradient_accumulation_steps where a config leaves it "auto"
MAX_GRAD_NORM = 1.0  # the Trainer's default, what "gradient_clipping": "auto" becomes
LR = 2e-2           # trainer_checks._args' learning rate; the builders' jobs and the two-engine programs too
INIT_MICRO = 2      # OpenRLHF's strategy writes the batch sizes (micro_train_batch_size, train_batch_size)
INIT_GAS = 2

Expected = namedtuple("Expected", "config check text reason")
# Empty: the failures known when this test was written were fixed before it landed (overlap_comm at ZeRO-0/1
# refused at initialize: axolotl's zero1.json, DeepSpeed-Chat's builder at every stage; ZeRO-0 refused under
# deepspeed_multi.transformers.Trainer: LLaMA-Factory's ds_z0_config.json; the fp16 ZeRO-0 norm kept loss-scaled:
# zero/stage0/fp16_norm.py). A ZeRO-3 grad_norm one fp32 ulp off upstream's under the Trainer, reported once, was
# not seen with any config here.
EXPECTED_FAILURES = []
CHECKS = ("upstream", "drop_in", "two_engines")


def _ok(message):
    return "ok: " + message


def _failed(message):
    return "FAILED: " + message


def is_failure(outcome) -> bool:
    return outcome.startswith("FAILED")


def verdict(outcome) -> str:
    """"ok", "FAILED" or "not run": what an outcome concluded, without its figures."""
    return outcome.split(":")[0]


def _error_text(e) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first[:300]}"


def _rank_data(step, rank=None):
    """The generator of micro-batch ``step``'s data on ``rank`` (this rank by default)."""
    rank = dist.get_rank() if rank is None else rank
    return torch.Generator().manual_seed(5000 + 100 * step + rank)


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)


def _diff(got, want) -> dict:
    """What differs between two runs' records ({quantity: [per step]} and final weights), bit for bit."""
    diffs = {}
    for key in want:
        if key in ("weights", "masters", "fixed"):
            continue
        bad = [(i, g, w) for i, (g, w) in enumerate(zip(got[key], want[key])) if not _same(g, w)]
        if len(got[key]) != len(want[key]):
            bad.append(("count", len(got[key]), len(want[key])))
        if bad:
            i, g, w = bad[0]
            diffs[key] = f"{len(bad)} of {len(want[key])} differ, first at {i}: {g!r} vs upstream {w!r}"
    gw, ww = got["weights"], want["weights"]
    if sorted(gw) != sorted(ww):
        diffs["weights"] = f"parameter names differ: {sorted(set(gw) ^ set(ww))}"
    else:
        errs = {n: (gw[n] - ww[n]).abs().max().item() for n in ww}
        worst = max(errs, key=errs.get)
        if errs[worst] != 0:
            diffs["weights"] = f"max abs difference {errs[worst]:.3e} at {worst}"
    return diffs


def _against_upstream(ours, upstream) -> str:
    """The ``upstream`` outcome from the two runs (each a record, or the exception it raised)."""
    if isinstance(upstream, Exception):
        if isinstance(ours, Exception):
            if _error_text(ours) == _error_text(upstream):
                return _ok(f"refused alike: {_error_text(upstream)}")
            return _failed(f"refused differently: ours {_error_text(ours)}; upstream {_error_text(upstream)}")
        return _failed(f"ours ran a config upstream refuses ({_error_text(upstream)})")
    if isinstance(ours, Exception):
        return _failed(f"ours raised {_error_text(ours)} (upstream trained)")
    diffs = _diff(ours, upstream)
    if "masters" in upstream:
        gm, wm = ours["masters"], upstream["masters"]
        if sorted(gm) != sorted(wm):
            diffs["masters"] = f"fp32 masters of {sorted(set(gm) ^ set(wm))} on one side only"
        elif any(not torch.equal(gm[n], wm[n]) for n in wm):
            worst = max(wm, key=lambda n: (gm[n] - wm[n]).abs().max().item())
            diffs["masters"] = f"fp32 masters: max abs difference {(gm[worst] - wm[worst]).abs().max().item():.3e} at {worst}"
    against = upstream.get("fixed", "upstream")
    if diffs:
        return _failed(f"differs from {against} in {sorted(diffs)}: " +
                       "; ".join(f"{k}: {v}" for k, v in sorted(diffs.items())))
    return _ok(f"bit-identical to {against}" + (", fp32 masters too" if upstream.get("masters") else ""))


# ------------------------------------------------------------------------------------- Trainer jobs
def _gas(entry) -> int:
    """The Trainer's gradient_accumulation_steps for the job: the config's own number where it has one,
    1 where it has none (Accelerate writes DeepSpeed's default then), else GAS."""
    if entry.driver == table.ACCELERATE:
        return int(entry.config["deepspeed_config"].get("gradient_accumulation_steps", GAS))
    value = entry.config.get("gradient_accumulation_steps", 1)
    return GAS if value == "auto" else int(value)


def launch_env(entry) -> dict:
    """The environment ``accelerate launch --config_file <yaml>`` gives the script for a DeepSpeed yaml (Accelerate's
    own launch functions on the entry's yaml): TrainingArguments builds its DeepSpeedPlugin from it."""
    return launcher_env(entry.config)


def trainer_job(trainer_cls, entry):
    """Train a tiny Llama STEPS updates under ``trainer_cls`` with ``entry``'s config; return (record, the
    DeepSpeed config the Trainer passed to initialize, its "auto" values filled), or raise."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    _fresh_process_state()
    model = causal_lm()
    env = launch_env(entry) if entry.driver == table.ACCELERATE else {}
    deepspeed = None if entry.driver == table.ACCELERATE else copy.deepcopy(entry.config)
    gas = _gas(entry)
    os.environ.update(env)
    try:
        args = _args(_shared_tmp(), gas, MAX_GRAD_NORM, deepspeed, max_steps=STEPS, bf16=entry.dtype == "bf16",
                     fp16=entry.dtype == "fp16")
        # 40 samples of 2 per rank: enough for STEPS updates at gas 4 on 2 ranks.
        trainer = trainer_cls(model=model, args=args, train_dataset=TokenData())
        logs, weights, trainer = _train(trainer)
        filled = copy.deepcopy(trainer.accelerator.state.deepspeed_plugin.deepspeed_config)
    finally:
        for key in env:
            os.environ.pop(key, None)
        unset_hf_deepspeed_config()
        _clear_ds_env()
    record = {key: [h.get(key) for h in logs] for key in ("loss", "grad_norm", "learning_rate")}
    record["step"] = [h["step"] for h in logs]
    record["weights"] = weights
    return record, filled


def _attempt(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - every outcome is reported, the next config still runs
        return e


# ----------------------------------------------------------------------------------- builder jobs
def _grouped(model, weight_decay=0.0):
    """The two parameter groups DeepSpeed-Chat and OpenRLHF pass (get_optimizer_grouped_parameters: no
    weight decay on biases and norms)."""
    no_decay = ("bias", "norm.weight")
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in params if not any(k in n for k in no_decay)], "weight_decay": weight_decay},
            {"params": [p for n, p in params if any(k in n for k in no_decay)], "weight_decay": 0.0}]


def _offloads_optimizer(config) -> bool:
    return ((config.get("zero_optimization", {}).get("offload_optimizer") or {}).get("device") or "none") != "none"


def builder_config(entry) -> dict:
    """``entry``'s config as its project passes it to initialize: OpenRLHF's strategy adds the batch sizes
    and the optimizer section (get_ds_train_config / get_ds_eval_config, its CLI's Adam defaults)."""
    cfg = copy.deepcopy(entry.config)
    if entry.name.startswith("openrlhf/"):
        cfg["train_micro_batch_size_per_gpu"] = INIT_MICRO
        cfg["train_batch_size"] = INIT_MICRO * dist.get_world_size() * INIT_GAS
        if not entry.frozen:
            cfg["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.95], "eps": 1e-8,
                                                           "weight_decay": 0.0}}
    return cfg


def builder_optimizer(entry, cfg, model, schedule=True):
    """(optimizer, model_parameters, lr_scheduler) as ``entry``'s project passes them to initialize.

    DeepSpeed-Chat: DeepSpeedCPUAdam with offload, else FusedAdam, betas (0.9, 0.95), its grouped
    parameters and a cosine schedule (its main.py defaults). FusedAdam needs a compiled op that the CPU
    machine does not build, so torch's AdamW (the same update) stands in for it. OpenRLHF: the
    optimizer from the config's section over its grouped parameters, a cosine-with-min-lr schedule."""
    from transformers import get_scheduler
    if "optimizer" in cfg:
        sched = partial(get_scheduler, "cosine_with_min_lr", num_warmup_steps=math.ceil(STEPS * 0.03),
                        num_training_steps=STEPS, scheduler_specific_kwargs={"min_lr_rate": 0.1})
        return None, _grouped(model), sched if schedule else None
    if _offloads_optimizer(cfg):
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        opt = DeepSpeedCPUAdam(_grouped(model), lr=LR, betas=(0.9, 0.95))
    else:
        opt = torch.optim.AdamW(_grouped(model), lr=LR, betas=(0.9, 0.95))
    sched = get_scheduler("cosine", optimizer=opt, num_warmup_steps=0, num_training_steps=STEPS) if schedule else None
    return opt, None, sched


def _ids(step, micro, rank=None):
    return tokens(_rank_data(step, rank), micro, SEQ)


def initialize_job(initialize, entry):
    """Train (or, frozen, run forwards of) a tiny Llama through ``initialize`` as ``entry``'s project does;
    return the record of what it did, or raise."""
    torch.manual_seed(0)
    model = causal_lm()
    cfg = builder_config(entry)
    micro = cfg["train_micro_batch_size_per_gpu"]
    if entry.frozen:
        engine = initialize(model=model, config=cfg)[0]
        record = {"loss": [], "logits": []}
        with torch.no_grad():
            for step in range(STEPS):
                ids = _ids(step, micro).to(engine.device)
                out = engine(input_ids=ids, labels=ids)
                record["loss"].append(out.loss.float().item())
                record["logits"].append(out.logits.detach().float().cpu())
        record["weights"] = _weights_of(engine)
        engine.destroy()
        return record
    opt, params, sched = builder_optimizer(entry, cfg, model)
    engine = initialize(model=model, optimizer=opt, model_parameters=params, lr_scheduler=sched, config=cfg)[0]
    gas = engine.gradient_accumulation_steps()
    restore = initialize is not deepspeed_multi_initialize() and _restore_loss_scale(engine)
    record = {"loss": [], "grad_norm": [], "lr": []}
    for step in range(STEPS * gas):
        ids = _ids(step, micro).to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        scale = engine._get_optimizer_loss_scale() if restore else 1.0
        engine.backward(loss * scale if restore else loss)
        engine.step()
        record["loss"].append(loss.float().item())
        if (step + 1) % gas == 0:
            norm = engine.get_global_grad_norm()
            record["grad_norm"].append(float(norm) / scale if norm is not None else None)
            record["lr"].append(list(engine.get_lr()))
    record["weights"] = _weights_of(engine)
    record["masters"] = masters_of(engine)
    if restore:
        record["fixed"] = "upstream with its fp16 ZeRO-0 loss scaling restored"
    engine.destroy()
    return record


def deepspeed_multi_initialize():
    import deepspeed_multi
    return deepspeed_multi.initialize


def _restore_loss_scale(engine) -> bool:
    """Upstream 0.19.8 at ZeRO-0 fp16 (DeepSpeed's FP16_Optimizer / FP16_UnfusedOptimizer): ``engine.backward``
    scales the loss for ZeRO optimizers only, while these optimizers' step divides the gradients by the loss
    scale, so every update is the scale times too small (SGD: drop_in_checks.fp16_zero0_norm_as_upstream). The
    upstream reference gets the loss scaled by hand, as DeepSpeed's own ``optimizer.backward`` does, and its
    unfused optimizer's kept norm (the scaled one) divided back, as ours keeps it."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    return engine.zero_optimization_stage() == 0 and isinstance(engine.optimizer, (FP16_Optimizer,
                                                                                  FP16_UnfusedOptimizer))


def masters_of(engine) -> dict:
    """Name -> the fp32 master DeepSpeed keeps for each parameter (``safe_get_full_fp32_param``), the same
    function for both sides' engines; empty where there are none (fp32, no optimizer)."""
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.utils import safe_get_full_fp32_param
    if engine.optimizer is None or isinstance(engine.optimizer, DeepSpeedZeRoOffload):
        return {}
    found = {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}
    return {n: v.detach().float().clone() for n, v in found.items() if v is not None}


# -------------------------------------------------------------------------------- two engines
_FROZEN = {}  # dtype -> the frozen ZeRO-3 reference engine every trained config of that dtype runs beside
FROZEN_SEED, TRAINED_SEED = 12, 11


def _frozen_reference(dtype):
    """One frozen ZeRO-3 MLP engine per dtype for the whole group (a reference model outlives the engines
    trained beside it, as in RLHF): built once, it saves a ZeRO-3 construction per config."""
    import deepspeed_multi
    if dtype not in _FROZEN:
        cfg = ds_config(3, dtype)
        _FROZEN[dtype] = (deepspeed_multi.initialize(model=MLP(seed=FROZEN_SEED).requires_grad_(False),
                                                     config=cfg)[0], cfg)
    return _FROZEN[dtype]


def _release_frozen():
    while _FROZEN:
        _FROZEN.popitem()[1][0].destroy()


def _client_optimizer(cfg, params, betas):
    """The client optimizer the job's driver builds: torch's AdamW, or DeepSpeedCPUAdam where the config
    offloads the optimizer without zero_force_ds_cpu_optimizer false (Accelerate swaps it in then, and
    DeepSpeed refuses any other)."""
    if _offloads_optimizer(cfg) and cfg.get("zero_force_ds_cpu_optimizer", True):
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        return DeepSpeedCPUAdam(params, lr=LR, betas=betas, weight_decay=0.0)
    return torch.optim.AdamW(params, lr=LR, betas=betas, weight_decay=0.0)


def _reference_optimizer(cfg, model, betas):
    """Plain PyTorch's optimizer and schedule for the trained model: what DeepSpeed builds from the config's
    sections, else the client optimizer's update (torch AdamW) at a constant learning rate."""
    if "optimizer" in cfg:
        from deepspeed.runtime import lr_schedules
        section = cfg["optimizer"]
        assert section["type"].lower() == "adamw", section
        p = section["params"]
        opt = torch.optim.AdamW(model.parameters(), lr=p["lr"], betas=tuple(p["betas"]), eps=p["eps"],
                                weight_decay=p["weight_decay"])
        sched = None
        if "scheduler" in cfg:
            sched = getattr(lr_schedules, cfg["scheduler"]["type"])(opt, **cfg["scheduler"]["params"])
        return opt, sched
    return torch.optim.AdamW(model.parameters(), lr=LR, betas=betas, weight_decay=0.0), None


def _stepped_at_construction(engine) -> bool:
    """Whether DeepSpeed stepped the client optimizer once, with zero gradients, while building the engine:
    its ZeRO-0 fp16/bf16 wrappers do (FP16_Optimizer and FP16_UnfusedOptimizer.initialize_optimizer_states
    set every gradient to zero and call optimizer.step()), upstream as ours. For AdamW that step counts:
    the first real update is bias-corrected as the second (measured: 0.744 of plain PyTorch's first
    AdamW step, every element) and the weights take one decay step. Plain PyTorch's counterpart takes the
    same zero-gradient step, so that the check measures the two-engine program and not this."""
    return engine.zero_optimization_stage() == 0 and type(engine.optimizer).__name__ in (
        "FP16_Optimizer", "FP16_UnfusedOptimizer")


def _program(models, x):
    """The trained model between two calls of the frozen one: it feeds the reference and is fed by it."""
    return models["ref"](models["trained"](models["ref"](x)))


def two_engines(entry, trained_cfg, frozen=None, betas=(0.9, 0.999)):
    """``trained_cfg``'s engine (through deepspeed_multi) inside ``ref(trained(ref(x)))`` with the frozen
    ``frozen`` = (engine, config) (the group's ZeRO-3 reference by default), one ``loss.backward()`` per
    micro-step, ``trained.step()`` after each; against plain PyTorch. Returns the outcome."""
    import deepspeed_multi
    dtype = entry.dtype
    frozen_engine, frozen_cfg = frozen or _frozen_reference(dtype)
    world, rank = dist.get_world_size(), dist.get_rank()
    trained_cfg = copy.deepcopy(trained_cfg)
    model = MLP(seed=TRAINED_SEED)
    if "optimizer" in trained_cfg:
        engine = deepspeed_multi.initialize(model=model, model_parameters=model.parameters(), config=trained_cfg)[0]
    else:
        engine = deepspeed_multi.initialize(model=model, optimizer=_client_optimizer(trained_cfg, model.parameters(),
                                                                                     betas), config=trained_cfg)[0]
    gas, clip = engine.gradient_accumulation_steps(), engine.gradient_clipping() or 0.0
    stepped = _stepped_at_construction(engine)
    engines = {"trained": engine, "ref": frozen_engine}
    applied = []
    try:
        for step in range(STEPS * gas):
            batch = default_batch(step, rank)
            x, y = batch["x"].to(engine.device), batch["y"].to(engine.device)
            ((_program(engines, x) - y) ** 2).mean().backward()
            engine.step()
            if (step + 1) % gas == 0:
                applied.append(engine.was_step_applied())
        # Reference: the same micro-batches of every rank, averaged; the window's mean gradient, clipped,
        # one update per window (none where the engine skipped one: an fp16 overflow).
        ref = {"trained": MLP(seed=TRAINED_SEED), "ref": MLP(seed=FROZEN_SEED).requires_grad_(False)}
        opt, sched = _reference_optimizer(trained_cfg, ref["trained"], betas)
        if stepped:
            for p in ref["trained"].parameters():
                p.grad = torch.zeros_like(p)
            opt.step()
            opt.zero_grad(set_to_none=True)
        for step in range(STEPS * gas):
            for r in range(world):
                batch = default_batch(step, r)
                (((_program(ref, batch["x"]) - batch["y"]) ** 2).mean() / world).backward()
            if (step + 1) % gas == 0:
                params = list(ref["trained"].parameters())
                for p in params:
                    p.grad.div_(gas)
                if clip > 0:
                    torch.nn.utils.clip_grad_norm_(params, clip)
                if applied[(step + 1) // gas - 1]:
                    opt.step()
                    if sched is not None:
                        sched.step()
                opt.zero_grad(set_to_none=True)
        want = {n: {k: v.detach().float().clone() for k, v in m.named_parameters()} for n, m in ref.items()}
        members = {"trained": Member(lambda: MLP(seed=TRAINED_SEED), trained_cfg),
                   "ref": Member(lambda: MLP(seed=FROZEN_SEED), frozen_cfg, trainable=False)}
        report = compare(engines, want, members, dtype)
    except AssertionError as e:
        return _failed(f"against plain PyTorch: {e}")
    finally:
        engine.destroy()
    if not any(applied):
        return _failed(f"the engine skipped every update ({applied}): nothing compared")
    err = report["trained"]
    what = f"max abs error {err:.1e}" if dtype == "fp32" else f"update cosine {err[0]:.4f}, norm ratio {err[1]:.4f}"
    init_step = ", and DeepSpeed's zero-gradient step at construction" if stepped else ""
    return _ok(f"matches plain PyTorch ({what}; gas {gas}, clipping {clip}, updates applied {applied}{init_step})")


def _autotp_size(cfg) -> int:
    return int((cfg.get("tensor_parallel") or {}).get("autotp_size", 1) or 1)


def _forget_autotp():
    """An AutoTP engine (and the Trainer's deepspeed.tp_model_init) leaves process-wide DeepSpeed state: the
    tensor/data-parallel groups in deepspeed.utils.groups, the recorded tp_model_init arguments, AutoTP's
    training mode. Left behind, every later engine of the pool function sees a data-parallel world of one
    (measured: "train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size 8 !=
    2 * 2 * 1", and "Data inconsistency within the TP group" on engines without tensor parallelism)."""
    from deepspeed.module_inject.layers import set_autotp_mode
    from deepspeed.runtime.tensor_parallel import init_utils
    from deepspeed.utils import groups
    groups.mpu = groups.mesh_device = None
    groups._TENSOR_MODEL_PARALLEL_GROUP = groups._MODEL_PARALLEL_GROUP = groups._DATA_PARALLEL_GROUP = None
    init_utils._TP_MODEL_INIT_ARGS = None
    set_autotp_mode(training=False)


def two_engines_autotp(entry, trained_cfg):
    """``two_engines`` for an AutoTP config: AutoTP shards models it has a policy for (an MLP has none:
    "Not able to determine model policy automatically"), so the trained engine is the tiny Llama, fed
    through ``inputs_embeds`` by a frozen ZeRO-3 MLP encoder; the ranks of a tensor-parallel block are one
    data-parallel replica, so both see the same batch (deepspeed_api_checks' AutoTP program, with the
    config's optimizer and clipping and the encoder frozen)."""
    import deepspeed_multi
    from deepspeed_api_checks import _autotp_full_params, _llama_batch
    dtype = entry.dtype
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype)
    torch.manual_seed(0)
    llm, enc = causal_lm(), MLP(d_in=8, d_hidden=32, d_out=16, seed=3).requires_grad_(False)
    ref_llm, ref_enc = copy.deepcopy(llm), copy.deepcopy(enc)
    initial = {n: p.detach().clone() for n, p in llm.named_parameters()}
    cfg = copy.deepcopy(trained_cfg)
    e_enc = deepspeed_multi.initialize(model=enc, config=ds_config(3, dtype))[0]
    e_llm = deepspeed_multi.initialize(model=llm, optimizer=_client_optimizer(cfg, llm.parameters(), (0.9, 0.999)),
                                       config=cfg)[0]
    gas, clip = e_llm.gradient_accumulation_steps(), e_llm.gradient_clipping() or 0.0
    try:
        for step in range(STEPS * gas):
            x, ids = _llama_batch(step)
            h = e_enc(x)
            e_llm(inputs_embeds=h if low is None else h.to(low), labels=ids).loss.backward()
            e_llm.step()
        got = _autotp_full_params(e_llm)
    finally:
        for e in (e_llm, e_enc):
            e.destroy()
        _forget_autotp()
    opt = torch.optim.AdamW(ref_llm.parameters(), lr=LR, weight_decay=0.0)
    for step in range(STEPS * gas):
        x, ids = _llama_batch(step)
        (ref_llm(inputs_embeds=ref_enc(x), labels=ids).loss / gas).backward()
        if (step + 1) % gas == 0:
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(list(ref_llm.parameters()), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
    want = {n: p.detach().float() for n, p in ref_llm.named_parameters()}
    if low is None:
        err = max((got[n] - want[n]).abs().max().item() for n in want)
        if err > FP32_TOL:
            return _failed(f"against plain PyTorch: AutoTP Llama max abs error {err:.3e} > {FP32_TOL}")
        return _ok(f"matches plain PyTorch (AutoTP Llama, max abs error {err:.1e}; gas {gas}, clipping {clip})")
    du = torch.cat([(got[n] - initial[n].to(low).float()).flatten() for n in want])
    dr = torch.cat([(want[n] - initial[n]).flatten() for n in want])
    cos, ratio = torch.nn.functional.cosine_similarity(du, dr, dim=0).item(), (du.norm() / dr.norm()).item()
    if not (cos > 0.99 and abs(ratio - 1) < 0.05):
        return _failed(f"against plain PyTorch: AutoTP Llama update cosine {cos:.4f} (want > 0.99), norm ratio "
                       f"{ratio:.4f} (want 1 +- 0.05)")
    return _ok(f"matches plain PyTorch (AutoTP Llama, update cosine {cos:.4f}, norm ratio {ratio:.4f}; gas {gas}, "
               f"clipping {clip})")


# --------------------------------------------------------------------------------------- groups
def _not_on_cpu(entry):
    return {"upstream": "not run: " + entry.not_on_cpu, "two_engines": "not run: " + entry.not_on_cpu}


def _trainer_config(entry):
    from transformers import Trainer

    from deepspeed_multi.transformers import Trainer as MultiTrainer
    autotp = _autotp_size(entry.config) > 1
    up = _attempt(trainer_job, Trainer, entry)
    if autotp:
        _forget_autotp()
    ours = _attempt(trainer_job, MultiTrainer, entry)
    if autotp:
        _forget_autotp()
    with initialize_swapped(True):  # the stock Trainer, deepspeed.initialize ours: the drop-in
        drop_in = _attempt(trainer_job, Trainer, entry)
    if autotp:
        _forget_autotp()
    upstream = up if isinstance(up, Exception) else up[0]
    out = {"upstream": _against_upstream(ours if isinstance(ours, Exception) else ours[0], upstream),
           "drop_in": _against_upstream(drop_in if isinstance(drop_in, Exception) else drop_in[0], upstream)}
    if isinstance(up, Exception):
        out["two_engines"] = f"not run: upstream refuses the config ({_error_text(up)})"
    elif autotp:
        out["two_engines"] = _attempt(two_engines_autotp, entry, up[1])
    else:
        # The config as the Trainer filled it, batch sizes and all, through deepspeed_multi.initialize.
        out["two_engines"] = _attempt(two_engines, entry, up[1])
    return out


def _initialize_config(entry):
    import deepspeed

    import deepspeed_multi
    up = _attempt(initialize_job, deepspeed.initialize, entry)
    ours = _attempt(initialize_job, deepspeed_multi.initialize, entry)
    out = {"upstream": _against_upstream(ours, up)}
    if entry.frozen and entry.stage in (1, 2) and isinstance(up, Exception) and "requires an optimizer" in str(up):
        # Upstream refuses ZeRO-1/2 without an optimizer; deepspeed_multi builds what it documents instead
        # (initialize.py: an inference-only engine at stage 0): the same forwards as upstream's at stage 0.
        zero = copy.deepcopy(entry.config)
        zero["zero_optimization"]["stage"] = 0
        at_zero = _attempt(initialize_job, deepspeed.initialize, replace(entry, config=zero))
        outcome = _against_upstream(ours, at_zero)
        out["upstream"] = f"{outcome} (against upstream at stage 0: upstream refuses the config itself, " \
                          f"{_error_text(up)}; ours builds an inference-only stage-0 engine)"
    if entry.frozen:
        # The eval config's engine is the frozen one, around the same builder's ZeRO-2 training config.
        partner = table.by_name(entry.name.split("/")[0] + "/train_stage2")
        cfg = builder_config(entry)
        frozen = _attempt(lambda: (deepspeed_multi.initialize(model=MLP(seed=FROZEN_SEED).requires_grad_(False),
                                                              config=copy.deepcopy(cfg))[0], cfg))
        if isinstance(frozen, Exception):
            out["two_engines"] = _failed(f"the eval config's engine: {_error_text(frozen)}")
        else:
            out["two_engines"] = _attempt(two_engines, partner, builder_config(partner), frozen, (0.9, 0.95))
            frozen[0].destroy()
    else:
        out["two_engines"] = _attempt(two_engines, entry, builder_config(entry), None, (0.9, 0.95))
    return out


def run_group(names):
    """Rank function: every config in ``names`` (distinct entries of shipped_configs), both checks each;
    returns {name: {"upstream": outcome, "two_engines": outcome, "seconds": wall time, "cpu_seconds": this rank's
    CPU time}}."""
    results = {}
    try:
        for name in names:
            entry = table.by_name(name)
            start, cpu = time.perf_counter(), time.process_time()
            if entry.not_on_cpu:
                out = _not_on_cpu(entry)
            elif entry.driver == table.INITIALIZE:
                out = _initialize_config(entry)
            else:
                out = _trainer_config(entry)
            out = {k: (_failed(f"raised {_error_text(v)}") if isinstance(v, Exception) else v) for k, v in out.items()}
            out["seconds"] = round(time.perf_counter() - start, 1)
            # This rank's CPU time: about the wall time on an idle machine (one rank a core, in parallel).
            out["cpu_seconds"] = round(time.process_time() - cpu, 1)
            results[name] = out
    finally:
        _release_frozen()
    return results


# ----------------------------------------------------------------------------------------- verdict
def judge(results) -> list:
    """The unexpected outcomes of ``results`` (run_group's), as messages naming the config and its
    sources: a failure no EXPECTED_FAILURES entry covers (config, check, and its text in the message),
    or an expected failure that did not fail (strict: remove its entry)."""
    expected = {(e.config, e.check): e for e in EXPECTED_FAILURES}
    bad = []
    for name, out in results.items():
        sources = ", ".join(table.by_name(name).sources)
        for check in CHECKS:
            if check not in out:  # (drop_in: Trainer configs only)
                continue
            outcome, exp = out[check], expected.get((name, check))
            if is_failure(outcome) and exp is not None and exp.text in outcome:
                continue
            if is_failure(outcome):
                note = f" (expected a failure with {exp.text!r}: {exp.reason})" if exp else ""
                bad.append(f"{name} [{check}] from {sources}: {outcome}{note}")
            elif exp is not None:
                bad.append(f"{name} [{check}] from {sources}: expected to fail ({exp.reason}) but passed: "
                           f"{outcome}; remove its EXPECTED_FAILURES entry")
    return bad


def summary(results) -> str:
    lines = []
    for name, out in results.items():
        lines.append(f"{name} ({out['seconds']} s, {out['cpu_seconds']} s CPU)")
        for check in CHECKS:
            if check in out:
                lines.append(f"    {check}: {out[check]}")
    return "\n".join(lines)
