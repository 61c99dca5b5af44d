"""``engine.set_gradient_accumulation_boundary(is_boundary)``: DeepSpeed's boundary override.

[Note: a boundary set by the caller]
DeepSpeed's method (managed accumulation only; it asserts that) marks the next backward as the
window's last or not: at ZeRO 0/1 a backward after True reduces the gradients as it ends, one
after False does not; and a step() after True updates, one after False is a micro-step. Its
documented use is several backward passes, the last after True, then one step(). MultiEngine
always runs DeepSpeed unmanaged (config.py, [Note: who owns the gradient-accumulation
boundary]), so DeepSpeed's assertion would name a setting the user never made. Where the user
did set ``managed_gradient_accumulation=false``, it is refused as DeepSpeed refuses it.

Here the flag, once set, decides :meth:`MultiEngine.is_update_boundary` in place of the count of
``gradient_accumulation_steps`` (a step() after False accumulates on, one after True updates),
and at ZeRO-0 (and bf16 ZeRO-1, DeepSpeed's BF16_Optimizer) the backward after True reduces its
gradients as it ends, as DeepSpeed's does, so they read as DeepSpeed's between that backward and
step(); the update's step() then does not reduce them again. ZeRO-1's own optimizer reduces in
step() (after its backward epilogue, which the early reduction would precede). A further backward through the engine before that step() is refused: its
gradients would add unreduced onto the reduced ones. ZeRO 2/3 reduce during every backward
anyway. DeepSpeed's own ``_is_gradient_accumulation_boundary`` is left unset, so
``is_gradient_accumulation_boundary()`` keeps its unmanaged meaning (true inside step()).
"""
from contextlib import contextmanager

from deepspeed.runtime.base_optimizer import ZeROOptimizer
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from .state import TrainingState

_FLAG = "_dsm_boundary_set"  # None until the caller sets it
_REDUCED = "_dsm_reduced_early"  # this window's gradients were reduced at the end of its last backward


def set_boundary(engine, is_boundary) -> None:
    if engine._user_managed_boundary:  # the user set managed_gradient_accumulation=false: DeepSpeed refuses it
        raise AssertionError("set_gradient_accumulation_boundary() is not supported with "
                             "managed_gradient_accumulation=False (set in this engine's config); the caller owns "
                             "the boundary by calling step()")
    setattr(engine, _FLAG, bool(is_boundary))


def is_update_boundary(engine) -> bool:
    flag = getattr(engine, _FLAG, None)
    if engine._user_managed_boundary:
        return True
    if flag is not None:
        return flag
    return (engine._window_micro_steps + 1) % engine.gradient_accumulation_steps() == 0


@contextmanager
def reduction(engine):
    """Around MultiEngine.allreduce_gradients: yields whether DeepSpeed's reduction should run now."""
    if getattr(engine, _FLAG, None) is None or isinstance(engine.optimizer, (DeepSpeedZeroOptimizer, ZeROOptimizer)) \
            and not isinstance(engine.optimizer, BF16_Optimizer):
        yield True  # ZeRO 1/2/3 optimizers: reduced in step() (1) or in every backward (2/3)
        return
    in_backward = engine._state is TrainingState.IN_BACKWARD
    if in_backward and getattr(engine, _REDUCED, False):
        raise RuntimeError(f"MultiEngine ({engine._engine_name()}): a backward pass after the one that "
                           "set_gradient_accumulation_boundary(True) marked as the window's last, before step(): "
                           "that window's gradients are already reduced. Call step() first, or set the boundary "
                           "before the last backward of the window.")
    if in_backward and getattr(engine, _FLAG):
        setattr(engine, _REDUCED, True)
        engine._is_gradient_accumulation_boundary = True  # DeepSpeed reduces ZeRO 0/1 only at the boundary
        try:
            yield True
        finally:
            engine._is_gradient_accumulation_boundary = None
        return
    early = getattr(engine, _REDUCED, False)
    setattr(engine, _REDUCED, False)
    yield not (early and not in_backward)
