"""Where each ZeRO stage keeps gradients between backward passes, and how to discard them.

Used by MultiEngine.zero_grad(); the update itself consumes and resets them in DeepSpeed's step().

DeepSpeed reduces gradients during or right after each backward and accumulates the reduced
result in optimizer-owned buffers; ``param.grad`` alone does not hold them. MultiEngine needs
PyTorch's meaning: every backward accumulates, ``zero_grad()`` discards, ``step()`` consumes.
"""
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer


def discard(optimizer) -> None:
    """Drop every gradient accumulated since the last update."""
    if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        optimizer.zero_grad(set_to_none=True)
        if optimizer.grad_partitions_flat_buffer is not None:
            optimizer.grad_partitions_flat_buffer.zero_()
        optimizer.micro_step_id = 0
        optimizer._epilogue_ran_this_backward = False
    elif isinstance(optimizer, DeepSpeedZeroOptimizer):
        optimizer.zero_grad(set_to_none=True)
        optimizer.averaged_gradients = {}
        optimizer.all_grad_tensors = {}
        optimizer._epilogue_ran_this_backward = False
    elif optimizer is not None and hasattr(optimizer, "zero_grad"):
        optimizer.zero_grad(set_to_none=True)
