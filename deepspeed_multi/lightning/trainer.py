"""``MultiDeepSpeedTrainerStrategy``: the PyTorch Lightning ``Trainer`` over a LightningModule that
holds several models, each its own MultiEngine with its own config.

Lightning's ``DeepSpeedStrategy`` makes the whole LightningModule one engine with one config and
one optimizer. This strategy instead makes an engine of each model the LightningModule holds as an
attribute (a direct child module):

* a child whose parameters an optimizer from ``configure_optimizers`` holds is a trained engine
  with that optimizer (one optimizer per model; ``self.optimizers()`` returns them in order);
* a child named in ``configs`` without an optimizer is a frozen engine (a teacher, a reference
  model) at its config's stage;
* other children stay plain modules, replicated on every rank.

``configs`` maps the attribute name to the model's own config, merged over ``config`` ([Note: a
config per model under Lightning] in configs.py). The LightningModule uses manual optimization
(``self.automatic_optimization = False``), as Lightning's own GAN examples are written:
``self.manual_backward(loss)`` is one backward through every engine the loss reaches, each
optimizer's ``step()``/``zero_grad()`` is its own engine's (``self.zero_grad()`` reaches every
engine: zero_grad.py), and the loop owns accumulation
([Note: the caller owns gradient accumulation] in integrations/engine_steps.py). Runs in fp32
(``precision="32-true"``).

``trainer.save_checkpoint(path)`` writes one set checkpoint (``deepspeed_multi.save_checkpoint``)
in the directory ``path``, Lightning's own checkpoint (loops, schedulers, plain children's
weights, callbacks) as its client state; ``trainer.fit(..., ckpt_path=path)`` resumes from it
once the engines are built.
"""
import os
from datetime import timedelta
from typing import Any, Optional

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.deepspeed import DeepSpeedStrategy as FabricDeepSpeedStrategy
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

from .. import checkpoint as set_checkpoint
from ..initialize import initialize
from ..integrations.engine_steps import caller_owns_accumulation
from . import configs as per_model
from .fabric import EngineOptimizer
from .versions import check_lightning
from .zero_grad import route, unroute

__all__ = ["MultiDeepSpeedTrainerStrategy"]


class TrainerEngineOptimizer(EngineOptimizer):
    """Lightning's optimizer step passes a closure (its hooks around the step under manual
    optimization): run it, then the engine's step."""

    def step(self, closure=None):
        if closure is not None:
            closure()
        return super().step()


