"""PartedEngine: one engine object for a model whose submodules run at their own ZeRO stages.

See [Note: one model, several ZeRO stages] in plan.py for how the parts are formed, [Note: the
client optimizer is the parts' hyperparameter source] in optimizer.py for the one optimizer,
and [Note: clipping a model whose parts are separate ZeRO optimizers] in clip.py for the clip.

[Note: a parted engine's update]
Every part has the model's accumulation count, so the parts reach their update boundary on the
same ``step()``. There, in order: each part's param groups take the client optimizer's current
hyperparameters; with clipping on, every updating part reduces and the whole model's norm is
formed (clip.py); each part runs its own ``MultiEngine.step()``; the client scheduler steps once
if the update was applied. An fp16 overflow in any part skips every part's update: when any part
runs in fp16 all parts are one skip group (reliability/skip_group.py), unless the config names
its own group.
"""
import contextlib

import torch
import torch.nn as nn

from ..reliability import misuse
from ..checkpoint import set_checkpoint as checkpoint
from . import clip
from .optimizer import sync_hyperparameters
from .plan import REST


class PartedEngine(nn.Module):
    """The user's model trained as parts of different ZeRO configs, used like one DeepSpeedEngine.

    ``engine.module`` is the model itself (its own attribute names and ``state_dict()`` keys);
    ``engine.parts`` maps each declared submodule name (and ``"_rest"``) to its MultiEngine.
    """

    def __init__(self, model, parts, client_optimizer=None, sources=None, client_scheduler=None, config=None,
                 model_hooks=()):
        super().__init__()
        self._model_hooks = list(model_hooks)  # build.py's forward hooks on the model, removed by destroy()
        self.module = model
        self.config = config or {}  # the model's DeepSpeed config (as DeepSpeedEngine.config), submodules included
        self._parts = dict(parts)  # not submodules: the model already holds every parameter once
        self._client = client_optimizer
        self._sources = sources or {}
        self.lr_scheduler = client_scheduler
        self._last_norm = None
        self._training_parts = [e for e in self._parts.values() if e.trains]
        first = next(iter(self._parts.values()))
        self._first = self._training_parts[0] if self._training_parts else first

    @property
    def parts(self) -> dict:
        return dict(self._parts)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__["_modules"].get("module")
            if module is None:
                raise
            return getattr(module, name)

    # ---------------------------------------------------------------- forward / backward
    def forward(self, *args, **kwargs):
        self._refuse_if_destroyed("forward()")
        return self.module(*args, **kwargs)

    def backward(self, loss, retain_graph=False):
        """Same as ``loss.backward()``; returns ``loss / gradient_accumulation_steps`` like DeepSpeed."""
        loss.backward(retain_graph=retain_graph)
        return loss / self.gradient_accumulation_steps()

    # ---------------------------------------------------------------- update
    def is_update_boundary(self) -> bool:
        return self._first.is_update_boundary()

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.is_update_boundary()

    def step(self, lr_kwargs=None):
        self._refuse_if_destroyed("step()")
        if not self._training_parts:
            raise RuntimeError("deepspeed_multi: this model's parts are all inference-only (no optimizer, or no "
                               "parameter requires grad), so step() has nothing to update.")
        boundary = self.is_update_boundary()
        norm = None
        if boundary:
            if self._client is not None:
                for name, engine in self._parts.items():
                    if engine.trains:
                        sync_hyperparameters(self._client, engine.basic_optimizer, self._sources[name])
            if self.gradient_clipping() > 0:
                updating = [e for e in self._training_parts if e._window_backwards > 0]
                norm = clip.WholeModelNorm(updating)
                self._last_norm = norm.total
            else:
                self._last_norm = None
        skipped_before = self._first.skipped_steps
        for engine in self._training_parts:
            with norm.during_step(engine) if norm is not None else contextlib.nullcontext():
                engine.step(lr_kwargs)
        if boundary and self.lr_scheduler is not None and self._first.skipped_steps == skipped_before:
            if self._client is not None:
                self._client._opt_called = True  # the parts stepped for it (torch warns otherwise)
            self.lr_scheduler.step(**(lr_kwargs or {}))

    def zero_grad(self, set_to_none=True):
        for engine in self._parts.values():
            engine.zero_grad()

    def destroy(self):
        """Every part's destroy() and the model's hooks off ([Note: destroy() hands the module back])."""
        for handle in self._model_hooks:
            handle.remove()
        self._model_hooks.clear()
        for engine in self._parts.values():
            engine.destroy()

    def _refuse_if_destroyed(self, what):
        for engine in self._parts.values():
            misuse.refuse_if_destroyed(engine, what)

    @contextlib.contextmanager
    def no_sync(self):
        with contextlib.ExitStack() as stack:
            for engine in self._parts.values():
                stack.enter_context(engine.no_sync())
            yield

    def train(self, mode=True):
        for engine in self._parts.values():
            engine.train(mode)
        return super().train(mode)

    # ---------------------------------------------------------------- what DeepSpeedEngine reports
    def gradient_accumulation_steps(self) -> int:
        return self._first.gradient_accumulation_steps()

    def train_batch_size(self) -> int:
        return self._first.train_batch_size()

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._first.train_micro_batch_size_per_gpu()

    def gradient_clipping(self) -> float:
        return self._first.gradient_clipping()

    def zero_optimization_stages(self) -> dict:
        return {name: e.zero_optimization_stage() for name, e in self._parts.items()}

    @property
    def global_steps(self) -> int:
        return self._first.global_steps

    @property
    def skipped_steps(self) -> int:
        return self._first.skipped_steps

    @property
    def device(self):
        return self._first.device

    @property
    def has_optimizer(self) -> bool:
        return bool(self._training_parts)

    @property
    def _window_micro_steps(self) -> int:  # (accelerate/wrappers.py reads the window position)
        return self._first._window_micro_steps

    def get_lr(self):
        groups = self._client.param_groups if self._client is not None else self._first.optimizer.param_groups
        return [g["lr"] for g in groups]

    def get_global_grad_norm(self):
        """The whole model's gradient norm at the last update (unscaled), as a DDP Trainer reports it."""
        if self._last_norm is not None:
            return self._last_norm
        norms = [e.get_global_grad_norm() for e in self._training_parts]
        if any(n is None for n in norms):
            return None
        return sum(float(n)**2 for n in norms)**0.5

    # ---------------------------------------------------------------- checkpoints
    def consolidated_state_dict(self) -> dict:
        """The whole model's ``state_dict()`` (its own names), ZeRO-3 parts gathered: call on every
        rank; rank 0 gets every entry (other ranks lack the ZeRO-3 parts'). What Trainer's
        ``save_model`` writes, so ``from_pretrained`` loads it."""
        out = {}
        for name, engine in self._parts.items():
            prefix = "" if name == REST else name + "."
            if engine.zero_optimization_stage() == 3:
                state = engine._zero3_consolidated_16bit_state_dict() or {}
            else:
                state = engine.module.state_dict()
            out.update({prefix + key.replace("/", "."): value for key, value in state.items()})
        return out

    def save_checkpoint(self, save_dir, tag=None, client_state=None, exclude_frozen_parameters=False):
        """Every part in one atomic checkpoint (deepspeed_multi.save_checkpoint), with the client
        optimizer's hyperparameters and the scheduler's state."""
        state = {"client_state": client_state, **self._client_states()}
        checkpoint.save_checkpoint(save_dir, self._parts, client_state=state, tag=tag)
        return True

    def checkpoint_parts(self) -> dict:
        """What a set checkpoint saves of this model: its parts, as ``<name>.<part>``."""
        return self.parts

    def _client_states(self) -> dict:
        return {"optimizer": self._client.state_dict() if self._client is not None else None,
                "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None}

    def _load_client_states(self, state) -> None:
        if self._client is not None and state.get("optimizer") is not None:
            self._client.load_state_dict(state["optimizer"])
        if self.lr_scheduler is not None and state.get("lr_scheduler") is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True):
        """Resume every part; returns ``(load_dir, client_state)`` like DeepSpeedEngine.load_checkpoint.

        The whole state is always loaded (DeepSpeed's optional parts included); asking for less is refused."""
        if not (load_optimizer_states and load_lr_scheduler_states):
            raise ValueError("deepspeed_multi: a model in parts resumes whole (optimizer and scheduler states "
                             "included); load_optimizer_states / load_lr_scheduler_states=False is not supported.")
        state = checkpoint.load_checkpoint(load_dir, self._parts, tag=tag)
        self._load_client_states(state)
        return load_dir, state.get("client_state")


class PartsOptimizer(torch.optim.Optimizer):
    """What initialize returns as the optimizer of a parted model: the client optimizer's param
    groups (so schedulers and ``param_groups[i]["lr"]`` work as usual); the update is
    ``engine.step()``, as with a DeepSpeed ZeRO optimizer."""

    def __init__(self, engine, client=None):  # pylint: disable=super-init-not-called
        self._engine = engine
        self._source = client if client is not None else engine._first.optimizer
        self.defaults = getattr(self._source, "defaults", {})
        self.state = {}
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}

    @property
    def param_groups(self):
        # Read through on every access: a resume loads the source's state with torch's
        # load_state_dict, which replaces its list of groups, and a scheduler that holds this
        # optimizer must set the learning rate on the groups the parts take it from.
        return self._source.param_groups

    def step(self, closure=None):
        raise RuntimeError("deepspeed_multi: call engine.step() to update a model with declared submodules (it steps "
                           "every part, at the end of each accumulation window); the optimizer returned by "
                           "initialize only carries the param groups.")

    def zero_grad(self, set_to_none=True):
        self._engine.zero_grad()

    def state_dict(self):
        return {name: e.optimizer.state_dict() for name, e in self._engine.parts.items() if e.trains}
