"""ZeRO-3 gradient averaging when ``gradient_predivide_factor`` equals the data-parallel size.

[Note: ZeRO-3's post-scale at predivide == world]
With ``gradient_predivide_factor`` f != 1 (and ``postscale_gradients``, the default), DeepSpeed's
ZeRO-1/2 reduction divides each gradient by f, sums it across the W ranks and multiplies by f / W,
skipping that multiply when f == W (it would be 1): the mean in every case. ZeRO-3 carries the
skip over but divides by W as well before the sum (``__avg_scatter_contiguous_grads`` divides the
bucket by W; ``reduce_scatter_coalesced``, under ``__avg_scatter_grads``, divides by W inside),
and multiplies by f afterwards "unless f == W". So at f == W its gradients are W times too small
(upstream too: 2 ranks, f = 2, update cosine 0.37 and norm 0.16 against plain PyTorch; f = 4 is
exact). Stage 3 refuses f != 1 with ``reduce_scatter`` on, so the case is ``reduce_scatter: false``.

On an optimizer with f != 1, both methods are wrapped: DeepSpeed's own method runs, and where it
skipped its multiply by f (f equal to the world size it compares with), the partitions it returns
are multiplied by f, the multiply it does for every other f. Other factors are untouched, so the
results stay DeepSpeed's bits wherever DeepSpeed is right. A correctness fix: installed on every
supported release (0.19.4-0.19.8 share this code), before the fast paths, which leave this case to
DeepSpeed (``stage3_scatter`` does not apply when f != 1).
"""
from __future__ import annotations

from ... import compat

FEATURE = "stage3_predivide"
_CONTIGUOUS = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_contiguous_grads"
_SCATTER = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"


def _times_factor(self, partitions):
    f = self.gradient_predivide_factor
    return [p.mul(f) for p in partitions]


def avg_scatter_contiguous_grads(self, buffer_to_reduce, communication_data_type):
    """DeepSpeed's method, then the multiply by f it skips at f == its averaging world size."""
    import deepspeed.comm as dist
    bucket = self.ipg_buckets[communication_data_type]
    world = dist.get_world_size(bucket.process_group)
    skipped = self.gradient_predivide_factor == self._gradient_averaging_world_size(list(bucket.params), world)
    partitions = compat.original(self, _CONTIGUOUS)(buffer_to_reduce, communication_data_type)
    return _times_factor(self, partitions) if skipped else partitions


def avg_scatter_grads(self, params_to_reduce, communication_data_type):
    """DeepSpeed's method, then the multiply by f it skips at f == the partition group's size."""
    import deepspeed.comm as dist
    group = self._get_param_partition_group(params_to_reduce[0])
    skipped = self.gradient_predivide_factor == dist.get_world_size(group)
    partitions = compat.original(self, _SCATTER)(params_to_reduce, communication_data_type)
    return _times_factor(self, partitions) if skipped else partitions


def applies(optimizer) -> bool:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    return (isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3) and getattr(optimizer, "postscale_gradients", False)
            and getattr(optimizer, "gradient_predivide_factor", 1.0) != 1.0)


def install(optimizer) -> bool:
    """Average correctly at every predivide factor (see the Note); return whether it was needed."""
    if not applies(optimizer):
        return False
    compat.replace_method(optimizer, _CONTIGUOUS, avg_scatter_contiguous_grads, FEATURE)
    compat.replace_method(optimizer, _SCATTER, avg_scatter_grads, FEATURE)
    return True
