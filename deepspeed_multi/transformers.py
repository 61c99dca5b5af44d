"""Transformers ``Trainer`` (and the TRL trainers built on it) over MultiEngines.

One change for the user: ``from deepspeed_multi.transformers import Trainer`` instead of
``transformers.Trainer``, or ``multi_engine_trainer(DPOTrainer)`` for any Trainer subclass; the
DeepSpeed config comes as before (``TrainingArguments(deepspeed=...)`` or ``accelerate launch``).
The trainer then builds a :class:`TrainerAccelerator` instead of ``accelerate.Accelerator``.
TRL's extra models get their own config with ``deepspeed_roles=`` (see [Note: a config per TRL
role]).

[Note: the Trainer owns gradient accumulation]
``Trainer`` runs its own accumulation: it divides each micro-batch's loss by its accumulation
count (or normalizes by the tokens of the window), calls ``accelerator.backward(loss,
scale_wrt_gas=False)`` for each micro-batch, then, once per window, ``clip_grad_norm_``,
``optimizer.step()``, the scheduler and ``model.zero_grad()``. A MultiEngine left to itself
would count each ``optimizer.step()`` as one micro-step of its ``gradient_accumulation_steps``
window and divide the loss again. So every engine prepared with an optimizer by a
TrainerAccelerator updates at each ``optimizer.step()`` on the gradients of the backward passes
since its last update, and applies no 1/gas of its own (its loss scale for fp16 stays).
``clip_grad_norm_`` is where Trainer reads the window's gradient norm, before its
``optimizer.step()``; DeepSpeed computes that norm (and clips at the config's
``gradient_clipping``) inside the update, so the update runs there, and the following
``optimizer.step()`` of that window does nothing, as under upstream DeepSpeed, where Accelerate
updates inside ``backward``.

[Note: a config per TRL role]
TRL's trainers build their extra models (the reference of DPO/GRPO/RLOO/KTO, GRPO's and RLOO's
reward models, the distillation teachers) with ``trl.models.prepare_deepspeed``, which copies
the policy's config, forces stage 0 unless the policy is at ZeRO-3 and calls
``deepspeed.initialize`` itself, so no role can have its own stage. A trainer built by
:func:`multi_engine_trainer` takes ``deepspeed_roles={"ref_model" | "reward_funcs" |
"teacher_model": config}``; while its ``__init__`` runs, the ``prepare_deepspeed`` that its TRL
module calls is swapped (``compat.swapped``, nothing copied) for one that prepares the model of a
named role through this Accelerator, frozen and without an optimizer, with the policy's config
(less its optimizer, scheduler and optimizer offload) under the role's. The engine then stays in
the Accelerator for the whole run (``free_memory`` keeps it). A model whose role is not named
gets TRL's own treatment. Where TRL then asks whether "DeepSpeed" is at ZeRO-3, the answer is the
model's own ([Note: TRL's one-config checks] in integrations/trl_stages.py).

[Note: role models in Trainer checkpoints]
A Trainer checkpoint holds the policy (its DeepSpeed checkpoint), never the reference, reward or
teacher models: "frozen" is taken to mean "unchanged". They do change: ``sync_ref_model=True`` mixes
the policy into DPO's reference every ``ref_model_sync_steps`` (TR-DPO), and a teacher may be an EMA.
A resumed TRL run (DDP or upstream DeepSpeed) then goes on with the reference the script builds,
the initial policy's weights, and leaves the uninterrupted run at the next step that reads it. Here
each role engine prepared without an optimizer (``ref_model``, ``teacher_model``,
``reward_funcs_<i>``) saves its parameters (at ZeRO-3 each rank's partitions) and this rank's
buffers into ``<checkpoint-N>/dsm_module_state/<role>/`` after the policy's checkpoint and before
``trainer_state.json``, and ``train(resume_from_checkpoint=...)`` loads them after the policy's
(checkpoint/module_state.py, same number of ranks). The policy's engine adds this rank's buffers
there (``model/``) when its module has persistent ones: DeepSpeed's checkpoint gives every rank
rank 0's ([Note: buffers rank by rank]); a model in parts saves them in its own set checkpoint. A
checkpoint without that folder (an earlier release) resumes as before, with a warning. The hooks are
``_save_optimizer_and_scheduler`` and ``_load_optimizer_and_scheduler``, which Trainer calls only
there, with the checkpoint's folder.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import glob
import logging
import math
import os
import sys


from . import compat
from .accelerate.accelerator import ENGINES, Accelerator
from .accelerate.wrappers import EngineOptimizer
from .config import enabled, load_config, merged
from .engine import MultiEngine
from .parts.engine import PartedEngine
from .integrations import trl_stages
from .integrations.engine_steps import caller_owns_accumulation
from .switches import ALLOW_UNTESTED_TRAINERS

logger = logging.getLogger(__name__)

# The releases (major.minor) deepspeed_multi.transformers is measured with (tests/multi_gpu/test_trainer.py):
# make test runs the newest in full (requirements-test.txt) and the oldest transformers beside the oldest
# DeepSpeed (Makefile: test-oldest).
TESTED = {"transformers": ("5.23", "5.24"), "trl": ("1.16",)}


def _refuse_second_model_under_sequence_parallelism(accelerator, args) -> None:
    """Under DeepSpeed sequence parallelism the Trainer computes the trained model's own language-model
    loss over the slices (``deepspeed_sp_compute_loss``); a trainer with more models (TRL's reference,
    reward or teacher) computes per-sequence quantities from them that each rank would see a slice of."""
    import torch
    pc = getattr(accelerator, "parallelism_config", None)
    if pc is None or pc.sp_backend != "deepspeed" or not pc.sp_enabled or not accelerator.engines():
        return
    models = [type(a).__name__ for a in args if isinstance(a, torch.nn.Module)]
    if not models:  # (the Trainer prepares its DataLoader after the model)
        return
    raise ValueError(
        f"deepspeed_multi.transformers: a second model ({', '.join(models)}) is prepared "
        f"beside {type(accelerator.engines()[0].module).__name__} under DeepSpeed sequence parallelism (sp_size "
        f"{pc.sp_size}). The Trainer's sequence-parallel loss covers the trained model's own language-model loss; "
        "TRL's trainers with a reference, reward or teacher model compute per-sequence quantities (DPO's "
        "log-probabilities, rewards, KL) from whole sequences, which each rank would see a slice of (upstream TRL "
        "supports DeepSpeed sequence parallelism in SFTTrainer only: GRPO, RLOO and Distillation refuse it, and DPO "
        "fails for want of position_ids). Train this job without parallelism_config, or with SFTTrainer; programs of "
        "several models on the sequence-parallel groups run through deepspeed_multi.accelerate.Accelerator.")


class TrainerAccelerator(Accelerator):
    """The Accelerator a Trainer builds: the Trainer owns accumulation (see the Note)."""

    def _prepare_deepspeed(self, *args):
        _refuse_second_model_under_sequence_parallelism(self, args)
        result = super()._prepare_deepspeed(*args)
        for obj in result:
            parts = obj.parts.values() if isinstance(obj, PartedEngine) else [obj]
            for engine in parts:
                if isinstance(engine, MultiEngine) and engine.has_optimizer:
                    caller_owns_accumulation(engine)
        return result

    def backward(self, loss, **kwargs):
        if self._managed_wrapper is not None:  # upstream's path, its scale_wrt_gas=False too
            return self._managed_backward(loss, **kwargs)
        if self._uses_deepspeed:
            if kwargs.pop("scale_wrt_gas", False):
                raise ValueError("backward(loss, scale_wrt_gas=True) under a Trainer: the Trainer divides the loss "
                                 "by its gradient accumulation itself, so the engines do not divide again. Pass "
                                 "the loss as Trainer.training_step computes it (scale_wrt_gas=False).")
        return super().backward(loss, **kwargs)

    def _optimizer_of(self, engine) -> EngineOptimizer:
        for opt in self._optimizers:
            if isinstance(opt, EngineOptimizer) and opt.engine is engine:
                return opt
        raise ValueError(f"clip_grad_norm_: {type(engine.module).__name__} was prepared without its optimizer; "
                         "prepare the model and its optimizer together.")

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """The gradient norm of the current window, clipped at the config's ``gradient_clipping``.

        ``max_norm=inf`` asks for the norm without clipping (the Trainer does so when
        ``max_grad_norm`` is 0). The update runs here (see the Note).
        """
        if not self._uses_deepspeed or self._managed_wrapper is not None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        parameters = list(parameters)
        optimizer = self._optimizer_of(self._engine_of("clip_grad_norm_", params=parameters))
        if optimizer.updated_early:
            # Asked again in the window: the Trainer asks with max_norm=inf when its first call returned no norm
            # (fp32 at ZeRO stage 0). The update has run; its norm again, as upstream's engine returns it.
            return optimizer.last_norm()
        if not math.isinf(max_norm):
            engine = self._clipping_engine(parameters, max_norm, norm_type,
                                           f"Set \"gradient_clipping\": \"auto\" (or {max_norm}) in its config.")
        else:
            engine = self._engine_of("clip_grad_norm_", params=list(parameters))
            configured = engine.gradient_clipping()
            if configured:
                raise ValueError(
                    f"clip_grad_norm_(max_norm=inf) for {type(engine.module).__name__}: the Trainer asks for the norm "
                    f"without clipping (TrainingArguments.max_grad_norm is 0), but this engine's DeepSpeed config "
                    f"clips at gradient_clipping={configured}. Set TrainingArguments(max_grad_norm={configured}), or "
                    "\"gradient_clipping\": \"auto\" (or 0) in the config.")
        return self._optimizer_of(engine).update_for_norm()


    def _kept_engines(self) -> list:
        """``free_memory`` (the Trainer calls it as ``train()`` starts) keeps the models of TRL roles,
        prepared in the trainer's ``__init__``, for the whole run."""
        return [m for m in self._models if getattr(m, "_dsm_role", None)]


