"""The prepared optimizer and scheduler of one MultiEngine, in Accelerate's wrapper API.

Accelerate's own DeepSpeed wrappers do nothing on ``step()``/``zero_grad()`` because its
``backward()`` steps the one engine it knows. Here ``backward()`` only runs the backward (see
accelerator.py), so these wrappers hand each call to the engine they belong to ([Note: one
update, one scheduler step] in integrations/engine_steps.py).
Schedulers that come from the DeepSpeed config ("scheduler" section) are stepped by the engine
inside its update, so Accelerate's ``DeepSpeedSchedulerWrapper`` (whose step does nothing) stays.
"""
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler

from ..integrations.engine_steps import EngineSteps


class EngineOptimizer(EngineSteps, AcceleratedOptimizer):
    """Accelerate's optimizer wrapper whose ``step()``/``zero_grad()`` are its engine's (EngineSteps).

    What ``prepare`` returns for a model's optimizer under DeepSpeed; built by the Accelerator.

    Args:
        optimizer: the engine's optimizer, as Accelerate's DeepSpeed wrapper holds it.
        engine: the engine whose ``step()``/``zero_grad()`` it calls.
    """

    def __init__(self, optimizer, engine):
        AcceleratedOptimizer.__init__(self, optimizer, device_placement=False, scaler=None)
        self._init_engine_steps(engine)


class UpdateScheduler(AcceleratedScheduler):
    """A PyTorch LR scheduler that advances as Accelerate's does, once its engine applied an update.

    What ``prepare`` returns for a scheduler under DeepSpeed; built by the Accelerator.

    Args:
        scheduler: the learning-rate scheduler to step.
        optimizer (EngineOptimizer): the prepared optimizer of the engine whose updates it follows.
        step_with_optimizer (bool): True follows the engine's updates; False steps ``scheduler`` at every
            ``step()``, as Accelerate does (the Accelerator's ``step_scheduler_with_optimizer``).
        steps_per_update (int): scheduler steps per applied update: Accelerate's, ``num_processes`` unless the
            Accelerator splits batches (a schedule sized in single-process batches), else 1.
    """

    def __init__(self, scheduler, optimizer: EngineOptimizer, step_with_optimizer: bool = True,
                 steps_per_update: int = 1):
        super().__init__(scheduler, optimizer, step_with_optimizer=step_with_optimizer,
                         split_batches=steps_per_update == 1)
        self.steps_per_update = steps_per_update
        self._seen = optimizer.updates

    @property
    def engine_optimizer(self) -> EngineOptimizer:
        """The prepared optimizer whose engine's updates this scheduler follows."""
        return self.optimizers[0]

    def step(self, *args, **kwargs):
        """Step the scheduler ``steps_per_update`` times if its engine applied an update since the last ``step()``.

        Accelerate's scheduler steps whenever the optimizer was stepped at a window's end and not skipped,
        ``num_processes`` times unless batches are split; this one counts the updates its engine applied
        (each engine has its own window), so a ``step()`` inside an accumulation window, a second one after
        the same update or one after a skipped fp16 update does nothing ([Note: one update, one scheduler step]
        in integrations/engine_steps.py). With ``step_with_optimizer=False`` it steps once every time, as
        Accelerate's.
        """
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        updates = self.engine_optimizer.updates
        if updates > self._seen:
            for _ in range(self.steps_per_update):
                # OneCycleLR refuses a step past its total_steps; Accelerate's wrapper stops there too.
                total = getattr(self.scheduler, "total_steps", None)
                if total is None or self.scheduler._step_count <= total:
                    self.scheduler.step(*args, **kwargs)
        self._seen = updates

    def load_state_dict(self, state_dict):
        """Load the scheduler's state as Accelerate's does; the updates applied so far then count as seen.

        So the next ``step()`` waits for the engine's next update.
        """
        super().load_state_dict(state_dict)
        self._seen = self.engine_optimizer.updates
