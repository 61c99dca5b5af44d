"""An engine's optimizer as a training loop sees it, shared by the framework integrations
(Accelerate's prepared optimizer, Lightning's set-up optimizer).

[Note: one update, one scheduler step]
``EngineSteps.step()`` calls ``engine.step()``, which applies the update only at the end of
the engine's gradient-accumulation window (and not at all when fp16 overflow or a skip group
skips it). The wrapper counts the updates that were applied; a scheduler that follows it
(``deepspeed_multi.accelerate.UpdateScheduler``) advances once when its optimizer applied an
update since the scheduler's last step, and not otherwise. So a loop that calls
``optimizer.step(); scheduler.step(); optimizer.zero_grad()`` on every micro-batch advances the
schedule exactly once per update: never twice, never on a skipped update, never inside a window.

[Note: the caller owns gradient accumulation]
Trainers and loops written for DDP run their own accumulation: they call ``optimizer.step()``
once per window, on the gradients of the backward passes since the last update, and divide the
loss themselves if they want a mean. :func:`caller_owns_accumulation` makes an engine follow
that: it updates at every ``step()`` and applies no 1/gas of its own (its fp16 loss scale stays).
"""
import math


def _applied_updates(engine) -> int:
    return engine.global_steps - engine.skipped_steps


def caller_owns_accumulation(engine) -> None:
    """``engine`` updates at every ``step()`` and leaves the 1/gas to its caller (see the Note)."""
    from ..reliability.managed_path import is_managed
    if is_managed(engine):  # [Note: the drop-in rule]
        name, feature = type(engine.module).__name__, engine.managed_feature
        engine.destroy()
        raise RuntimeError(f"{name} uses {feature}, whose engine runs on DeepSpeed's managed path: it counts its own "
                           "micro-steps and divides by its own gradient_accumulation_steps, so it cannot follow a loop "
                           "that owns accumulation (Lightning here). Train it with engine.backward(loss) and "
                           f"engine.step() in a loop of your own, or drop {feature.split(' (')[0]} from its config.")
    if engine._window_backwards or engine._window_micro_steps:
        raise RuntimeError(f"{type(engine.module).__name__}: the caller must own accumulation from the first backward "
                           "pass; set the model up before training it.")
    engine._user_managed_boundary = True
    engine._caller_scales_loss = True


def refuse_other_clipping(engine, max_norm, norm_type, what: str, fix: str) -> None:
    """DeepSpeed clips the 2-norm inside the update at the config's ``gradient_clipping``: a call that
    asks for another clipping is refused (with ``fix``), since clipping at it would be silently ignored."""
    configured = engine.gradient_clipping()
    if norm_type != 2 or not configured or not math.isclose(configured, max_norm):
        raise ValueError(f"{what}: DeepSpeed clips the 2-norm inside the update at the config's gradient_clipping, "
                         f"which is {configured} for this engine. {fix}")


class EngineSteps:
    """``step()`` is the engine's ``step()``; ``zero_grad()`` the engine's ``zero_grad()`` outside a window.

    Mixed into a framework's optimizer wrapper; ``_init_engine_steps(engine)`` sets its state."""

    def _init_engine_steps(self, engine):
        self.engine = engine
        self.updates = 0          # updates applied through this wrapper (see [Note: one update, one scheduler step])
        self._skipped = False
        self._stepped_early = False  # step_now() ran this window's update

    def step(self, closure=None):
        if closure is not None:
            raise ValueError(f"optimizer.step(closure) is not supported for DeepSpeed engine "
                             f"{type(self.engine.module).__name__}: DeepSpeed updates from the gradients of "
                             "the backward passes since the last update. Call the closure yourself, then step().")
        if self._stepped_early:
            self._stepped_early = False
            return
        at_boundary = self.engine.is_update_boundary()
        before = _applied_updates(self.engine)
        self.engine.step()
        applied = _applied_updates(self.engine) > before
        self.updates += int(applied)
        self._skipped = at_boundary and not applied

    def step_now(self):
        """This window's update, now; the window's own ``step()`` call then does nothing (a loop that
        reads the window's gradient norm before it steps: DeepSpeed computes the norm in the update)."""
        self.step()
        self._stepped_early = True

    @property
    def updated_early(self) -> bool:
        """``step_now()`` ran this window's update and the window's own ``step()`` has not come yet."""
        return self._stepped_early

    def update_for_norm(self):
        """This window's update now (``step_now``); the gradient norm DeepSpeed computed in it, or None
        where DeepSpeed computes none (fp32 at ZeRO stage 0, whose update clips without keeping a norm:
        upstream's ``get_global_grad_norm()`` is None there too)."""
        self.step_now()
        return self.last_norm()

    def last_norm(self):
        """The engine's ``get_global_grad_norm()`` as DeepSpeed keeps it (a tensor at ZeRO 1-3, a float from the
        bf16/fp16 optimizers at stage 0, None in fp32 at stage 0): upstream Accelerate hands it on unchanged."""
        return self.engine.get_global_grad_norm()

    def zero_grad(self, set_to_none=None):
        """Discard the engine's gradients, except inside an accumulation window.

        Inside a window (step() was called and did not update yet) the gradients of the earlier
        micro-batches are still needed, so this does nothing, as Accelerate's optimizer does
        while ``sync_gradients`` is False. At a window's start it is ``engine.zero_grad()``:
        e.g. a GAN drops the discriminator gradients that the generator's loss produced.
        """
        if self.engine._window_micro_steps == 0:
            self.engine.zero_grad()

    @property
    def step_was_skipped(self):
        """True when the last step() was an update that fp16 overflow or a skip group skipped."""
        return self._skipped