# ---------------------------------------------------------------------------- TRL roles
ROLES = ("ref_model", "reward_funcs", "teacher_model")


def _role_of(trainer, model) -> str:
    if model is getattr(trainer, "ref_model", None):
        return "ref_model"
    if any(model is f for f in getattr(trainer, "reward_funcs", None) or ()):
        return "reward_funcs"
    if model is getattr(trainer, "model", None):
        return "model"
    return "teacher_model"  # the distillation trainers pass it before assigning it


_FROZEN_ONLY = ("optimizer", "scheduler")           # a role model is prepared without an optimizer
_BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_PRECISIONS = ("fp16", "bf16")


def role_config(accelerator, given: dict, role: str = "ref_model") -> dict:
    """The policy's DeepSpeed config without its training-only sections, with the role's over it.

    A role may name its own stage, precision, offload of parameters, bucket sizes. Refused, before
    any step: sections that only a trained model uses (the role is frozen), a batch geometry other
    than the policy's (the trainer feeds every model the same micro-batches), and fp16 and bf16
    both on. A role that turns one precision on runs in it alone: the policy's other one is dropped.
    """
    given = copy.deepcopy(load_config(given))
    policy = accelerator.state.deepspeed_plugin.deepspeed_config
    for key in _BATCH:  # "auto" in a role: the policy's (the trainer has filled them in)
        if given.get(key) == "auto":
            given.pop(key)
    where = f"deepspeed_roles[{role!r}]"
    frozen_only = [k for k in _FROZEN_ONLY if k in given]
    frozen_only += ["zero_optimization.offload_optimizer"] * ("offload_optimizer" in given.get("zero_optimization", {}))
    if frozen_only:
        raise ValueError(f"{where} sets {frozen_only}: the trainer's {role} is frozen (prepared without an optimizer), "
                         "so these would do nothing. Drop them from the role's config; the policy's optimizer "
                         "settings belong in TrainingArguments(deepspeed=...).")
    for key in _BATCH:
        mine, theirs = given.get(key, "auto"), policy.get(key, "auto")
        if mine != "auto" and theirs != "auto" and mine != theirs:
            raise ValueError(f"{where} sets {key}={mine!r} but the policy's config has {key}={theirs!r}: the trainer "
                             f"feeds the {role} the policy's micro-batches. Drop {key} from the role's config.")
    precisions = [p for p in _PRECISIONS if enabled(given.get(p))]
    if len(precisions) > 1:
        raise ValueError(f"{where} enables both fp16 and bf16; a model runs in one. Enable one of them.")
    base = copy.deepcopy(policy)
    for key in _FROZEN_ONLY:
        base.pop(key, None)
    base.get("zero_optimization", {}).pop("offload_optimizer", None)
    for other in set(_PRECISIONS) - set(precisions) if precisions else ():
        base.pop(other, None)
    return merged(base, given)


