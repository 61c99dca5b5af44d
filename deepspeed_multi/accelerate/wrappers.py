"""The prepared optimizer and scheduler of one MultiEngine, in Accelerate's wrapper API.

Accelerate's own DeepSpeed wrappers do nothing on ``step()``/``zero_grad()`` because its
``backward()`` steps the one engine it knows. Here ``backward()`` only runs the backward (see
accelerator.py), so these wrappers hand each call to the engine they belong to.

[Note: one update, one scheduler step]
``EngineOptimizer.step()`` calls ``engine.step()``, which applies the update only at the end of
the engine's gradient-accumulation window (and not at all when fp16 overflow or a skip group
skips it). The wrapper counts the updates that were applied; ``UpdateScheduler.step()`` advances
its schedule once when its optimizer applied an update since the scheduler's last step, and not
otherwise. So a loop that calls ``optimizer.step(); scheduler.step(); optimizer.zero_grad()`` on
every micro-batch advances the schedule exactly once per update: never twice, never on a skipped
update, never inside a window. (Plain Accelerate steps a scheduler ``num_processes`` times per
call unless ``split_batches=True``; this one follows PyTorch: one step per update.)
Schedulers that come from the DeepSpeed config ("scheduler" section) are stepped by the engine
inside its update, so Accelerate's ``DeepSpeedSchedulerWrapper`` (whose step does nothing) stays.
"""
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler


def _applied_updates(engine) -> int:
    return engine.global_steps - engine.skipped_steps


class EngineOptimizer(AcceleratedOptimizer):
    """``step()`` is the engine's ``step()``; ``zero_grad()`` the engine's ``zero_grad()`` outside a window."""

    def __init__(self, optimizer, engine):
        super().__init__(optimizer, device_placement=False, scaler=None)
        self.engine = engine
        self.updates = 0          # updates applied through this wrapper (see [Note: one update, one scheduler step])
        self._skipped = False
        self._stepped_early = False  # step_now() ran this window's update (deepspeed_multi.transformers)

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
        """This window's update, now; the window's own ``step()`` call then does nothing (the
        Trainer reads the window's gradient norm before it steps: [Note: the Trainer owns
        gradient accumulation] in deepspeed_multi/transformers.py)."""
        self.step()
        self._stepped_early = True

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


class UpdateScheduler(AcceleratedScheduler):
    """A PyTorch LR scheduler that advances once per update of its engine."""

    def __init__(self, scheduler, optimizer: EngineOptimizer, step_with_optimizer: bool = True):
        super().__init__(scheduler, optimizer, step_with_optimizer=step_with_optimizer, split_batches=True)
        self._seen = optimizer.updates

    @property
    def engine_optimizer(self) -> EngineOptimizer:
        return self.optimizers[0]

    def step(self, *args, **kwargs):
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        updates = self.engine_optimizer.updates
        if updates > self._seen:
            self.scheduler.step(*args, **kwargs)
        self._seen = updates

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self._seen = self.engine_optimizer.updates
