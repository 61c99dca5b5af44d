"""Transformers ``Trainer`` (and the TRL trainers built on it) over MultiEngines.

One change for the user: import the Trainer from here instead of ``transformers``, or build any
Trainer subclass (every TRL trainer) with :func:`multi_engine_trainer`. The DeepSpeed config comes
as before (``TrainingArguments(deepspeed=...)`` or ``accelerate launch``); TRL's extra models may
get their own with ``deepspeed_roles=``:

```python
from deepspeed_multi.transformers import Trainer, multi_engine_trainer

Trainer(model=model, args=TrainingArguments(..., deepspeed="ds_zero2.json"), train_dataset=ds).train()

multi_engine_trainer(DPOTrainer)(
    model=policy, ref_model=reference, args=DPOConfig(..., deepspeed="ds_zero2.json"),
    train_dataset=pairs, processing_class=tokenizer,
    deepspeed_roles={"ref_model": {"zero_optimization": {"stage": 3}}}).train()
```

The trainer builds a :class:`TrainerAccelerator` instead of ``accelerate.Accelerator``. Each
role's config is :func:`role_config`'s
([Note: a config per TRL role] in integrations/trl_roles.py), and a Trainer checkpoint also holds
the role models' state
([Note: role models in Trainer checkpoints] in integrations/trainer_state.py). ``TESTED`` holds
the releases (major.minor) of transformers and TRL this module is measured with;
:func:`check_versions` refuses others unless ``DSM_ALLOW_UNTESTED_TRAINERS=1``.
"""
from __future__ import annotations

import contextlib
import functools
import math
import sys


from . import compat
from .accelerate.accelerator import ENGINES, Accelerator
from .accelerate.wrappers import EngineOptimizer
from .engine import MultiEngine
from .parts.engine import PartedEngine
from .integrations import trainer_state, trl_roles, trl_stages
from .integrations.trainer_state import STATE_DIR  # noqa: F401 (the checkpoint folder's name, read by tests)
from .integrations.trl_roles import ROLES, role_config
from .integrations.engine_steps import caller_owns_accumulation
from .switches import ALLOW_UNTESTED_TRAINERS

# The releases (major.minor) deepspeed_multi.transformers is measured with (tests/multi_gpu/test_trainer.py):
# make test runs the newest in full (requirements-test.txt) and the oldest transformers beside the oldest
# DeepSpeed (Makefile: test-oldest).
TESTED = {"transformers": ("5.23", "5.24"), "trl": ("1.16",)}