def _prepare_role(trainer, original):
    """TRL's ``prepare_deepspeed`` for a trainer built with ``deepspeed_roles`` ([Note: a config per TRL role])."""
    def prepare_deepspeed(model, accelerator):
        role = _role_of(trainer, model)
        given = trainer._dsm_roles.get(role)
        if given is None:
            return original(model, accelerator)
        model.requires_grad_(False)
        engine = accelerator.prepare(model, deepspeed_plugin=role_config(accelerator, given, role))
        engine._dsm_role = role
        engine.eval()
        return engine
    return prepare_deepspeed


def _init(self, *args, deepspeed_roles=None, **kwargs):
    roles = dict(deepspeed_roles or {})
    unknown = sorted(set(roles) - set(ROLES))
    if unknown:
        raise ValueError(f"{type(self).__name__}(deepspeed_roles=...): unknown role(s) {unknown}; the roles are "
                         f"{list(ROLES)} (the trainer's reference, reward and teacher models).")
    self._dsm_roles = roles
    modules = {sys.modules[c.__module__] for c in type(self).__mro__
               if "prepare_deepspeed" in vars(sys.modules.get(c.__module__, object()))}
    if roles and not modules:
        raise ValueError(f"{type(self).__name__}(deepspeed_roles=...): this trainer prepares no extra models "
                         "with DeepSpeed (it does not use TRL's prepare_deepspeed); drop deepspeed_roles.")
    with contextlib.ExitStack() as stack:
        for module in modules:
            stack.enter_context(compat.swapped(module, "prepare_deepspeed",
                                               _prepare_role(self, module.prepare_deepspeed)))
        self._dsm_base.__init__(self, *args, **kwargs)
    trl_stages.fix_sync_callbacks(self)
    for role in roles:
        if role != "teacher_model" and not getattr(self, role, None):
            raise ValueError(f"{type(self).__name__}(deepspeed_roles={{{role!r}: ...}}): this trainer has no "
                             f"{role} (it is None or absent here); drop that role.")


