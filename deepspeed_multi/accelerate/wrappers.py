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
    """Accelerate's optimizer wrapper whose ``step()``/``zero_grad()`` are its engine's (EngineSteps)."""

    def __init__(self, optimizer, engine):
        AcceleratedOptimizer.__init__(self, optimizer, device_placement=False, scaler=None)
        self._init_engine_steps(engine)


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
