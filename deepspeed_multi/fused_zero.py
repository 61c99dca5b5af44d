"""The fused gradient-bucket ops (deepspeed_multi.ops) in DeepSpeed's ZeRO-2/3 reduction path.

:func:`install` binds replacement methods on one optimizer *instance* (``types.MethodType``);
every replacement runs a single fused call where its fast path applies and otherwise calls
DeepSpeed's own method, which stays the definition of the semantics:

ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3.partition_grads``)
    After the bucket's reduce-scatter, the original copies (first micro-step of the window) or
    adds each parameter's reduced partition into its gradient-partition buffer, one small op per
    parameter. ``reduce_scatter_coalesced`` returns the partitions as narrow views of one flat
    buffer, so runs of them are consecutive in memory: each run becomes one
    ``unpack_accumulate(run, buffers, 1.0, accumulate=micro_step_id != 0)``. Applies without
    optimizer offload and ZenFlow; falls back per call when the partitions are not runs of
    consecutive views (e.g. a dtype conversion made each one a separate tensor, or the
    ``reduce_scatter=false`` path).

    The pass before the reduce-scatter (the interleaved cat and divide) is ``zero3_scatter.py``.

ZeRO-1/2 (``DeepSpeedZeroOptimizer.allreduce_and_copy_with_multiple_ranks``)
    The pass hit in unmanaged accumulation with ``reduce_scatter`` on (the default): DeepSpeed
    all-reduces a flattened copy of the bucket's slices, copies the reduced values back slice by
    slice into the IPG bucket (``buf.copy_(synced)``) and, with an fp32 accumulation buffer for
    16-bit weights, adds them into the compact fp32 partition (``_add_to_grad_partition_buffer``).
    Where the slices are one run of the communication dtype, the bucket is all-reduced in place
    (see [Note: the ZeRO-1/2 bucket reduced where it lies]) and the copy-back disappears;
    otherwise each run of consecutive local slices becomes one ``unpack_accumulate`` call for the
    copies. The adds are one ``unpack_accumulate`` per run either way. Applies without CPU offload
    and ZenFlow.

``DSM_FUSED_ZERO=0`` in the environment disables installation (a test/diagnostic switch; the
config option ``{"deepspeed_multi": {"fused_reduce": false}}`` is the user-facing one).
"""
from __future__ import annotations

import logging
import os
import types
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import ops, zero2_pack, zero3_scatter
from .ops.reference import SUPPORTED as _SUPPORTED_DTYPES  # what the fused ops take

logger = logging.getLogger(__name__)

ENV = "DSM_FUSED_ZERO"
_INSTALLED_ATTR = "_dsm_fused_zero"
_Z3_GRAD_PARTITIONS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"

_logged: set = set()


def _log_once(key: str, msg: str, *args) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.info(msg, *args)


# ------------------------------------------------------------------ pure helpers (unit-tested)
def consecutive_runs(tensors: Sequence[Tensor]) -> Optional[List[Tuple[int, int]]]:
    """Split ``tensors`` into maximal runs of views that follow each other in one storage.

    Returns ``[(start, stop), ...]`` (index ranges into ``tensors``) such that within a run
    every tensor is contiguous, has the run's dtype, device and untyped storage, and begins
    exactly where the previous one ends; or ``None`` if some tensor can never be part of a flat
    source (non-contiguous, or of a dtype the fused ops do not take). Empty tensors join the
    current run (they occupy no memory).
    """
    runs: List[Tuple[int, int]] = []
    start = 0
    prev = None  # (dtype, device, storage ptr, end data_ptr) of the current run
    for i, t in enumerate(tensors):
        if t.dtype not in _SUPPORTED_DTYPES or not t.is_contiguous():
            return None
        if t.numel() == 0 and prev is not None:
            continue
        key = (t.dtype, t.device, t.untyped_storage().data_ptr())
        if prev is None or prev[:3] != key or prev[3] != t.data_ptr():
            if i > start:
                runs.append((start, i))
            start = i
        prev = key + (t.data_ptr() + t.numel() * t.element_size(), )
    if len(tensors) > start:
        runs.append((start, len(tensors)))
    return runs


def flat_run(tensors: Sequence[Tensor]) -> Tensor:
    """One 1-D view over ``tensors``, which :func:`consecutive_runs` put into one run."""
    first = next((t for t in tensors if t.numel() > 0), tensors[0])
    total = sum(t.numel() for t in tensors)
    return first.as_strided((total, ), (1, ), first.storage_offset())