def _create_accelerator_and_postprocess(self):
    import transformers.trainer as hf_trainer
    with compat.swapped(hf_trainer, "Accelerator", TrainerAccelerator):
        return self._dsm_base.create_accelerator_and_postprocess(self)


def _per_model_zero3(name):
    """``cls.<name>`` with TRL's ZeRO-3 checks answered per model ([Note: TRL's one-config checks])."""
    def method(self, *args, **kwargs):
        with trl_stages.per_model_zero3():
            return getattr(self._dsm_base, name)(self, *args, **kwargs)
    method.__name__ = method.__qualname__ = name
    return method


def _train(self, *args, **kwargs):
    """``cls.train``: after ``evaluate()``/``predict()`` as under DDP; refused a second time on the same
    trainer (see the message)."""
    previous = self.model_wrapped
    if isinstance(previous, ENGINES) and not previous.has_optimizer:
        # evaluate()/predict() before train() (ZeRO-3) built an inference engine; the Trainer would train
        # through it (upstream: AttributeError at the first backward). train()'s free_memory destroys it.
        self.model_wrapped, self.deepspeed = self.model, None
    elif isinstance(previous, ENGINES):
        raise RuntimeError(
            f"{type(self).__name__}.train() was already called on this trainer, and built its DeepSpeed engine. "
            "A second train() on the same Trainer is not supported under DeepSpeed: transformers' deepspeed_init "
            "builds a new optimizer for it, where a DDP Trainer's second train() keeps the first one's optimizer "
            "state (upstream DeepSpeed fails here too). To train longer, raise num_train_epochs or max_steps and "
            "resume from a checkpoint (train(resume_from_checkpoint=...) in a new Trainer continues the optimizer "
            "state); to start a new run from these weights, call trainer.model_wrapped.destroy() and build a new "
            "Trainer over trainer.model.")
    with trl_stages.per_model_zero3():
        return self._dsm_base.train(self, *args, **kwargs)


# ---------------------------------------------------------------------------- checkpoints
STATE_DIR = "dsm_module_state"


