"""``MultiDeepSpeedStrategy``: a Fabric strategy whose every ``fabric.setup`` builds a MultiEngine.

Differences from Lightning's ``DeepSpeedStrategy`` (its config arguments are accepted as they are):

* ``fabric.setup(model, optimizer)`` may be called for any number of models, each with its own
  config ([Note: a config per model under Lightning] in configs.py); ``fabric.setup(model)`` (or
  ``setup_module``) gives a frozen engine at any ZeRO stage.
* ``fabric.backward(loss)`` (or ``loss.backward()``) is one backward through every engine the
  loss reaches; each optimizer's ``step()``/``zero_grad()`` is its own engine's.
* The loop owns gradient accumulation, as under DDP ([Note: the caller owns gradient
  accumulation] in integrations/engine_steps.py); ``fabric.no_backward_sync(model)`` is accepted
  and changes nothing: ZeRO-0/1 engines reduce at the update only, ZeRO-2/3 engines reduce-scatter
  in every backward to partition their gradients, exact either way.
* ``model.zero_grad()`` on what ``fabric.setup`` returned clears the engine's gradients too
  ([Note: zero_grad() on a model that holds an engine] in zero_grad.py).
* ``fabric.clip_gradients(model, optimizer, max_norm=x)`` returns the gradient norm of that
  model's update, which runs there (DeepSpeed clips inside the update, at the config's
  ``gradient_clipping``, which must be x); the ``optimizer.step()`` after it does nothing.
* ``fabric.save``/``fabric.load`` with several engines in the state write and read one set
  checkpoint (``deepspeed_multi.save_checkpoint``), atomic across engines and ranks; the other
  entries of the state travel as its client state.
* ``fabric.init_module()`` partitions at construction when the strategy's config is ZeRO-3;
  ``fabric.strategy.init_module("ClassName")`` does so by that model's own config.
* Runs on CPU too (``DS_ACCELERATOR=cpu``, gloo), with Fabric's ``accelerator="cpu"``.

[Note: why the strategy is a DDPStrategy and not a DeepSpeedStrategy]
Fabric treats a ``DeepSpeedStrategy`` as one engine: ``fabric.backward(loss)`` refuses to run
once two models are set up unless given ``model=``, and the optimizer wrapper steps whatever
engine the strategy's ``model`` was last set to. Neither holds for several engines, and both
checks are ``isinstance`` tests in Fabric itself. So the strategy derives from the DDP strategy
(process group, launcher, sampler), keeps a Lightning ``DeepSpeedStrategy`` for the config it
builds from its arguments, and uses Lightning's ``DeepSpeedPrecision`` with the plain backward
(``loss.backward()``, which drives every engine).
"""
import argparse
import contextlib
import os
import weakref
from datetime import timedelta
from typing import Any, Optional

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.plugins.precision.deepspeed import DeepSpeedPrecision
from lightning.fabric.strategies.ddp import DDPStrategy
from lightning.fabric.strategies.deepspeed import DeepSpeedStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.load import _move_state_into

from .. import checkpoint as set_checkpoint
from ..engine import MultiEngine
from ..config import zero_stage
from ..initialize import initialize
from ..integrations.zero_init import zero_init
from ..integrations.engine_steps import EngineSteps, caller_owns_accumulation, refuse_other_clipping
from . import configs as per_model
from .configs import with_config
from .versions import check_lightning
from .zero_grad import WrapperWatch

__all__ = ["MultiDeepSpeedStrategy", "with_config"]


class EnginePrecision(DeepSpeedPrecision):
    """Lightning's DeepSpeed precision (dtype conversion of modules and inputs), with the plain
    backward: ``loss.backward()`` runs every engine's hooks, so ``fabric.backward`` and a direct
    ``loss.backward()`` are the same call."""
    backward = Precision.backward


class EngineOptimizer(EngineSteps):
    """What ``fabric.setup`` returns for a model's optimizer: ``step()``/``zero_grad()`` are its engine's."""

    def __init__(self, optimizer, engine):
        self.optimizer = optimizer
        self._init_engine_steps(engine)

    def __getattr__(self, name):   # param_groups, state, ... of the engine's optimizer
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)


class _EngineSyncControl(_BackwardSyncControl):
    def no_backward_sync(self, module, enabled):
        if not isinstance(module, MultiEngine):
            raise TypeError(f"fabric.no_backward_sync: {type(module).__name__} was not set up by "
                            "MultiDeepSpeedStrategy; pass the model that fabric.setup returned.")
        return contextlib.nullcontext()   # exact without it (see the module doc)