def one_run(tensors: Sequence[Tensor]) -> Optional[Tensor]:
    """A 1-D view covering ``tensors`` if they are one run (:func:`consecutive_runs`), else ``None``
    (also when every one is empty): what a flatten of them would hold, without the copy."""
    filled = [t for t in tensors if t.numel() > 0]  # an empty tensor adds nothing to a flatten either
    if not filled or consecutive_runs(filled) != [(0, len(filled))]:
        return None
    return flat_run(filled)


def run_view(tensors: Sequence[Tensor], numel: int) -> Optional[Tensor]:
    """:func:`one_run`, if it holds ``numel`` elements in all, else ``None``."""
    view = one_run(tensors)
    return view if view is not None and view.numel() == numel else None


# ------------------------------------------------------------------------------------ ZeRO-3
def _z3_partition_grads(self, params_to_release, grad_partitions):
    """Fused replacement of DeepSpeedZeroOptimizer_Stage3.partition_grads (see module doc)."""
    original = self._dsm_fused_zero["partition_grads"]
    if self.offload_optimizer or getattr(self, "zenflow", False):
        return original(params_to_release, grad_partitions)
    grad_partition_of = getattr(self, _Z3_GRAD_PARTITIONS)

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
    if zero3_scatter.is_one_run(self, grad_partitions) and len(srcs) == len(grad_partitions):
        runs = [(0, len(srcs))]  # split from one flat block by zero3_scatter: no need to look
    else:
        runs = consecutive_runs(srcs) if srcs else None
    if (not runs or len(runs) == len(srcs)
            or any(b.device != s.device or b.dtype not in _SUPPORTED_DTYPES or not b.is_contiguous()
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


# ---------------------------------------------------------------------------------- ZeRO-1/2
def _bucket_as_run(self, small_bucket, communication_data_type) -> Optional[Tensor]:
    """The small bucket as one 1-D view if DeepSpeed's ``allreduce_bucket`` would reduce a plain
    flatten of it (no dtype conversion) and its slices lie one after another; else ``None``.

    [Note: the ZeRO-1/2 bucket reduced where it lies]
    ``allreduce_bucket`` flattens the slices into a new tensor, all-reduces that and the caller
    copies this rank's slices back: a bucket-sized allocation and two passes over it per bucket.
    The slices are narrow views of the IPG bucket in order (``average_tensor`` merges each rank's
    range), so the flatten holds exactly the run, and the same all-reduce of the same values in
    the same layout gives the same bits in place; the copy-back is then a no-op. What changes is
    that the other ranks' slices of this rank's bucket hold the reduced values too, where
    DeepSpeed leaves them unreduced: at ZeRO-2 nothing reads them (their gradients are cleared
    right after); at ZeRO-1 the gradients of parameters outside this rank's partition point there
    until the update frees them, and only fp16's overflow check reads them, whose decision is the
    same (a non-finite local value makes the reduced value non-finite, and the flag is all-reduced
    across ranks either way).
    """
    from deepspeed.runtime.zero import stage_1_and_2
    if stage_1_and_2.pg_correctness_test or self.sequence_parallel_size > 1:
        return None  # allreduce_bucket converts to fp32 there
    if any(t.dtype != communication_data_type for t in small_bucket):
        return None
    return run_view(small_bucket, sum(t.numel() for t in small_bucket))


def _z2_allreduce_and_copy_with_multiple_ranks(self,
                                               small_bucket,
                                               communication_data_type,
                                               log=None,
                                               divide=True,
                                               process_group=None,
                                               bucket_ranks=None,
                                               output_bucket=None):
    """Fused replacement of DeepSpeedZeroOptimizer.allreduce_and_copy_with_multiple_ranks."""
    original = self._dsm_fused_zero["allreduce_and_copy_with_multiple_ranks"]
    args = (small_bucket, communication_data_type)
    kwargs = dict(log=log, divide=divide, process_group=process_group, bucket_ranks=bucket_ranks,
                  output_bucket=output_bucket)
    if self.cpu_offload or getattr(self, "zenflow", False) or bucket_ranks is None or len(small_bucket) < 2:
        return original(*args, **kwargs)
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator

    pg = self.dp_process_group if process_group is None else process_group
    outputs = [None] * len(small_bucket) if output_bucket is None else list(output_bucket)
    local_rank = dist.get_rank(group=pg)
    local = [local_rank in r if isinstance(r, frozenset) else local_rank == r for r in bucket_ranks]
    # Check the layout before any collective: a fallback must run the original from the start.
    for buf, out, mine in zip(small_bucket, outputs, local):
        if mine and any(t is not None and (t.dtype not in _SUPPORTED_DTYPES or not t.is_contiguous())
                        for t in (buf, out)):
            return original(*args, **kwargs)
    if communication_data_type not in _SUPPORTED_DTYPES:
        return original(*args, **kwargs)

    record = self.overlap_comm and not get_accelerator().resolves_data_dependency()
    flat = _bucket_as_run(self, small_bucket, communication_data_type)
    in_place = flat is not None
    if in_place:  # see [Note: the ZeRO-1/2 bucket reduced where it lies]
        if divide and self.gradient_average:
            flat.div_(dist.get_world_size(group=pg) / float(self.sequence_parallel_size))
        dist.all_reduce(flat, group=pg)
    else:
        allreduced = self.allreduce_bucket(small_bucket, communication_data_type, log=log, divide=divide,
                                           process_group=pg)
        if record:
            allreduced.record_stream(self.reduction_stream)
        flat = allreduced.view(-1)
    offsets = [0]
    for buf in small_bucket:
        offsets.append(offsets[-1] + buf.numel())

    def runs_of(selected):
        start = None
        for i, sel in enumerate(selected + [False]):
            if sel and start is None:
                start = i
            elif not sel and start is not None:
                yield start, i
                start = None

    # As the original, per slice: first add into the fp32 partition, then copy back into the bucket.
    with_output = [m and o is not None for m, o in zip(local, outputs)]
    for start, stop in runs_of(with_output):
        ops.unpack_accumulate(flat[offsets[start]:offsets[stop]], outputs[start:stop], 1.0, True)
    if not in_place:  # in place, this rank's slices already hold the reduced values
        for start, stop in runs_of(local):
            ops.unpack_accumulate(flat[offsets[start]:offsets[stop]], small_bucket[start:stop], 1.0, False)
    if record:
        for buf, mine in zip(small_bucket, local):
            if mine:
                buf.record_stream(self.reduction_stream)


# ---------------------------------------------------------------------------------- install
def is_exact_method(optimizer, cls, name) -> bool:
    """True if ``optimizer`` resolves ``name`` to ``cls``'s own definition (no subclass/instance override)."""
    return name not in vars(optimizer) and getattr(type(optimizer), name, None) is getattr(cls, name, None)


def _bind(optimizer, name, replacement) -> None:
    optimizer._dsm_fused_zero[name] = getattr(optimizer, name)
    setattr(optimizer, name, types.MethodType(replacement, optimizer))


def install(optimizer) -> bool:
    """Route ``optimizer``'s bucket passes through the fused ops; return whether anything changed.

    Supported: ZeRO-3 without optimizer offload (``partition_grads``, ``zero3_scatter``), ZeRO-1/2
    without CPU offload (``allreduce_and_copy_with_multiple_ranks``, ``zero2_pack``), neither with
    ZenFlow. Anything else (offload, a subclass that overrides the method, an optimizer already
    installed, ``DSM_FUSED_ZERO=0``) returns False and changes nothing.
    """
    if os.environ.get(ENV, "1").strip() == "0":
        _log_once("env", "deepspeed_multi fused_zero: disabled by %s=0", ENV)
        return False
    if getattr(optimizer, _INSTALLED_ATTR, None) is not None:
        return False
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        if (getattr(optimizer, "offload_optimizer", True) or getattr(optimizer, "zenflow", False)
                or not is_exact_method(optimizer, DeepSpeedZeroOptimizer_Stage3, "partition_grads")
                or not hasattr(optimizer, _Z3_GRAD_PARTITIONS)):
            return False
        optimizer._dsm_fused_zero = {}
        _bind(optimizer, "partition_grads", _z3_partition_grads)
        zero3_scatter.install(optimizer)  # and the pass before the reduce-scatter: one pack per bucket
        _log_once("z3", "deepspeed_multi fused_zero: ZeRO-3 partition_grads (copy/accumulate of the reduced "
                  "grad partitions) fused, backend %s", ops.active_backend())
        return True
    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        if (getattr(optimizer, "cpu_offload", True)
                or getattr(optimizer, "zenflow", False)
                or not is_exact_method(optimizer, DeepSpeedZeroOptimizer, "allreduce_and_copy_with_multiple_ranks")
                or not is_exact_method(optimizer, DeepSpeedZeroOptimizer, "_add_to_grad_partition_buffer")):
            return False
        optimizer._dsm_fused_zero = {}
        _bind(optimizer, "allreduce_and_copy_with_multiple_ranks", _z2_allreduce_and_copy_with_multiple_ranks)
        zero2_pack.install(optimizer)  # and the pass before the reduction: one pack per bucket
        _log_once("z12", "deepspeed_multi fused_zero: ZeRO-1/2 allreduce_and_copy_with_multiple_ranks (the "
                  "bucket all-reduced in place, or the copy-back fused; the add into the fp32 grad partition "
                  "fused) and bucket pack, backend %s", ops.active_backend())
        return True
    return False