def _state_engines(trainer) -> dict:
    """Name -> engine whose module state a Trainer checkpoint leaves out ([Note: role models in Trainer
    checkpoints]): the role engines without an optimizer, and the policy's engine if it has buffers."""
    out = {}
    for role in ROLES:
        value = getattr(trainer, role, None)
        items = enumerate(value) if role == "reward_funcs" and isinstance(value, (list, tuple)) else [(None, value)]
        for i, engine in items:
            if isinstance(engine, MultiEngine) and not engine.has_optimizer:
                out[role if i is None else f"{role}_{i}"] = engine
    policy = trainer.model_wrapped
    if isinstance(policy, MultiEngine) and policy.has_optimizer:
        from .checkpoint import module_state
        if module_state.persistent_buffers(policy.module):
            out["model"] = policy
    return out


def _save_optimizer_and_scheduler(self, output_dir):
    self._dsm_base._save_optimizer_and_scheduler(self, output_dir)
    from .checkpoint import module_state
    for name, engine in _state_engines(self).items():
        module_state.save_engine_state(engine, os.path.join(output_dir, STATE_DIR, name))


def _load_optimizer_and_scheduler(self, checkpoint):
    self._dsm_base._load_optimizer_and_scheduler(self, checkpoint)
    engines = _state_engines(self) if checkpoint is not None else {}
    if not engines:
        return
    from .checkpoint import module_state
    from .checkpoint.files import raise_if_any
    import deepspeed.comm as dist
    saved = {n: os.path.join(checkpoint, STATE_DIR, n) for n in engines}
    missing = [n for n, d in saved.items() if not os.path.isdir(d)]
    # DeepSpeed's load gave every rank rank 0's buffers; on another number of ranks the policy keeps those.
    other_world = [n for n, d in saved.items() if n == "model" and n not in missing
                   and len(glob.glob(os.path.join(d, "dsm_module_state_rank*.pt"))) != dist.get_world_size()]
    if (missing or other_world) and dist.get_rank() == 0:
        if missing:
            logger.warning("deepspeed_multi: %s holds no state of %s (%s is missing: saved by an earlier release); "
                           "they resume as this script built them.", checkpoint, missing, STATE_DIR)
        if other_world:
            logger.warning("deepspeed_multi: %s was saved on another number of ranks; every rank of the trained "
                           "model resumes with rank 0's buffers.", checkpoint)
    error = None
    for name, engine in engines.items():
        if error is None and name not in missing + other_world:
            error = module_state.load_engine_state(engine, saved[name], name)
    raise_if_any(f"deepspeed_multi: resume_from_checkpoint={checkpoint!r}: {error}" if error else None)


def check_versions(cls) -> None:
    """The Trainer code paths this module relies on are those of the tested releases (TESTED)."""
    import importlib.metadata as md
    packages = ["transformers"] + (["trl"] if cls.__module__.split(".")[0] == "trl" else [])
    for package in packages:
        compat.check_tested_release(
            "deepspeed_multi.transformers", package, md.version(package), TESTED[package], "trl",
            ALLOW_UNTESTED_TRAINERS, f"{cls.__name__} anyway (compare its losses with a DDP run first: the Trainer's "
            "accumulation and clipping calls are what this integration depends on)")


@functools.lru_cache(maxsize=None)
def multi_engine_trainer(cls):
    """``cls`` (``transformers.Trainer`` or a subclass, e.g. TRL's ``DPOTrainer``) on MultiEngines.

    Built once per class, as ``MultiEngine<cls>``; the DeepSpeed config is given as for ``cls``.
    """
    import transformers
    if not (isinstance(cls, type) and issubclass(cls, transformers.Trainer)):
        raise TypeError(f"multi_engine_trainer: expected transformers.Trainer or a subclass of it, got {cls!r}.")
    check_versions(cls)
    return type(f"MultiEngine{cls.__name__}", (cls,), {
        "__doc__": f"{cls.__name__} whose DeepSpeed models are MultiEngines (deepspeed_multi.transformers).",
        "__module__": __name__,
        "_dsm_base": cls,
        "__init__": _init,
        "create_accelerator_and_postprocess": _create_accelerator_and_postprocess,
        "train": _train,
        "_save_optimizer_and_scheduler": _save_optimizer_and_scheduler,
        "_load_optimizer_and_scheduler": _load_optimizer_and_scheduler,
        **{name: _per_model_zero3(name) for name in ("evaluate", "predict")},
    })


def __getattr__(name):
    if name == "Trainer":  # built on first use, so importing this module does not import transformers
        import transformers
        return multi_engine_trainer(transformers.Trainer)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
