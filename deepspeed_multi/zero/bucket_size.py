"""ZeRO-1/2/3: gradient bucket buffers no larger than the engine's trainable parameters.

[Note: buckets sized for the engine]
With ``contiguous_gradients`` (DeepSpeed's default), DeepSpeed allocates each gradient bucket
buffer at ``reduce_bucket_size`` elements, whatever the model: 5e8 by default, 2 GB in fp32 and
1 GB in bf16 per buffer. ZeRO-1/2 allocate it at the start of every window (two with
``overlap_comm``), ZeRO-3 once at construction. One engine of a billion parameters fills it; the
engines this package exists for (a 100M-parameter encoder, a reward head, the towers of a
multimodal model) do not, and each still holds the full buffer on the GPU: four small engines
at DeepSpeed's defaults hold 4-8 GB of buffers they never use.

A bucket never holds more than the engine's trainable elements between two flushes: a parameter's
gradient enters a bucket once per backward (ZeRO-1/2 assert it, ZeRO-3 reduces each parameter
once per backward), and every backward ends with a flush. So the buffers are allocated at
``min(reduce_bucket_size, trainable elements)``. The rule that decides when a bucket is flushed
still compares against ``reduce_bucket_size``, so buckets flush exactly where they did: the same
collectives on the same elements, DeepSpeed's bits. The one construction-time ZeRO-3 buffer is
still allocated at full size by DeepSpeed and replaced right after, so a peak at construction
remains; on a GPU the caching allocator then reuses that block for other tensors.
``DSM_BUCKET_SIZE=0`` keeps DeepSpeed's buffers (for A/B runs).
"""
from __future__ import annotations

import torch

from .. import compat
from ..switches import BUCKET_SIZE, switch_on

FEATURE_Z12 = "stage12_bucket_size"
FEATURE_Z3 = "stage3_bucket_size"
_SETUP = "setup_buckets"


def trainable_elements(optimizer) -> int:
    """Elements of the parameters the optimizer reduces (ZeRO-3: their full, unpartitioned size)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        return sum(p.ds_numel for group in optimizer.fp16_groups for p in group)
    return sum(p.numel() for group in optimizer.bit16_groups for p in group)


def bucket_elements(optimizer) -> int:
    return max(1, min(int(optimizer.reduce_bucket_size), trainable_elements(optimizer)))


def _sized_setup_buckets(elements: int):

    def setup_buckets(self):
        """DeepSpeed's, with the new bucket buffers sized for this engine (see the Note)."""
        configured = self.reduce_bucket_size
        self.reduce_bucket_size = min(configured, elements)  # read for the allocation only
        try:
            compat.original(self, _SETUP)()
        finally:
            self.reduce_bucket_size = configured

    return setup_buckets


def install(optimizer) -> dict:
    """Size the bucket buffers of a ZeRO-1/2/3 optimizer for its parameters; return ``{feature: installed}``."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    done = {FEATURE_Z12: False, FEATURE_Z3: False}
    zero12, zero3 = isinstance(optimizer, DeepSpeedZeroOptimizer), isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3)
    if not (zero12 or zero3) or not switch_on(BUCKET_SIZE) or not optimizer.contiguous_gradients:
        return done
    elements = bucket_elements(optimizer)
    if elements >= int(optimizer.reduce_bucket_size):
        return done
    # ZeRO-1/2's flush rule is stage12_bucket_pack's method: checked there (and warned about there).
    if (zero12 and compat.fast_path_exact(optimizer, FEATURE_Z12)
            and compat.fast_path_exact(optimizer, "stage12_bucket_pack", warn=False)):
        compat.replace_method(optimizer, _SETUP, _sized_setup_buckets(elements), FEATURE_Z12)
        done[FEATURE_Z12] = True
    elif zero3 and compat.fast_path_exact(optimizer, FEATURE_Z3):
        for bucket in optimizer.ipg_buckets.values():
            if bucket.buffer is not None and bucket.buffer.numel() > elements:
                bucket.buffer = torch.empty(elements, dtype=bucket.buffer.dtype, device=bucket.buffer.device)
        done[FEATURE_Z3] = True
    for feature, on in done.items():
        if on:
            compat.state(optimizer, feature, {"elements": elements})
    return done


def sized_elements(optimizer):
    """The buffer size this module set on ``optimizer``, or None where DeepSpeed's stands."""
    for feature in (FEATURE_Z12, FEATURE_Z3):
        if compat.installed(optimizer, feature):
            return compat.state(optimizer, feature)["elements"]
    return None
