"""``deepspeed_multi.accelerate.Accelerator``: ``accelerate.Accelerator`` over any number of MultiEngines.

Differences from ``accelerate.Accelerator`` under DeepSpeed (everything else is inherited):

* ``prepare`` builds a :class:`~deepspeed_multi.MultiEngine` per model (see [Note: how
  Accelerate's prepare builds MultiEngines] in _routing.py), from the plugin selected with
  ``accelerator.state.select_deepspeed_plugin(name)`` or given for the call with
  ``prepare(..., deepspeed_plugin=<name | DeepSpeedPlugin | config dict/path>)``. A model
  prepared without an optimizer is an inference-only engine.
* ``backward(loss)`` is ``loss.backward()``: one backward through every engine the loss reaches;
  it steps nothing.
* A prepared optimizer's ``step()``/``zero_grad()`` are its engine's, a prepared scheduler
  advances once per update of its engine (wrappers.py).
* ``clip_grad_norm_``, ``accumulate``, ``get_state_dict`` act on the engine the arguments belong
  to, not on the first one prepared.
* ``save_state``/``load_state`` hold every model's state, as DDP's do: a model prepared without an
  optimizer (an EMA teacher, a synced reference) has its parameters saved by deepspeed_multi
  (DeepSpeed cannot checkpoint such an engine at ZeRO-3), and every engine's buffers are saved rank
  by rank (see [Note: buffers rank by rank] in checkpoint/module_state.py).
* ``free_memory`` destroys every engine it drops (Accelerate destroys its one), so the models
  can be prepared again.

Mixed precision: each engine's dtype comes from its own config. ``Accelerator(mixed_precision=X)``
(or ``accelerate launch --mixed_precision X``) is applied by Accelerate to every plugin: a config
without an "fp16"/"bf16" section gets X, an "auto" ``enabled`` becomes X, an explicit
``enabled: true/false`` is kept (a contradicting one, e.g. fp16 enabled with X = bf16, is refused
by Accelerate). Plugins and configs given later to ``prepare`` get the same treatment.
"""
import contextlib
import os
import weakref

import accelerate
import deepspeed
import torch

from accelerate.utils import DistributedType
from accelerate.utils.deepspeed import DeepSpeedEngineWrapper, DeepSpeedOptimizerWrapper, DeepSpeedSchedulerWrapper
from accelerate.scheduler import AcceleratedScheduler

from ..reliability import managed_path
from ..engine import MultiEngine
from ..parts.engine import PartedEngine

ENGINES = (MultiEngine, PartedEngine)  # what prepare() builds: one engine per model, or one of parts
_ACCELERATORS = weakref.WeakSet()  # every live Accelerator of ours: a model may be another one's (_engine_of)
from . import plugins as _plugins
from . import sequence_parallel
from ._routing import multi_engine_initialize
from .cpu_world import sync_world_size
from ..integrations.engine_steps import refuse_other_clipping
from .wrappers import EngineOptimizer, UpdateScheduler


