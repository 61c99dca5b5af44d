"""ZeRO-3: gradients enter the bucket in the reduce-scatter's rank order, so a flush needs no second buffer.

[Note: a bucket laid out for the reduce-scatter]
DeepSpeed copies each gradient whole into ZeRO-3's bucket (``__add_grad_to_ipg_bucket``) and, at
the flush, interleaves the bucket's gradients rank by rank into a new buffer of the bucket's size
(``reduce_scatter_coalesced``; stage3_scatter's one pack here). For the length of the flush the
bucket is held twice, and the first flush of a backward, where every activation is still alive,
is where a step's memory peaks (benchmarks/memory_breakdown.py).

Here the bucket buffer is ``world`` regions of ``stride`` elements, region ``r`` holding what rank
``r`` receives: a gradient of ``n`` elements is cut into ``world`` chunks of ``ceil(n / world)``
(the last one zero-padded, as DeepSpeed pads) and chunk ``r`` is written at the same offset of
every region, the next free one. The copy applies the average's ``1 / world`` (a division where
``world`` is not a power of two), as stage3_scatter's pack does, so every element is rounded as
DeepSpeed rounds it. The flush then reduce-scatters the regions where they are: on gloo as a list
of the regions (no copy of ours; gloo's own copy of a ``reduce_scatter_tensor`` input is the whole
input, of a list one region), elsewhere after moving the regions together in place (NCCL
reduce-scatters a contiguous tensor in place and flattens a list into a new one). The gradient's
own tensor is freed at once, as DeepSpeed's add frees it; its ``param.grad`` is a zero-stride
stand-in of the gradient's shape until the flush sets it to None, as DeepSpeed's is a view of the
bucket until then (nothing of DeepSpeed's reads it in between: the flush reads the regions).

Offsets follow the order gradients arrive in, which is the order of the autograd engine over the
same graph on every rank; DeepSpeed's own contiguous buckets rely on the same (ZeRO-1/2's, and
ZeRO-3's with ``reduce_scatter`` off). DeepSpeed sorts a bucket's parameters by id before its
reduce-scatter; the partitions come back here in arrival order, and the bucket's parameter list
is put in that order too, so the partition copy (stage3_partition) still sees one run of views.
Each element is still the sum over the ranks of the same values, scaled the same: DeepSpeed's
bits on 2 ranks (with more ranks, gloo's ring may add an element at another offset in another
order, as any change of bucket size upstream does).

Applies with stage3_scatter and stage3_bucket_size (this bucket is theirs), DeepSpeed's
``reduce_scatter`` on, the gradients' dtype as the communication dtype, one partition group for
every parameter, and no ZenFlow, AutoEP or hierarchical all-to-all. A gradient larger than the
bucket is left to DeepSpeed's add (it is reduced alone, from its own tensor).
``DSM_ZERO3_RANK_ORDER=0`` keeps stage3_scatter's pack (for A/B runs).
"""
from __future__ import annotations

from typing import List

import torch

from ... import compat
from ...switches import ZERO3_RANK_ORDER, switch_on
from .. import runs

FEATURE = "stage3_rank_order"
_MAX_PIECES = 8  # a region moved in more pieces than this is sent with its unused tail instead


class _Layout:
    """One bucket's regions: how far they are filled, and where each gradient's chunk is."""
    __slots__ = ("fill", "order", "spots")

    def __init__(self):
        self.fill = 0
        self.order: List = []  # the bucket's parameters, in arrival (offset) order
        self.spots = {}  # ds_id -> (offset in every region, chunk)


