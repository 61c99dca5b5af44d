"""The training state of one MultiEngine, as an explicit enum instead of loose flags."""
from enum import Enum, auto


class TrainingState(Enum):
    """Where one MultiEngine is in its accumulation window (``engine._state``)."""
    # No gradient of this engine is pending: after construction, step() or zero_grad().
    IDLE = auto()
    # A backward pass is producing this engine's gradients: the prologue ran, the epilogue
    # (bucket flush, reduction, fp32 accumulation) is queued on the autograd graph task.
    IN_BACKWARD = auto()
    # At least one backward finished; reduced gradients wait for step() or zero_grad().
    GRADS_READY = auto()
    # engine.destroy() ran (hand_back.py): the module is handed back, every use is refused. Final.
    DESTROYED = auto()
