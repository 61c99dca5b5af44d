"""ZeRO-1/2: the bucket all-reduced where it lies, and the copies after it fused.

``DeepSpeedZeroOptimizer.allreduce_and_copy_with_multiple_ranks`` is the pass hit in unmanaged
accumulation with ``reduce_scatter`` on (the default): DeepSpeed all-reduces a flattened copy of
the bucket's slices, copies the reduced values back slice by slice into the IPG bucket
(``buf.copy_(synced)``) and, with an fp32 accumulation buffer for 16-bit weights, adds them into
the compact fp32 partition (``_add_to_grad_partition_buffer``). Where the slices are one run of
the communication dtype, the bucket is all-reduced in place (see [Note: the ZeRO-1/2 bucket
reduced where it lies]) and the copy-back disappears; otherwise each run of consecutive local
slices becomes one ``unpack_accumulate`` call for the copies. The adds are one
``unpack_accumulate`` per run either way. Applies without CPU offload and ZenFlow.
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from ... import compat, ops
from .. import sequence_parallel
from ..runs import SUPPORTED_DTYPES, run_view

FEATURE = "stage12_reduce"


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
    if stage_1_and_2.pg_correctness_test or sequence_parallel.size(self) > 1:
        return None  # allreduce_bucket converts to fp32 there
    if any(t.dtype != communication_data_type for t in small_bucket):
        return None
    return run_view(small_bucket, sum(t.numel() for t in small_bucket))


def allreduce_and_copy_with_multiple_ranks(self,
                                           small_bucket,
                                           communication_data_type,
                                           log=None,
                                           divide=True,
                                           process_group=None,
                                           bucket_ranks=None,
                                           output_bucket=None):
    """Replacement of ``DeepSpeedZeroOptimizer.allreduce_and_copy_with_multiple_ranks`` (see the module doc)."""
    original = compat.original(self, "allreduce_and_copy_with_multiple_ranks")
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
        if mine and any(t is not None and (t.dtype not in SUPPORTED_DTYPES or not t.is_contiguous())
                        for t in (buf, out)):
            return original(*args, **kwargs)
    if communication_data_type not in SUPPORTED_DTYPES:
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




def install(optimizer) -> bool:
    """All-reduce ``optimizer``'s buckets in place and fuse the copies; return whether it did."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    if (not isinstance(optimizer, DeepSpeedZeroOptimizer) or getattr(optimizer, "cpu_offload", True)
            or getattr(optimizer, "zenflow", False) or not compat.fast_path_exact(optimizer, FEATURE)):
        return False
    compat.replace_method(optimizer, "allreduce_and_copy_with_multiple_ranks", allreduce_and_copy_with_multiple_ranks,
                          FEATURE)
    return True