def region_elements(elements: int, world: int, params: int) -> int:
    """A region's length: a bucket of at most ``elements`` gradient elements, cut in ``world``
    chunks per gradient, pads each of its at most ``params`` gradients by less than one element
    per region."""
    return -(-elements // world) + params


def place(self, param, bucket) -> bool:
    """Write ``param``'s gradient into its bucket's regions (see the Note); False where DeepSpeed's
    add must run instead (the gradient is larger than what is left of the bucket)."""
    grad = param.grad
    n = grad.numel()
    if bucket.elements + n > self.reduce_bucket_size:
        return False
    state = compat.state(self, FEATURE)
    layouts = state["layouts"]
    dtype = grad.dtype
    if not bucket.params or dtype not in layouts:  # a new bucket (DeepSpeed clears params at each flush)
        layouts[dtype] = _Layout()
    layout = layouts[dtype]
    world, stride = state["world"], state["stride"]
    chunk = -(-n // world)
    if layout.fill + chunk > stride:
        raise RuntimeError(f"deepspeed_multi: ZeRO-3 bucket region of {stride} elements overflows at {param.ds_summary()} "
                           f"(filled {layout.fill}, chunk {chunk}); set DSM_ZERO3_RANK_ORDER=0 and report this")
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    if not accelerator.resolves_data_dependency():
        self.reduce_and_partition_stream.wait_stream(accelerator.current_stream())
    with accelerator.stream(self.reduce_and_partition_stream):
        dst = bucket.buffer.narrow(0, 0, world * stride).view(world, stride).narrow(1, layout.fill, chunk)
        src = grad.reshape(-1)
        rows, rest = divmod(n, chunk)
        if rows:
            _average(src.narrow(0, 0, rows * chunk).view(rows, chunk), world, dst.narrow(0, 0, rows))
        if rest:
            _average(src.narrow(0, rows * chunk, rest), world, dst[rows].narrow(0, 0, rest))
            dst[rows].narrow(0, rest, chunk - rest).zero_()
        padded_rows = rows + (1 if rest else 0)
        if padded_rows < world:
            dst.narrow(0, padded_rows, world - padded_rows).zero_()
        if not accelerator.is_synchronized_device():
            grad.record_stream(accelerator.current_stream())
    stand_in = state["stand_in"].get((dtype, grad.device))
    if stand_in is None:
        stand_in = state["stand_in"][(dtype, grad.device)] = grad.new_zeros(())
    param.grad.data = stand_in.expand(grad.shape)
    layout.spots[param.ds_id] = (layout.fill, chunk)
    layout.order.append(param)
    layout.fill += chunk
    bucket.params.append(param)
    bucket.process_group = self._get_param_partition_group(param)
    bucket.elements += n
    return True


def _average(src, world, out):
    """``out = src / world``, rounded as stage3_scatter's pack rounds it."""
    if runs.scales_exactly(world):
        torch.mul(src, 1.0 / world, out=out)
    else:
        torch.div(src, world, out=out)


def placed(self, params) -> bool:
    """Whether ``params`` (a bucket being flushed) were laid out by :func:`place`."""
    if not compat.installed(self, FEATURE) or not params:
        return False
    layouts = compat.state(self, FEATURE)["layouts"]
    layout = layouts.get(params[0].grad.dtype)
    inside = sum(1 for p in params if layout is not None and p.ds_id in layout.spots)
    if inside and (inside != len(params) or inside != len(layout.spots)):
        raise RuntimeError(f"deepspeed_multi: a ZeRO-3 bucket holds {inside} laid-out gradients of {len(params)} "
                           f"(layout has {0 if layout is None else len(layout.spots)}); set DSM_ZERO3_RANK_ORDER=0 and "
                           "report this")
    return inside > 0


def contiguous(buffer, world: int, stride: int, fill: int):
    """The regions' first ``fill`` elements as one tensor of ``world`` blocks, moved together in
    ``buffer``; returns ``(tensor, block)``. A region moved in more than ``_MAX_PIECES`` pieces
    (the bucket nearly full) is left in place and sent whole, with its unused tail."""
    gap = stride - fill
    if gap == 0 or world == 1 or fill > gap * _MAX_PIECES:
        return buffer.narrow(0, 0, world * stride), stride
    for r in range(1, world):
        src, dst, step = r * stride, r * fill, r * gap  # step: how far the region moves, so no piece overlaps itself
        for k in range(0, fill, step):
            length = min(step, fill - k)
            buffer.narrow(0, dst + k, length).copy_(buffer.narrow(0, src + k, length))
    return buffer.narrow(0, 0, world * fill), fill


def scatter(self, params, communication_data_type):
    """The flush of a laid-out bucket: this rank's gradient partitions, in the order of ``params``
    after it puts them in the bucket's order (see the Note)."""
    import deepspeed.comm as dist
    state = compat.state(self, FEATURE)
    bucket = self.ipg_buckets[communication_data_type]
    layout = state["layouts"].pop(params[0].grad.dtype)
    group = self._get_param_partition_group(params[0])
    world, rank, stride = state["world"], dist.get_rank(group=group), state["stride"]
    fill = layout.fill
    if state["gloo"]:
        regions = [bucket.buffer.narrow(0, r * stride, fill) for r in range(world)]
        mine, block = regions[rank], fill
        dist.reduce_scatter(mine, regions, group=group)
    else:
        flat, block = contiguous(bucket.buffer, world, stride, fill)
        mine = flat.narrow(0, rank * block, block)
        dist.reduce_scatter_fn(mine, flat, group=group, async_op=False)
    params[:] = layout.order
    outputs = []
    for p in layout.order:
        offset, chunk = layout.spots[p.ds_id]
        outputs.append(mine.narrow(0, offset, max(0, min(p.ds_numel - rank * chunk, chunk))))
    if communication_data_type != self.gradient_accumulation_dtype:
        outputs = [g.to(self.gradient_accumulation_dtype) for g in outputs]
    return outputs


def _params(optimizer) -> list:
    return [p for group in optimizer.fp16_groups for p in group]


def applies(optimizer) -> bool:
    """DeepSpeed's flush of ``optimizer`` is the plain reduce-scatter stage3_scatter replaces (see the Note)."""
    if not switch_on(ZERO3_RANK_ORDER):
        return False
    if (not getattr(optimizer, "reduce_scatter", False) or getattr(optimizer, "zenflow", False)
            or getattr(optimizer, "all2all_process_group", None) is not None):
        return False
    params = _params(optimizer)
    if not params or any(optimizer.get_param_comm_dtype(p) != optimizer.dtype for p in params):
        return False
    groups = {id(optimizer._get_param_partition_group(p)) for p in params}
    return len(groups) == 1 and optimizer._autoep_expert_parallel_group(params) is None


def install(optimizer, sized: dict) -> bool:
    """Lay out ``optimizer``'s ZeRO-3 bucket for its reduce-scatter; return whether it did. Only where
    stage3_bucket_size allocates the bucket (``sized``: its state, where the buffer's size is set) and
    stage3_scatter flushes it."""
    if not applies(optimizer):
        return False
    import deepspeed.comm as dist
    import torch.distributed as torch_dist
    params = _params(optimizer)
    group = optimizer._get_param_partition_group(params[0])
    world = dist.get_world_size(group=group)
    stride = region_elements(sized["elements"], world, len(params))
    sized["buffer"] = world * stride  # what the bucket allocates at the first gradient of a backward
    sized["rank_order"] = True  # its add places each gradient here (read once per gradient)
    compat.state(optimizer, FEATURE, {"world": world, "stride": stride, "layouts": {}, "stand_in": {},
                                      "gloo": torch_dist.get_backend(group) == "gloo"})
    return True
