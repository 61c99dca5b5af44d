"""ZeRO-3: the reduced gradient partitions copied or added into their buffers in fused runs.

[Note: ZeRO-3's partition copy, fused]
After the bucket's reduce-scatter, ``DeepSpeedZeroOptimizer_Stage3.partition_grads`` copies
(first micro-step of the window) or adds each parameter's reduced partition into its
gradient-partition buffer, one small op per parameter. ``reduce_scatter_coalesced`` (and
stage3_scatter) return the partitions as narrow views of one flat buffer, so runs of them are
consecutive in memory: each run becomes one ``unpack_accumulate(run, buffers, 1.0,
accumulate=micro_step_id != 0)``. Applies without optimizer offload and ZenFlow; falls back per
call to DeepSpeed's method when the partitions are not runs of consecutive views (e.g. a dtype
conversion made each one a separate tensor, or the ``reduce_scatter=false`` path).
"""
from __future__ import annotations

from ... import compat, ops
from ..runs import SUPPORTED_DTYPES, consecutive_runs, flat_run
from . import scatter as stage3_scatter

FEATURE = "stage3_partition"
_GRAD_PARTITIONS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"


def partition_grads(self, params_to_release, grad_partitions):
    """Replacement of ``DeepSpeedZeroOptimizer_Stage3.partition_grads`` (see the Note)."""
    original = compat.original(self, "partition_grads")
    if self.offload_optimizer or getattr(self, "zenflow", False):
        return original(params_to_release, grad_partitions)
    grad_partition_of = getattr(self, _GRAD_PARTITIONS)

    real_params, srcs, buffers = [], [], []
    # The only caller, __reduce_and_partition_ipg_grads, asserts one partition group per bucket,
    # so the rank is looked up once, not once per parameter as the original does.
    rank = self._get_param_partition_rank(params_to_release[0]) if params_to_release else 0
    for param, grad_partition in zip(params_to_release, grad_partitions):
        # Same test as the original: a partition beyond the parameter's data is skipped.
        if param.partition_numel() * rank < param.ds_numel:
            real_params.append(param)
            srcs.append(grad_partition)
            buffers.append(grad_partition_of[param.ds_id].narrow(0, 0, grad_partition.numel()))
    if stage3_scatter.is_one_run(self, grad_partitions) and len(srcs) == len(grad_partitions):
        runs = [(0, len(srcs))]  # split from one flat block by stage3_scatter: no need to look
    else:
        runs = consecutive_runs(srcs) if srcs else None
    if (not runs or len(runs) == len(srcs)
            or any(b.device != s.device or b.dtype not in SUPPORTED_DTYPES or not b.is_contiguous()
                   for b, s in zip(buffers, srcs))):
        # Nothing to fuse (one op per parameter either way) or not a layout the ops take.
        return original(params_to_release, grad_partitions)

    accumulate = self.micro_step_id != 0
    for start, stop in runs:
        ops.unpack_accumulate(flat_run(srcs[start:stop]), buffers[start:stop], 1.0, accumulate)

    from deepspeed.accelerator import get_accelerator
    synchronized = get_accelerator().is_synchronized_device()
    if not synchronized:
        stream = get_accelerator().current_stream()
    for param in real_params:
        # Record active param so unmanaged offload finalize skips params unused this window.
        self._offload_boundary_param_ids.add(param.ds_id)
        if not synchronized and param.grad is not None:
            param.grad.record_stream(stream)
    for param in params_to_release:
        param.grad = None
    return buffers




def install(optimizer) -> bool:
    """Fuse ``optimizer``'s partition copy; return whether it did (ZeRO-3 without offload or ZenFlow)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    if (not isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3) or getattr(optimizer, "offload_optimizer", True)
            or getattr(optimizer, "zenflow", False) or not hasattr(optimizer, _GRAD_PARTITIONS)
            or not compat.fast_path_exact(optimizer, FEATURE)):
        return False
    compat.replace_method(optimizer, "partition_grads", partition_grads, FEATURE)
    return True