class Accelerator(accelerate.Accelerator):
    """Drop-in ``accelerate.Accelerator`` whose DeepSpeed models are MultiEngines (see module doc)."""

    def __init__(self, *args, **kwargs):
        mixed_precision = kwargs.get("mixed_precision")
        if mixed_precision is None and len(args) > 2:
            mixed_precision = args[2]
        if mixed_precision is None:
            mixed_precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
        self._mixed_precision_request = str(mixed_precision)
        self._managed_wrapper = None  # Accelerate's wrapper of an engine on DeepSpeed's managed path (backward)
        super().__init__(*args, **kwargs)
        _ACCELERATORS.add(self)
        if self._uses_deepspeed:
            sync_world_size(self.state)   # see [Note: Accelerate's DeepSpeed mode on CPU]

    @property
    def _uses_deepspeed(self) -> bool:
        return self.distributed_type == DistributedType.DEEPSPEED

    # ------------------------------------------------------------------ prepare
    def prepare(self, *args, device_placement=None, deepspeed_plugin=None, deepspeed_config=None):
        """``accelerate.Accelerator.prepare``, plus the RFC's per-call DeepSpeed config.

        Under DeepSpeed each call prepares one model (with its optimizer and scheduler) as a
        MultiEngine of its own; a model passed without an optimizer is an inference-only engine.

        Args:
            *args: the objects to prepare, as for Accelerate (at most one model per call under DeepSpeed).
            device_placement: as for Accelerate.
            deepspeed_plugin: the name of one of the Accelerator's plugins, a ``DeepSpeedPlugin``, or a
                DeepSpeed config dict or JSON path, used for this call only (the plugin selected before
                comes back afterwards); None: the selected plugin.
            deepspeed_config: an alias of ``deepspeed_plugin``.

        Returns:
            The prepared objects, as Accelerate returns them: the engine in the model's place, an
                :class:`EngineOptimizer` and an :class:`UpdateScheduler` in its optimizer's and scheduler's.

        Raises:
            ValueError: when both ``deepspeed_plugin`` and ``deepspeed_config`` are given, when one call
                holds several models under DeepSpeed, when a plugin is given to an Accelerator not in
                DeepSpeed mode, when a config given cannot be read, or when a scheduler comes without
                its optimizer.
            TypeError: when ``deepspeed_plugin`` is neither a name, a ``DeepSpeedPlugin`` nor a config.
        """
        if deepspeed_plugin is not None and deepspeed_config is not None:
            raise ValueError("prepare(): pass deepspeed_plugin=... or deepspeed_config=..., not both (they are aliases).")
        choice = deepspeed_plugin if deepspeed_plugin is not None else deepspeed_config
        models = [type(obj).__name__ for obj in args if isinstance(obj, torch.nn.Module)]
        if self._uses_deepspeed and len(models) > 1:
            raise ValueError(f"prepare() got {len(models)} models ({', '.join(models)}) in one call. With DeepSpeed, "
                             "prepare one model per call, with its own optimizer and scheduler (and, if it needs "
                             "its own config, deepspeed_plugin=...); this Accelerator holds any number of them.")
        if choice is None:
            return super().prepare(*args, device_placement=device_placement)
        if not self._uses_deepspeed:
            raise ValueError("prepare(deepspeed_plugin=...) needs an Accelerator in DeepSpeed mode, but this one is "
                             f"{self.distributed_type}. Create it with Accelerator(deepspeed_plugins={{name: "
                             "DeepSpeedPlugin(...)}}) or launch with `accelerate launch --use_deepspeed`.")
        name = _plugins.resolve(self.state, choice, self._mixed_precision_request)
        with _plugins.selected(self.state, name):
            return super().prepare(*args, device_placement=device_placement)

    def _prepare_deepspeed(self, *args):
        with multi_engine_initialize(), sequence_parallel.register_once():  # [Note: one Ulysses registration ...]
            result = list(super()._prepare_deepspeed(*args))
        # Accelerate ties deepspeed_engine_wrapped to the first engine and warns at the next: kept as upstream keeps
        # them, for a program that reads them. Our backward() drives every engine itself, except an engine on
        # DeepSpeed's managed path, which gets Accelerate's own wrapper ([Note: the drop-in rule]).
        managed = next((obj for obj in result if managed_path.is_managed(obj)), None)
        if managed is not None:
            self._managed_wrapper = DeepSpeedEngineWrapper(managed)
        engine = next((obj for obj in result if isinstance(obj, ENGINES)), None)
        optimizer = None
        for i, obj in enumerate(result):
            if engine is not None and isinstance(obj, DeepSpeedOptimizerWrapper):
                optimizer = EngineOptimizer(obj.optimizer, engine)
                result[i] = self._replace(self._optimizers, obj, optimizer)
        for i, obj in enumerate(result):
            if isinstance(obj, AcceleratedScheduler) and not isinstance(obj, DeepSpeedSchedulerWrapper):
                if optimizer is None:
                    raise ValueError(f"prepare(): a learning-rate scheduler was passed for "
                                     f"{type(engine.module).__name__} without its optimizer. Pass the model, its "
                                     "optimizer and its scheduler to the same prepare() call.")
                scheduler = UpdateScheduler(obj.scheduler, optimizer, self.step_scheduler_with_optimizer,
                                            self._scheduler_steps_per_update)
                result[i] = self._replace(self._schedulers, obj, scheduler)
            elif engine is None and isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
                # prepare(scheduler) on its own: Accelerate returns it unwrapped under DeepSpeed.
                result[i] = self._join_engine(obj)
        return tuple(result)

    @property
    def _scheduler_steps_per_update(self) -> int:
        """Accelerate's scheduler steps per optimizer step: one per process unless batches are split."""
        return 1 if self.split_batches else self.num_processes

    def _join_engine(self, scheduler):
        """A scheduler prepared without its model follows the engine whose optimizer it schedules."""
        for opt in self._optimizers:
            if isinstance(opt, EngineOptimizer) and getattr(scheduler, "optimizer", None) in (
                    opt, opt.optimizer, getattr(opt.engine, "basic_optimizer", None)):
                wrapped = UpdateScheduler(scheduler, opt, self.step_scheduler_with_optimizer,
                                          self._scheduler_steps_per_update)
                self._schedulers.append(wrapped)
                return wrapped
        raise ValueError(f"prepare({type(scheduler).__name__}): its optimizer belongs to no model prepared so far. "
                         "Prepare the model and its optimizer first (or all three in one prepare() call).")

    @staticmethod
    def _replace(container, old, new):
        for j, item in enumerate(container):
            if item is old:
                container[j] = new
        return new

    def prepare_scheduler(self, scheduler):
        """Under DeepSpeed: the scheduler follows its engine's updates (see wrappers.py)."""
        if self._uses_deepspeed:
            return self._join_engine(scheduler)
        return super().prepare_scheduler(scheduler)

    # ------------------------------------------------------------------ training loop
    def backward(self, loss, **kwargs):
        """One backward through every engine ``loss`` reaches; updates happen in each optimizer's step()."""
        if not self._uses_deepspeed:
            return super().backward(loss, **kwargs)
        if "learning_rate" in kwargs:
            raise ValueError("accelerator.backward(learning_rate=...) (LOMO optimizers) is not supported with "
                             "DeepSpeed engines; use a regular optimizer and optimizer.step().")
        if not kwargs.pop("scale_wrt_gas", True):
            raise ValueError("accelerator.backward(loss, scale_wrt_gas=False): each engine divides by its own "
                             "gradient_accumulation_steps, so a loss already divided would be divided twice. Under "
                             "transformers.Trainer (which passes it), use deepspeed_multi.transformers.Trainer; in "
                             "your own loop, pass the undivided loss.")
        if self._managed_wrapper is not None:
            return self._managed_backward(loss, **kwargs)
        # Each engine divides by its own gradient_accumulation_steps at its boundary.
        loss.backward(**kwargs)

    @contextlib.contextmanager
    def _as_upstream(self, what):
        """Accelerate's own single-engine path for the one engine on DeepSpeed's managed path (ZenFlow, DeepCompile,
        SuperOffload, the hybrid engine: [Note: the drop-in rule]), as upstream Accelerate runs it."""
        models = [m for m in self._models if isinstance(m, (*ENGINES, deepspeed.DeepSpeedEngine))]
        if len(models) > 1:
            engine = self._managed_wrapper.engine
            raise RuntimeError(
                f"accelerator.{what}: {type(engine.module).__name__} uses {engine.managed_feature}, whose engine runs on "
                "DeepSpeed's managed path, which Accelerate drives as upstream Accelerate does: backward() runs that "
                "engine's engine.backward(loss) and, at the window's end, its step(). With "
                f"{len(models) - 1} more model(s) prepared in this Accelerator, backward() cannot tell which engines "
                "the loss reaches. Prepare that model in an Accelerator of its own, or drop "
                f"{engine.managed_feature.split(' (')[0]} from its config.")
        tied, self.deepspeed_engine_wrapped = self.deepspeed_engine_wrapped, self._managed_wrapper
        try:
            yield
        finally:
            self.deepspeed_engine_wrapped = tied

    def _managed_backward(self, loss, **kwargs):
        with self._as_upstream("backward()"):
            return accelerate.Accelerator.backward(self, loss, **kwargs)

    def _engine_of(self, what, params=None, model=None):
        """The engine of ``model`` (or owning ``params``), prepared by this Accelerator or by another of ours in the
        process: the guide's pattern of a second Accelerator for a second model, which Accelerate accepts."""
        engines = [m for m in self._models if isinstance(m, ENGINES)]
        engines += [m for other in list(_ACCELERATORS) if other is not self for m in other._models
                    if isinstance(m, ENGINES) and not any(m is e for e in engines)]
        if model is not None:
            for engine in engines:
                if model is engine or model is engine.module:
                    return engine
            raise ValueError(f"{what}: {type(model).__name__} is not a model prepared by an Accelerator of "
                             "deepspeed_multi; pass the object that prepare() returned.")
        wanted = {id(p) for p in params}
        for engine in engines:
            if wanted and wanted <= {id(p) for p in engine.module.parameters()}:
                return engine
        raise ValueError(f"{what}: the {len(wanted)} parameters given do not all belong to one prepared model "
                         f"({len(engines)} prepared). Pass model.parameters() of a single prepared model.")

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """The gradient norm of the engine's last update, which DeepSpeed clips at its config's "gradient_clipping".

        Accelerate returns that norm under DeepSpeed for its one engine; here the engine is the one
        ``parameters`` belong to, and a ``max_norm`` other than its configured value is refused, since
        clipping here at another value would be silently ignored.

        Args:
            parameters: the parameters of one prepared model (``model.parameters()``).
            max_norm (float): the model's configured ``gradient_clipping``.
            norm_type (float): 2, the norm DeepSpeed clips.

        Returns:
            The engine's ``get_global_grad_norm()`` (without DeepSpeed, or for an engine on DeepSpeed's
                managed path: Accelerate's own result).

        Raises:
            ValueError: when ``parameters`` do not all belong to one prepared model, or ``max_norm`` /
                ``norm_type`` are not the 2-norm clipping that model's config sets.
        """
        if not self._uses_deepspeed:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        if self._managed_wrapper is not None:
            with self._as_upstream("clip_grad_norm_()"):
                return accelerate.Accelerator.clip_grad_norm_(self, parameters, max_norm, norm_type)
        fix = (f"Set \"gradient_clipping\": {max_norm} in this model's DeepSpeed config (and keep the call, which "
               "then returns the norm of the last update), or drop the call.")
        return self._clipping_engine(parameters, max_norm, norm_type, fix).get_global_grad_norm()

    def _clipping_engine(self, parameters, max_norm, norm_type, fix):
        """The engine ``parameters`` belong to, if its config clips the 2-norm at ``max_norm``; else
        refuse (with ``fix``): clipping here at another value would be silently ignored."""
        engine = self._engine_of("clip_grad_norm_", params=list(parameters))
        refuse_other_clipping(engine, max_norm, norm_type, f"clip_grad_norm_(max_norm={max_norm}, "
                              f"norm_type={norm_type}) for {type(engine.module).__name__}", fix)
        return engine

    @contextlib.contextmanager
    def accumulate(self, *models):
        """Accelerate's ``accumulate``; every engine passed must share the Accelerator's accumulation steps.

        Each engine updates at the end of its own config's gradient_accumulation_steps window
        whatever ``accumulate`` says; ``sync_gradients`` follows the Accelerator's counter, so the
        two only agree when they have the same number of steps.
        """
        if self._uses_deepspeed:
            for model in models:
                engine = self._engine_of("accumulate", model=model)
                if engine.gradient_accumulation_steps() != self.gradient_accumulation_steps:
                    raise ValueError(
                        f"accumulate({type(engine.module).__name__}): this engine accumulates over "
                        f"{engine.gradient_accumulation_steps()} steps (its DeepSpeed config) but the Accelerator over "
                        f"{self.gradient_accumulation_steps}, so sync_gradients would not match its updates. Drop "
                        "accelerator.accumulate(...): optimizer.step()/zero_grad()/scheduler.step() already follow "
                        "each engine's own window (engine.is_update_boundary() tells whether the next step updates), "
                        "or give every config the same gradient_accumulation_steps.")
        with super().accumulate(*models):
            yield

    def get_state_dict(self, model, unwrap=True):
        """Accelerate's ``get_state_dict``, read against ``model``'s own DeepSpeed config."""
        if self._uses_deepspeed and isinstance(model, PartedEngine):
            return model.consolidated_state_dict()
        if not self._uses_deepspeed or not isinstance(model, MultiEngine):
            return super().get_state_dict(model, unwrap)
        saved = getattr(self, "deepspeed_config", None)
        self.deepspeed_config = model.config  # the config this engine was built from
        try:
            return super().get_state_dict(model, unwrap)
        finally:
            self.deepspeed_config = saved

    @contextlib.contextmanager
    def _checkpointed_models(self):
        """Accelerate saves and loads a DeepSpeed model with its ``save_checkpoint``/``load_checkpoint``:
        each MultiEngine is handed to it as a :class:`_EngineCheckpoint`, which adds what DeepSpeed's
        checkpoint leaves out."""
        models = self._models
        self._models = [_EngineCheckpoint(m) if isinstance(m, MultiEngine) else m for m in models]
        try:
            yield
        finally:
            self._models = models

    def save_state(self, output_dir=None, safe_serialization=True, **save_model_func_kwargs):
        """Accelerate's ``save_state``, every model's state included (see the module doc)."""
        with self._checkpointed_models():
            return super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)

    def load_state(self, input_dir=None, load_kwargs=None, **load_model_func_kwargs):
        """Accelerate's ``load_state``: every model's state back, frozen ones included."""
        with self._checkpointed_models():
            return super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)

    def engines(self):
        """The engines prepared so far.

        Returns:
            list: the MultiEngines (and PartedEngines of models in parts) in the order they were prepared.
        """
        return [m for m in self._models if isinstance(m, ENGINES)]

    def free_memory(self, *objects):
        """Accelerate's ``free_memory``, which destroys the DeepSpeed engine it holds so that a model
        can be prepared again: here every engine prepared so far, except those ``_kept_engines``
        names, which stay prepared ([Note: destroy() hands the module back])."""
        kept = self._kept_engines()
        for engine in self.engines():
            if not any(engine is k for k in kept):
                engine.destroy()
        tied = getattr(self, "deepspeed_engine_wrapped", None)
        if tied is not None and any(tied.engine is k for k in kept):
            self.deepspeed_engine_wrapped = None  # (Accelerate's free_memory destroys the tied engine)
        out = super().free_memory(*objects)
        self._models.extend(kept)
        return out

    def _kept_engines(self) -> list:
        return []


class _EngineCheckpoint:
    """A MultiEngine as ``save_state``/``load_state`` see it: DeepSpeed's checkpoint where it has an
    optimizer, then its parameters (without one) and this rank's buffers beside it
    (checkpoint/module_state.py). Anything else is the engine's."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def save_checkpoint(self, save_dir, tag=None, **kwargs):
        from ..checkpoint import module_state
        if self._engine.has_optimizer:
            self._engine.save_checkpoint(save_dir, tag, **kwargs)
        module_state.save_engine_state(self._engine, os.path.join(save_dir, str(tag)))

    def load_checkpoint(self, load_dir, tag=None, **kwargs):
        from ..checkpoint import module_state
        from ..checkpoint.files import raise_if_any
        out = self._engine.load_checkpoint(load_dir, tag, **kwargs) if self._engine.has_optimizer else None
        error = module_state.load_engine_state(self._engine, os.path.join(load_dir, str(tag)), str(tag))
        raise_if_any(f"deepspeed_multi.accelerate load_state: {error}" if error else None)
        return out
