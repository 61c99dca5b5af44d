"""The update paths of ``MultiEngine.step()`` other than DeepSpeed's own step: an update with nothing
accumulated, a skipped update, and the clean-up after DeepSpeed's step raised."""
import logging

from ..state import TrainingState

logger = logging.getLogger("deepspeed_multi.engine")


def step_without_gradients(engine, lr_kwargs):
    """An update with nothing accumulated since the last one, as in PyTorch.

    [Note: step() with no gradients]
    ``optimizer.step()`` skips every parameter whose ``.grad`` is None, so after a window in
    which no backward pass reached the engine (a skipped batch, a branch not taken, only
    ``torch.autograd.grad`` of inputs, or ``zero_grad()`` last) parameters and optimizer
    state stay as they are, while the step counters and the LR schedule advance. DeepSpeed's
    own step() would index gradient partitions that were never created. Ranks agree: at
    ZeRO 0/1 the rank-agreement check in ``MultiEngine.step()`` compares the counts; at ZeRO 2/3 a rank that
    ran a backward pass through the engine has completed that pass's reduction collectives,
    which every rank must have entered too.
    """
    if engine.lr_scheduler is not None:
        engine.lr_scheduler.step(**(lr_kwargs or {}))
    engine.global_steps += 1
    engine.micro_steps += 1
    engine._step_applied = False
    engine._state = TrainingState.IDLE


def abort_step(engine):
    """DeepSpeed's step() raised: undo what it leaves half-set and discard this window.

    Its ``_running_engine_step`` flag, which in unmanaged accumulation is also what
    ``is_gradient_accumulation_boundary()`` returns, would stay set and send every later
    backward down the update path; its step timers would stay started. The window's
    gradients are discarded (as ``zero_grad()`` does), so the next backward starts a clean
    window. An optimizer that raised after updating part of its parameters keeps that part.
    """
    engine._running_engine_step = False
    engine._rank_agreement.discard()
    for name in engine.engine_timers.step_timers:
        timer = engine.timers(name)
        if getattr(timer, "started_", False):
            timer.stop()
    logger.warning("deepspeed_multi: %s.step() raised; this window's gradients are discarded.",
                   engine._engine_name())
    engine.zero_grad()


def count_samples_as_upstream(engine):
    """Before DeepSpeed's update: its ``global_samples`` as upstream counts them.

    DeepSpeed runs unmanaged under a MultiEngine, where its step() adds the samples of the backward passes
    it counted. Under managed accumulation (a config's default) upstream adds ``train_batch_size`` per
    update whatever the window held (the Trainer's shorter last window of an epoch): so does ours."""
    if engine._config_managed:
        engine._unmanaged_backward_count = engine.gradient_accumulation_steps()


def skip_update(engine):
    """Drop this window's gradients without updating, as DeepSpeed does on an fp16 overflow."""
    if engine.fp16_enabled():
        engine.optimizer._update_scale(True)
    engine.zero_grad()
    engine.skipped_steps += 1
    engine.global_steps += 1
    engine.global_samples += engine.train_batch_size()
    engine.micro_steps += 1
    engine._step_applied = False