class MultiDeepSpeedTrainerStrategy(DDPStrategy):
    """Trainer strategy for a LightningModule of several DeepSpeed models (see the module doc).

    Args:
        config (dict or str): the DeepSpeed config (dict or JSON path) every model starts from; without
            it, Lightning's defaults from the other arguments, as ``DeepSpeedStrategy``.
        configs (dict): attribute name of a child module -> that model's own config, merged over ``config``.
        accelerator: as for Lightning's ``DDPStrategy``.
        parallel_devices: as for ``DDPStrategy``.
        cluster_environment: as for ``DDPStrategy``.
        precision_plugin: as for ``DDPStrategy``; the Trainer runs in fp32 (``precision="32-true"``).
        process_group_backend (str): as for ``DDPStrategy``.
        timeout (timedelta): as for ``DDPStrategy``; DeepSpeed's process group gets it too.
        **deepspeed_kwargs: the other arguments of Lightning's ``DeepSpeedStrategy``, which build
            ``config`` when none is given.

    Raises:
        TypeError: when ``configs`` is not a dict keyed by attribute names.
        RuntimeError: when the installed Lightning is not a tested release (``check_lightning``).
    """

    strategy_name = "deepspeed_multi"

    def __init__(self, config=None, configs: Optional[dict] = None, accelerator=None, parallel_devices=None,
                 cluster_environment=None, precision_plugin=None, process_group_backend: Optional[str] = None,
                 timeout: Optional[timedelta] = default_pg_timeout, **deepspeed_kwargs: Any):
        check_lightning()
        self._template = FabricDeepSpeedStrategy(config=config, **deepspeed_kwargs)
        self._by_name = per_model.check_by_class(configs)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision_plugin=precision_plugin,
                         process_group_backend=process_group_backend, timeout=timeout)
        self._engines = {}   # attribute name -> engine

    @property
    def config(self) -> dict:
        """The strategy's DeepSpeed config, which every model's own config is merged over."""
        return self._template.config

    @property
    def engines(self) -> dict:
        """Attribute name -> engine, for the engines built when ``fit`` started (a new dict)."""
        return dict(self._engines)

    # ------------------------------------------------------------------ environment
    def setup_environment(self) -> None:
        """DDP's set-up, refused first (RuntimeError) when the Trainer's device is not DeepSpeed's accelerator."""
        from deepspeed.accelerator import get_accelerator
        wanted, have = get_accelerator().device_name(), self.root_device.type
        if have != wanted:
            raise RuntimeError(
                f"MultiDeepSpeedTrainerStrategy: the Trainer runs on {have!r} but DeepSpeed's accelerator is "
                f"{wanted!r}. On a machine without GPUs set DS_ACCELERATOR=cpu and Trainer(accelerator='cpu').")
        super().setup_environment()

    def setup_distributed(self) -> None:
        """DDP's process group, then DeepSpeed's distributed set-up on it."""
        super().setup_distributed()
        import deepspeed
        FabricDeepSpeedStrategy._set_node_environment_variables(self)   # what deepspeed.init_distributed reads
        deepspeed.init_distributed(self._process_group_backend, distributed_port=self.cluster_environment.main_port,
                                   timeout=self._timeout)

    # ------------------------------------------------------------------ setup
    def setup(self, trainer) -> None:
        """Build an engine of each model the LightningModule holds (see the module doc) instead of wrapping it in DDP.

        Raises ValueError when the Trainer's precision is not ``"32-true"``, when the LightningModule
        uses automatic optimization, when its optimizers do not map one to one onto child modules, or
        when ``configs`` names an attribute that is not a child module.
        """
        self.accelerator.setup(trainer)
        precision = self.precision_plugin.precision
        if precision != "32-true":
            raise ValueError(f"MultiDeepSpeedTrainerStrategy runs in fp32: got Trainer(precision={precision!r}). Use "
                             "precision='32-true' (per-model fp16/bf16 is not supported under the Trainer yet).")
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            if self.lightning_module.automatic_optimization:
                raise ValueError(
                    f"MultiDeepSpeedTrainerStrategy: {type(self.lightning_module).__name__} uses automatic "
                    "optimization. Set self.automatic_optimization = False in its __init__ and write training_step "
                    "with self.optimizers(), self.manual_backward(loss), opt.step() and opt.zero_grad(), one "
                    "optimizer per model.")
            self.setup_optimizers(trainer)
            self._build_engines()
        self.setup_precision_plugin()

    def _owner(self, optimizer, children: dict) -> str:
        """The one child whose parameters ``optimizer`` holds."""
        ids = [id(p) for group in optimizer.param_groups for p in group["params"]]
        owners = {}
        for name, child in children.items():
            own = {id(p) for p in child.parameters()}
            hits = sum(i in own for i in ids)
            if hits:
                owners[name] = hits
        module = type(self.lightning_module).__name__
        if len(owners) == 1 and sum(owners.values()) == len(ids):
            return next(iter(owners))
        found = ", ".join(f"{n} ({k})" for n, k in owners.items()) or "none"
        raise ValueError(
            f"{module}.configure_optimizers: an optimizer holds {len(ids)} parameters; by model: {found}"
            f"{'' if sum(owners.values()) == len(ids) else ', and parameters of no child module'}. Each DeepSpeed "
            f"model is one child module of {module} with its own optimizer over its own parameters: return one "
            "optimizer per model (e.g. [Adam(self.generator.parameters()), Adam(self.discriminator.parameters())]).")

    def _build_engines(self) -> None:
        lm = self.lightning_module
        children = dict(lm.named_children())
        trained = {}
        for i, opt in enumerate(self.optimizers):
            name = self._owner(opt, children)
            if name in trained:
                raise ValueError(f"{type(lm).__name__}.configure_optimizers: two optimizers hold parameters of "
                                 f"{name!r}; a DeepSpeed model has one optimizer.")
            trained[name] = i
        unknown = sorted(set(self._by_name) - set(children))
        if unknown:
            raise ValueError(f"configs names {unknown}, which are not child modules of {type(lm).__name__} "
                             f"(its children: {sorted(children)}). Key configs by the attribute that holds the model.")
        optimizers = list(self.optimizers)
        for name, child in children.items():
            if name not in trained and name not in self._by_name:
                continue   # a plain module, replicated
            own = per_model.load_config(self._by_name[name]) if name in self._by_name else None
            config = per_model.for_model(self._template, "32-true", own, name, trains=name in trained)
            if name in trained:
                opt = optimizers[trained[name]]
                engine, ds_opt, _, _ = initialize(model=child, optimizer=opt, config=config, dist_init_required=False,
                                                  model_parameters=[p for p in child.parameters() if p.requires_grad])
                caller_owns_accumulation(engine)
                optimizers[trained[name]] = TrainerEngineOptimizer(ds_opt, engine)
            else:
                engine = initialize(model=child, config=config, dist_init_required=False)[0]
            setattr(lm, name, engine)   # the LightningModule's code calls the engine in the child's place
            self._engines[name] = engine
        self.optimizers = optimizers   # rebuilds the LightningOptimizers that self.optimizers() returns
        route(lm, self._engines.values())   # self.zero_grad() reaches the engines (zero_grad.py)

    def model_to_device(self) -> None:
        """Move the LightningModule to the strategy's root device, as DDP does."""
        self.model.to(self.root_device)

    def configure_ddp(self) -> None:
        """Nothing: no model is wrapped in DDP, the engines reduce their own gradients."""
        pass   # nothing is wrapped in DDP: the engines reduce their own gradients

    # ------------------------------------------------------------------ checkpoints
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """True: a checkpoint is restored after ``setup``, once the engines exist to load into."""
        return True   # the engines must exist to load into them

    @property
    def lightning_restore_optimizer(self) -> bool:
        """False: each engine's optimizer state is restored from the set checkpoint, not by Lightning."""
        return False  # each engine's optimizer state is in the set checkpoint

    def optimizer_state(self, optimizer) -> dict:
        """An empty dict: the optimizer's state is saved in the set checkpoint, with its engine."""
        return {}     # in the set checkpoint, with its engine

    def _engine_prefixes(self):
        return tuple(f"{name}." for name in self._engines)

    def lightning_module_state_dict(self) -> dict:
        """The weights outside the engines (the engines' are in the set checkpoint)."""
        prefixes = self._engine_prefixes()
        return {k: v for k, v in self.lightning_module.state_dict().items() if not k.startswith(prefixes)}

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        """Load the weights outside the engines (the engines' come from the set checkpoint).

        With ``strict``, the checkpoint's weights outside the engines must be exactly the module's
        (KeyError otherwise).
        """
        prefixes = self._engine_prefixes()
        expected = {k for k in self.lightning_module.state_dict() if not k.startswith(prefixes)}
        given = checkpoint["state_dict"]
        if strict and set(given) != expected:
            raise KeyError(f"MultiDeepSpeedTrainerStrategy: the checkpoint's weights outside the engines are "
                           f"{sorted(given)}, the module's {sorted(expected)}.")
        missing, unexpected = self.lightning_module.load_state_dict(given, strict=False)
        assert not unexpected, unexpected

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        """One set checkpoint of every engine in the directory ``filepath``, ``checkpoint`` as its client state.

        Refused: ``storage_options`` (TypeError), and a save before ``fit`` built the engines (ValueError).
        """
        if storage_options is not None:
            raise TypeError("MultiDeepSpeedTrainerStrategy.save_checkpoint(storage_options=...) is not supported: "
                            "DeepSpeed writes each engine's partitioned state itself.")
        if not self._engines:
            raise ValueError("trainer.save_checkpoint: no engines were built yet (they are built when fit starts).")
        path = self.broadcast(os.fspath(filepath))
        set_checkpoint.save_checkpoint(path, self._engines, client_state=checkpoint)

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        """Load the set checkpoint at ``checkpoint_path`` into the engines; return Lightning's checkpoint.

        What is returned is the client state that :meth:`save_checkpoint` saved. Refused (ValueError)
        before ``fit`` built the engines.
        """
        if not self._engines:
            raise ValueError("ckpt_path=...: MultiDeepSpeedTrainerStrategy resumes a fit (trainer.fit(..., "
                             "ckpt_path=...)), where the engines exist to load into.")
        return set_checkpoint.load_checkpoint(self.broadcast(os.fspath(checkpoint_path)), self._engines)

    def remove_checkpoint(self, filepath) -> None:
        """Remove the set checkpoint's directory ``filepath`` (on the global rank 0)."""
        if self.is_global_zero and os.path.isdir(filepath):
            import shutil
            shutil.rmtree(filepath)

    def teardown(self) -> None:
        """Destroy every engine and put each model back on the LightningModule, then DDP's teardown."""
        lm = self.lightning_module
        if lm is not None:
            unroute(lm)
        for name, engine in self._engines.items():
            engine.destroy()   # hands the model back ([Note: destroy() hands the module back])
            if lm is not None:
                setattr(lm, name, engine.module)
        self._engines.clear()
        super().teardown()