class MultiDeepSpeedStrategy(DDPStrategy):
    """Fabric strategy for several DeepSpeed models, each with its own config (see the module doc).

    Args:
        config (dict or str): the DeepSpeed config (dict or JSON path) every model starts from; without
            it, Lightning's defaults from the other arguments (``stage=2``, ...), as ``DeepSpeedStrategy``.
        configs (dict): model class name -> that model's own config, merged over ``config``.
        accelerator: as for Lightning's ``DDPStrategy``.
        parallel_devices: as for ``DDPStrategy``.
        cluster_environment: as for ``DDPStrategy``.
        precision: as for ``DDPStrategy``; Fabric's choice becomes Lightning's DeepSpeed precision.
        process_group_backend (str): as for ``DDPStrategy``.
        timeout (timedelta): as for ``DDPStrategy``; DeepSpeed's process group gets it too.
        **deepspeed_kwargs: the other arguments of Lightning's ``DeepSpeedStrategy`` (``stage``,
            ``offload_optimizer``, ``loss_scale``, ...), which build ``config`` when none is given.

    Raises:
        TypeError: when ``configs`` is not a dict keyed by class names.
        RuntimeError: when the installed Lightning is not a tested release (``check_lightning``).
    """

    def __init__(self, config=None, configs: Optional[dict] = None, accelerator=None, parallel_devices=None,
                 cluster_environment=None, precision=None, process_group_backend: Optional[str] = None,
                 timeout: Optional[timedelta] = default_pg_timeout, **deepspeed_kwargs: Any):
        check_lightning()
        # Lightning's DeepSpeedStrategy builds the config from its arguments (defaults included).
        self._template = DeepSpeedStrategy(config=config, **deepspeed_kwargs)
        self._by_class = per_model.check_by_class(configs)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision=precision,
                         process_group_backend=process_group_backend, timeout=timeout)
        self._backward_sync_control = _EngineSyncControl()
        self._engines = []                     # in the order set up
        self._set_up = weakref.WeakSet()       # the modules given to setup, to refuse a second setup
        self._wrapper_watch = WrapperWatch()   # model.zero_grad() reaches the engine (zero_grad.py)

    @property
    def config(self) -> dict:
        """The strategy's DeepSpeed config, which every model's own config is merged over."""
        return self._template.config

    @property
    def engines(self) -> list:
        """The engines ``fabric.setup`` built so far, in order (a new list)."""
        return list(self._engines)

    # ------------------------------------------------------------------ precision
    @property
    def precision(self) -> EnginePrecision:
        """Lightning's DeepSpeed precision plugin, with the plain backward (fp32 when none was chosen).

        Fabric's connector picks ``DeepSpeedPrecision`` only for a ``DeepSpeedStrategy``; what it sets
        here is converted to one.
        """
        return self._precision if self._precision is not None else EnginePrecision("32-true")

    @precision.setter
    def precision(self, precision) -> None:
        # Fabric's connector picks DeepSpeedPrecision only for a DeepSpeedStrategy: convert its choice.
        if precision is not None and not isinstance(precision, EnginePrecision):
            precision = EnginePrecision(precision.precision)
        self._precision = precision

    # ------------------------------------------------------------------ environment
    def setup_environment(self) -> None:
        """DDP's set-up, and DeepSpeed's distributed set-up on its process group.

        Refused first (RuntimeError) when Fabric's device is not DeepSpeed's accelerator: on a machine
        without GPUs, ``DS_ACCELERATOR=cpu`` with ``Fabric(accelerator="cpu")``.
        """
        from deepspeed.accelerator import get_accelerator
        wanted = get_accelerator().device_name()
        have = self.root_device.type
        if have != wanted:
            raise RuntimeError(
                f"MultiDeepSpeedStrategy: Fabric runs on {have!r} but DeepSpeed's accelerator is {wanted!r}. On a "
                "machine without GPUs set DS_ACCELERATOR=cpu and Fabric(accelerator='cpu'); on GPUs use "
                "Fabric(accelerator='cuda') and leave DS_ACCELERATOR unset.")
        super().setup_environment()

    def _setup_distributed(self) -> None:
        super()._setup_distributed()   # the process group (or the one already running)
        import deepspeed
        DeepSpeedStrategy._set_node_environment_variables(self)   # what deepspeed.init_distributed reads
        deepspeed.init_distributed(self._process_group_backend, distributed_port=self.cluster_environment.main_port,
                                   timeout=self._timeout)

    # ------------------------------------------------------------------ setup
    def _engine_config(self, module, trains: bool) -> dict:
        own = per_model.own_config(module, self._by_class)
        return per_model.for_model(self._template, self.precision.precision, own, type(module).__name__, trains)

    def _check_new(self, module, what: str) -> None:
        if isinstance(module, MultiEngine) or module in self._set_up:
            raise ValueError(f"{what}: {type(module).__name__} was already set up by this strategy. Set each model up "
                             "once, and keep the object fabric.setup returned.")

    def _check_optimizer(self, module, optimizer) -> None:
        own = {id(p) for p in module.parameters()}
        foreign = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in own]
        if not foreign:
            return
        owner = "no model given to fabric.setup"
        for engine in self._engines:
            names = {id(p): n for n, p in engine.module.named_parameters()}
            hit = next((names[id(p)] for p in foreign if id(p) in names), None)
            if hit is not None:
                owner = f"{type(engine.module).__name__} (parameter {hit!r}), set up before"
                break
        raise ValueError(
            f"fabric.setup({type(module).__name__}, optimizer): the optimizer holds {len(foreign)} parameter(s) that "
            f"are not {type(module).__name__}'s; they belong to {owner}. Each DeepSpeed model has its own optimizer "
            "over its own parameters: build one optimizer per model (e.g. torch.optim.Adam(model.parameters())) and "
            "set each up with its model.")

    def _ds_args(self):
        index = self.root_device.index
        return None if index is None else argparse.Namespace(device_rank=index)

    def setup_module_and_optimizers(self, module, optimizers, scheduler=None):
        """One MultiEngine for ``module`` and its one optimizer; a scheduler stays the loop's to step."""
        name = type(module).__name__
        if len(optimizers) != 1:
            raise ValueError(f"fabric.setup({name}, ...) got {len(optimizers)} optimizers; a DeepSpeed model has one. "
                             "Set up each model with its own optimizer (fabric.setup may be called for every model).")
        self._check_new(module, "fabric.setup")
        self._check_optimizer(module, optimizers[0])
        config = self._engine_config(module, trains=True)
        engine, optimizer, _, _ = initialize(args=self._ds_args(), model=module, optimizer=optimizers[0],
                                             model_parameters=[p for p in module.parameters() if p.requires_grad],
                                             config=config, dist_init_required=False)
        caller_owns_accumulation(engine)
        self._register(module, engine)
        self._wrapper_watch.watch(engine)
        return engine, [EngineOptimizer(optimizer, engine)], scheduler

    def setup_module(self, module):
        """A frozen (inference-only) engine for ``module``, at its config's stage (ZeRO-1/2 run as stage 0)."""
        self._check_new(module, "fabric.setup")
        engine = initialize(args=self._ds_args(), model=module, config=self._engine_config(module, trains=False),
                            dist_init_required=False)[0]
        self._register(module, engine)
        return engine

    def _register(self, module, engine):
        self._set_up.add(module)
        self._engines.append(engine)

    def setup_optimizer(self, optimizer):
        """Refused (NotImplementedError): a model and its optimizer are set up together (``fabric.setup``)."""
        raise NotImplementedError("MultiDeepSpeedStrategy sets a model and its optimizer up together: "
                                  "fabric.setup(model, optimizer).")

    def module_to_device(self, module) -> None:
        """Move ``module`` to the strategy's root device, as DDP does."""
        module.to(self.root_device)

    def module_init_context(self, empty_init=None):
        """``fabric.init_module()``: under the strategy's own config (see :meth:`init_module`)."""
        return self.init_module(None, empty_init)

    @contextlib.contextmanager
    def init_module(self, name: Optional[str] = None, empty_init=None):
        """Build a model under its own config: ``with fabric.strategy.init_module("Teacher"): ...``.

        A ZeRO-3 config partitions the parameters at construction (``deepspeed_multi.zero_init``);
        another builds a plain model, as ``fabric.init_module()`` under DDP does.

        Args:
            name (str): the model's class name, as in ``configs=``; None: the strategy's own config.
            empty_init (bool): as for ``fabric.init_module``; False is refused under a ZeRO-3 config.

        Yields:
            None, inside the context in which the model is built.

        Raises:
            ValueError: when ``configs=`` has no config for ``name``.
            NotImplementedError: for ``empty_init=False`` under a ZeRO-3 config (the parameters are
                partitioned as they are built, never materialized whole).
        """
        if name is not None and name not in self._by_class:
            raise ValueError(f"init_module({name!r}): configs= has no config for {name!r} (it has "
                             f"{sorted(self._by_class)}); the model would be built under the strategy's config.")
        own = per_model.load_config(self._by_class[name]) if name is not None else None
        config = per_model.for_model(self._template, self.precision.precision, own, name or "the model", trains=False)
        if zero_stage(config) != 3:
            with super().module_init_context(empty_init):
                yield
            return
        if empty_init is False:
            raise NotImplementedError("init_module(empty_init=False) under a ZeRO-3 config: the parameters are "
                                      "partitioned as they are built, never materialized whole.")
        with self.precision.module_init_context(), zero_init(config):
            yield

    # ------------------------------------------------------------------ clipping
    def clip_gradients_norm(self, module, optimizer, max_norm, norm_type=2.0, error_if_nonfinite=True):
        """The gradient norm of ``module``'s update, which runs here (see the module doc)."""
        if not isinstance(module, MultiEngine) or not isinstance(optimizer, EngineOptimizer) \
                or optimizer.engine is not module:
            raise ValueError("fabric.clip_gradients(model, optimizer, ...): pass a model and its own optimizer as "
                             "fabric.setup(model, optimizer) returned them.")
        name = type(module.module).__name__
        refuse_other_clipping(module, max_norm, norm_type,
                              f"fabric.clip_gradients({name}, max_norm={max_norm}, norm_type={norm_type})",
                              f"Set \"gradient_clipping\": {max_norm} in its DeepSpeed config.")
        if not module._window_backwards:
            raise RuntimeError(f"fabric.clip_gradients({name}): no backward pass reached {name} since its last "
                               "update; call it after fabric.backward and before optimizer.step().")
        norm = optimizer.update_for_norm()
        if norm is None:
            raise RuntimeError(f"fabric.clip_gradients({name}): DeepSpeed computed no gradient norm for {name} at ZeRO "
                               "stage 0 in fp32 (its update clips at gradient_clipping without keeping the norm). Use "
                               "ZeRO stage 1-3, or bf16/fp16, to read the norm.")
        norm = torch.as_tensor(float(norm))
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"fabric.clip_gradients({name}): the gradient norm is {float(norm)}.")
        return norm

    def clip_gradients_value(self, module, optimizer, clip_val):
        """Refused (NotImplementedError): DeepSpeed clips by norm, inside its update (use ``max_norm=``)."""
        raise NotImplementedError("DeepSpeed clips gradients by norm inside its update: use "
                                  "fabric.clip_gradients(model, optimizer, max_norm=...) with \"gradient_clipping\" "
                                  "in the model's config.")

    # ------------------------------------------------------------------ checkpoints
    @staticmethod
    def _split_state(state: dict, what: str):
        engines = {k: v for k, v in state.items() if isinstance(v, MultiEngine)}
        if not engines:
            raise ValueError(f"{what}: the state holds no model set up by MultiDeepSpeedStrategy; pass them like "
                             "{'generator': generator, 'optimizer_g': optimizer_g, ...}.")
        optimizers = {k: v for k, v in state.items() if isinstance(v, EngineOptimizer)}
        for key, opt in optimizers.items():
            if not any(opt.engine is e for e in engines.values()):
                raise ValueError(f"{what}: state[{key!r}] is the optimizer of {type(opt.engine.module).__name__}, "
                                 "whose model is not in the state; add the model (its optimizer is saved with it).")
        rest = {k: v for k, v in state.items() if k not in engines and k not in optimizers}
        return engines, rest

    def save_checkpoint(self, path, state, storage_options=None, filter=None) -> None:
        """Every engine in ``state`` into one set checkpoint under ``path``; the rest as its client state."""
        if storage_options is not None or filter is not None:
            raise TypeError("fabric.save(..., filter=...) and storage_options are not supported by "
                            "MultiDeepSpeedStrategy: DeepSpeed writes each engine's partitioned state itself.")
        engines, rest = self._split_state(state, "fabric.save")
        path = self.broadcast(os.fspath(path))
        client_state = self._convert_stateful_objects_in_state(rest, filter={})
        set_checkpoint.save_checkpoint(path, engines, client_state=client_state)

    def load_checkpoint(self, path, state=None, strict=True, weights_only=None):
        """The newest complete set checkpoint under ``path`` into the engines of ``state``; the other
        entries of ``state`` are restored in place; what the checkpoint holds beyond them is returned."""
        if not isinstance(state, dict):
            raise ValueError("fabric.load(path, state): MultiDeepSpeedStrategy needs the state dict with every model "
                             "that was saved, set up as it was at the save.")
        engines, rest = self._split_state(state, "fabric.load")
        client_state = set_checkpoint.load_checkpoint(self.broadcast(os.fspath(path)), engines)
        missing = sorted(set(rest) - set(client_state))
        if strict and missing:
            raise KeyError(f"fabric.load: the state asks for {missing}, which the checkpoint at {path} does not hold.")
        _move_state_into(source=client_state, destination=state, keys=set(rest))
        return client_state

    def teardown(self) -> None:
        """Destroy every engine set up (each hands its model back), then DDP's teardown."""
        self._wrapper_watch.close()
        for engine in self._engines:
            engine.destroy()
        self._engines.clear()
        super().teardown()
