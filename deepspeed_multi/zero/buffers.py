"""Where each ZeRO stage keeps gradients between backward passes, and how to discard them.

Used by MultiEngine.zero_grad(); the update itself consumes and resets them in DeepSpeed's step().

DeepSpeed reduces gradients during or right after each backward and accumulates the reduced
result in optimizer-owned buffers; ``param.grad`` alone does not hold them. MultiEngine needs
PyTorch's meaning: every backward accumulates, ``zero_grad()`` discards, ``step()`` consumes.
"""
import inspect

from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from .stage12 import bucket_pack as stage12_bucket_pack
from .stage3 import lazy_grads as stage3_lazy_grads


def start_window(optimizer) -> None:
    """Make the next backward accumulate onto zeros (at construction and after each update).

    [Note: ZeRO-3 gradient partitions across windows]
    ZeRO-3 copies (rather than adds) a reduced partition into its buffer while micro_step_id is
    0, i.e. in the first backward after an update, and leaves the buffer as it was otherwise. A
    parameter that the first backward of a window does not reach (a branch the first of two
    losses does not use, a module skipped on one micro-batch) then adds its later gradient onto
    the previous window's. Zeroing the buffer once per window and always accumulating gives
    PyTorch's meaning; it costs one pass over this rank's gradient partition per update, or none
    where the partitions are allocated per window (stage3_lazy_grads: dropped here, zeroed when
    next allocated).
    """
    if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        partitions = stage3_lazy_grads.lazy(optimizer)
        if partitions is not None:
            partitions.release()
        elif optimizer.grad_partitions_flat_buffer is not None:
            optimizer.grad_partitions_flat_buffer.zero_()
        optimizer.micro_step_id = 1
        optimizer._epilogue_ran_this_backward = False


def discard(optimizer) -> None:
    """Drop every gradient accumulated since the last update."""
    if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        optimizer.zero_grad(set_to_none=True)
        start_window(optimizer)
    elif isinstance(optimizer, DeepSpeedZeroOptimizer):
        optimizer.zero_grad(set_to_none=True)
        optimizer.averaged_gradients = {}
        optimizer.all_grad_tensors = {}
        optimizer._epilogue_ran_this_backward = False
    elif optimizer is not None and hasattr(optimizer, "zero_grad"):
        grads_to_none(optimizer)


def grads_to_none(optimizer) -> None:
    """``optimizer.zero_grad(set_to_none=True)``, for optimizers whose zero_grad() lacks the argument.

    DeepSpeed's FusedAdam (and other older optimizers) define ``zero_grad(self)``; those are
    cleared through their param_groups. DeepSpeed's wrappers (BF16_Optimizer, FP16_Optimizer)
    take the argument and also clear the 16-bit model gradients their param_groups do not hold.
    """
    try:
        accepted = inspect.signature(optimizer.zero_grad).parameters.values()
    except (TypeError, ValueError):
        accepted = ()
    if any(p.name == "set_to_none" or p.kind is p.VAR_KEYWORD for p in accepted):
        optimizer.zero_grad(set_to_none=True)
        return
    for group in getattr(optimizer, "param_groups", ()):
        for p in group["params"]:
            p.grad = None


def abort_backward(engine) -> None:
    """Undo what a backward that raised part way left in ZeRO's reduction state, then discard.

    Its epilogue never ran, so buckets hold gradients that were never reduced, parameters are
    marked as already reduced and, at stage 3, gathered parameters were never released.
    """
    optimizer = engine.optimizer
    if isinstance(optimizer, (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3)):
        optimizer._backward_active_depth = 0
        stage12_bucket_pack.drop_pending(optimizer)
        for bucket in optimizer.ipg_buckets.values():
            # ZeRO-3 buckets keep their buffer (clear() would drop it for good); ZeRO-1/2 reallocate.
            bucket.clear_params() if hasattr(bucket, "clear_params") else bucket.clear()
        reduced = optimizer.params_already_reduced
        for key in (reduced.keys() if isinstance(reduced, dict) else range(len(reduced))):
            reduced[key] = False
        # ZeRO-1/2: a parameter larger than the bucket, waiting alone to be reduced at the next flush.
        getattr(optimizer, "extra_large_param_to_reduce", {}).clear()
    if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        engine.empty_partition_cache()
    discard(optimizer)
