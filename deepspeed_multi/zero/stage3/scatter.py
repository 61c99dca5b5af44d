"""ZeRO-3: the reduce-scatter input built in one fused pass, not one slice per parameter per rank.

[Note: the pass before ZeRO-3's reduce-scatter]
DeepSpeed's ``DeepSpeedZeroOptimizer_Stage3.__avg_scatter_grads`` hands the bucket's gradients
to ``reduce_scatter_coalesced``, which slices every gradient into ``world`` chunks of
``ceil(numel / world)`` elements in Python, interleaves them rank by rank with padding into one
``torch.cat``, pre-divides the whole buffer by ``world`` (``div_``), reduce-scatters it, and
narrows this rank's block back into one view per gradient: for 400 small gradients on 2 ranks,
800 slices, a cat, a divide and 400 narrows per bucket (its CPU cost: docs/design.md, Decisions).
:func:`avg_scatter_grads` builds the same buffer with one :func:`deepspeed_multi.ops.pack_
partitions` call (the divide folded in as ``scale = 1/world`` where that is exact, i.e. world is
a power of two; otherwise a separate ``div_``, as DeepSpeed does), runs the same reduce-scatter,
and splits this rank's block with one ``split``. A multiply by an exact power of two and a
divide round identically, so the reduced partitions are bit-identical to DeepSpeed's (asserted
in tests/unit/test_fused_reduce.py against DeepSpeed's interleave, and end to end against fused
off). Padding is zeroed where DeepSpeed leaves ``torch.empty``; it is never read.

Installed only without a ``gradient_predivide_factor`` (post-scaling is stage3_predivide's), and
applies per call where DeepSpeed's own path is the plain one: the communication dtype is the
gradients' dtype, no hierarchical all-to-all
(``zero_quantized_gradients``), no AutoEP averaging group, and more than one gradient (a single
gradient is reduced in place by DeepSpeed without a copy). Anything else calls DeepSpeed's method.
"""
from __future__ import annotations

import torch

from ... import compat, ops
from .. import runs
from ..runs import SUPPORTED_DTYPES as _SUPPORTED_DTYPES
from . import predivide as stage3_predivide, rank_order as stage3_rank_order

FEATURE = "stage3_scatter"
_METHOD = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"


def _plain_path(self, params, grads, communication_data_type) -> bool:
    """DeepSpeed's path for this call is a plain reduce_scatter_coalesced of ``grads`` (see the Note)."""
    if len(grads) < 2 or communication_data_type != self.dtype or self.all2all_process_group is not None:
        return False
    first = grads[0]
    if first is None or first.dtype not in _SUPPORTED_DTYPES:
        return False
    if any(g is None or g.dtype != first.dtype or g.device != first.device for g in grads):
        return False
    return self._autoep_expert_parallel_group(params) is None


def avg_scatter_grads(self, params_to_reduce, communication_data_type):
    """Replacement of ``__avg_scatter_grads`` (see the Note); returns this rank's grad partitions."""
    import deepspeed.comm as dist
    if stage3_rank_order.placed(self, params_to_reduce):
        return stage3_rank_order.scatter(self, params_to_reduce, communication_data_type)
    grads = [p.grad for p in params_to_reduce]
    if not _plain_path(self, params_to_reduce, grads, communication_data_type):
        return compat.original(self, _METHOD)(params_to_reduce, communication_data_type)
    self._assert_same_partition_group(params_to_reduce)
    group = self._get_param_partition_group(params_to_reduce[0])
    world, rank = dist.get_world_size(group=group), dist.get_rank(group=group)

    chunks = [-(-g.numel() // world) for g in grads]
    block = sum(chunks)
    parts = [max(0, min(g.numel() - rank * c, c)) for g, c in zip(grads, chunks)]
    padded = any(c * world != g.numel() for g, c in zip(grads, chunks))
    flat = (torch.zeros if padded else torch.empty)(world * block, dtype=grads[0].dtype, device=grads[0].device)
    exact = runs.scales_exactly(world)
    ops.pack_partitions(grads, flat, world, 1.0 / world if exact else 1.0)
    if not exact:
        flat.div_(world)
    mine = flat.narrow(0, rank * block, block)
    dist.reduce_scatter_fn(mine, flat, group=group, async_op=False)

    outputs = list(mine.split(chunks))
    converted = communication_data_type != self.gradient_accumulation_dtype
    if parts != chunks:  # this rank holds the short tail of some gradients
        outputs = [o.narrow(0, 0, n) if n != c else o for o, n, c in zip(outputs, parts, chunks)]
    elif not converted:
        compat.state(self, FEATURE)["one_run"] = outputs  # consecutive views of one buffer (stage3_partition)
    if converted:
        outputs = [g.to(self.gradient_accumulation_dtype) for g in outputs]
    return outputs


def is_one_run(optimizer, grad_partitions) -> bool:
    """``grad_partitions`` is the list :func:`avg_scatter_grads` just returned as consecutive views."""
    return compat.installed(optimizer, FEATURE) and compat.state(optimizer, FEATURE).pop("one_run", None) is grad_partitions


def applies(optimizer) -> bool:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    # With a predivide factor DeepSpeed's own method runs, wrapped by stage3_predivide.
    return (isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3) and not stage3_predivide.applies(optimizer)
            and compat.fast_path_exact(optimizer, FEATURE)
            and hasattr(optimizer, "all2all_process_group") and hasattr(optimizer, "_autoep_expert_parallel_group"))


def install(optimizer) -> bool:
    """Build ``optimizer``'s reduce-scatter input with one fused pack per bucket; return whether it did."""
    if not applies(optimizer):
        return False
    compat.state(optimizer, FEATURE, {})
    compat.replace_method(optimizer, _METHOD, avg_scatter_grads, FEATURE)
    return True