__all__ = ["TESTED", "Trainer", "TrainerAccelerator", "check_versions", "multi_engine_trainer", "role_config"]


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
    """The Accelerator a Trainer built by :func:`multi_engine_trainer` uses: the Trainer owns accumulation.

    The Trainer builds it in ``create_accelerator_and_postprocess``, with the arguments it gives
    ``accelerate.Accelerator``; a script has no need to build one itself.

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
    """

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
        """One backward through every engine ``loss`` reaches, taking the Trainer's ``scale_wrt_gas=False``.

        The base class refuses ``scale_wrt_gas=False`` (its engines divide by their own accumulation); here
        the Trainer has divided the loss (see the Note), so the flag is dropped and ``scale_wrt_gas=True``
        is refused instead. An engine on DeepSpeed's managed path runs Accelerate's own backward, as upstream.

        Args:
            loss (torch.Tensor): the loss as ``Trainer.training_step`` computes it.
            **kwargs: passed on to the backward (``scale_wrt_gas`` taken out first under DeepSpeed).

        Returns:
            What the base class's ``backward`` returns (None under DeepSpeed).

        Raises:
            ValueError: when ``scale_wrt_gas=True`` is passed under DeepSpeed: the loss would be divided twice.
        """
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
        """Run the window's update here and return its gradient norm, clipped at the config's ``gradient_clipping``.

        The base class returns the norm of the last update; the Trainer reads this window's norm
        before its ``optimizer.step()``, so the update runs here and that ``step()`` does nothing (see
        the Note). A second call in the same window returns the same norm. Without DeepSpeed, or for
        an engine on DeepSpeed's managed path, it is the base class's.

        Args:
            parameters: the parameters of one prepared model (``model.parameters()``).
            max_norm (float): the config's ``gradient_clipping``; ``inf`` asks for the norm without
                clipping (the Trainer passes it when ``max_grad_norm`` is 0).
            norm_type (float): 2, the norm DeepSpeed clips.

        Returns:
            The gradient norm DeepSpeed computed in the update (a tensor at ZeRO 1-3, a float from the
                bf16/fp16 optimizers at stage 0, None in fp32 at stage 0, where DeepSpeed keeps none).

        Raises:
            ValueError: when ``parameters`` do not all belong to one prepared model, when that model was
                prepared without its optimizer, when a finite ``max_norm`` (or ``norm_type``) is not the
                config's 2-norm clipping, or when ``max_norm`` is ``inf`` but the config clips.
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
                                               trl_roles.prepare_role(self, module.prepare_deepspeed)))
        self._dsm_base.__init__(self, *args, **kwargs)
    trl_stages.fix_sync_callbacks(self)
    for role in roles:
        if role != "teacher_model" and not getattr(self, role, None):
            raise ValueError(f"{type(self).__name__}(deepspeed_roles={{{role!r}: ...}}): this trainer has no "
                             f"{role} (it is None or absent here); drop that role.")


def _create_accelerator_and_postprocess(self):
    """``cls.create_accelerator_and_postprocess``, building a :class:`TrainerAccelerator` instead of Accelerate's.

    Returns:
        What ``cls.create_accelerator_and_postprocess`` returns (None in the tested releases).
    """
    import transformers.trainer as hf_trainer
    with compat.swapped(hf_trainer, "Accelerator", TrainerAccelerator):
        return self._dsm_base.create_accelerator_and_postprocess(self)


def _per_model_zero3(name):
    """``cls.<name>`` with TRL's ZeRO-3 checks answered per model ([Note: TRL's one-config checks])."""
    def method(self, *args, **kwargs):
        """The base class's method, with TRL's ZeRO-3 checks answered per model ([Note: TRL's one-config checks])."""
        with trl_stages.per_model_zero3():
            return getattr(self._dsm_base, name)(self, *args, **kwargs)
    method.__name__ = method.__qualname__ = name
    return method


def _train(self, *args, **kwargs):
    """Train as ``cls.train`` does, with TRL's ZeRO-3 checks answered per model.

    After ``evaluate()``/``predict()`` (which build an inference engine at ZeRO-3) it trains as under
    DDP; a second ``train()`` on the same trainer is refused (see the message).

    Args:
        *args: ``cls.train``'s positional arguments (``resume_from_checkpoint``, ...).
        **kwargs: ``cls.train``'s keyword arguments.

    Returns:
        What ``cls.train`` returns (a ``TrainOutput``).

    Raises:
        RuntimeError: when ``train()`` already ran on this trainer and built its DeepSpeed engine.
    """
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
def _save_optimizer_and_scheduler(self, output_dir):
    self._dsm_base._save_optimizer_and_scheduler(self, output_dir)
    trainer_state.save_state(self, output_dir, ROLES)   # [Note: role models in Trainer checkpoints]


def _load_optimizer_and_scheduler(self, checkpoint):
    self._dsm_base._load_optimizer_and_scheduler(self, checkpoint)
    trainer_state.load_state(self, checkpoint, ROLES)


def check_versions(cls) -> None:
    """Refuse a transformers release (and, for a TRL trainer, a TRL release) other than the tested ones.

    The Trainer code paths this module relies on are those of the releases in ``TESTED`` (major.minor);
    ``DSM_ALLOW_UNTESTED_TRAINERS=1`` runs another anyway. :func:`multi_engine_trainer` calls it.

    Args:
        cls (type): the Trainer class to build on; TRL is checked too when ``cls`` comes from ``trl``.

    Raises:
        RuntimeError: when an installed release is not one in ``TESTED`` and the switch is off; the message
            names the tested releases, the installed one and the switch.
    """
    import importlib.metadata as md
    packages = ["transformers"] + (["trl"] if cls.__module__.split(".")[0] == "trl" else [])
    for package in packages:
        compat.check_tested_release(
            "deepspeed_multi.transformers", package, md.version(package), TESTED[package], "trl",
            ALLOW_UNTESTED_TRAINERS, f"{cls.__name__} anyway (compare its losses with a DDP run first: the Trainer's "
            "accumulation and clipping calls are what this integration depends on)")


@functools.lru_cache(maxsize=None)
def multi_engine_trainer(cls):
    """Build ``cls`` (``transformers.Trainer`` or a subclass, e.g. TRL's ``DPOTrainer``) on MultiEngines.

    Built once per class, as ``MultiEngine<cls>``; the DeepSpeed config is given as for ``cls``, and
    the trainer takes one more argument, ``deepspeed_roles``.

    Each model named in ``deepspeed_roles`` is prepared frozen, without an optimizer, with
    :func:`role_config`'s config, and stays prepared for the whole run; other models get TRL's own
    treatment ([Note: a config per TRL role] in integrations/trl_roles.py).

    Args:
        cls (type): ``transformers.Trainer`` or a subclass of it.

    Returns:
        type: ``MultiEngine<cls>``, a subclass of ``cls`` (the same class on every call with that ``cls``).

    Raises:
        TypeError: when ``cls`` is not ``transformers.Trainer`` or a subclass of it.
        RuntimeError: when the installed transformers (or TRL) is not a tested release (:func:`check_versions`).
    """
    import transformers
    if not (isinstance(cls, type) and issubclass(cls, transformers.Trainer)):
        raise TypeError(f"multi_engine_trainer: expected transformers.Trainer or a subclass of it, got {cls!r}.")
    check_versions(cls)
    return type(f"MultiEngine{cls.__name__}", (cls,), {
        "__doc__": f"{cls.__name__} whose DeepSpeed models are MultiEngines (deepspeed_multi.transformers).\n\n"
                   "Takes the arguments of the class it is built on, and ``deepspeed_roles``: role (``ref_model``, "
                   "``reward_funcs``, ``teacher_model``) -> that model's DeepSpeed config (dict or JSON path), over "
                   "the policy's (``role_config``). An unknown role, or one this trainer has no model for, is refused "
                   "(ValueError).",
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
