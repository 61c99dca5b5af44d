"""ZeRO-1/2/3: gradient bucket buffers no larger than the engine's trainable parameters; ZeRO-3's
only while a backward fills it.

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
still allocated at full size by DeepSpeed and dropped right after (see the next Note), so a peak
at construction remains; on a GPU the caching allocator then reuses that block for other tensors.

[Note: ZeRO-3's bucket exists during a backward only]
ZeRO-1/2 allocate their buffers at the start of a window and drop them at the update. ZeRO-3's
one buffer is held from construction on: through every forward and every update, where nothing
is in it. At DeepSpeed's defaults it is as large as the engine's parameters (one fp32 copy of an
fp32 model), so it is most of what puts a ZeRO-3 engine's forward and update peaks above FSDP2's
(benchmarks/memory_breakdown.py). Here it is allocated at the first gradient that enters it in a
backward (``__add_grad_to_ipg_bucket``) and dropped after the epilogue, which flushes every bucket
and waits for the reduction stream before returning. What the bucket holds between the two is
what it held before, so the flushes and their bits do not change; DeepSpeed's own
``offload_states`` treats a bucket without a buffer as one with nothing to offload.
``DSM_BUCKET_SIZE=0`` keeps DeepSpeed's buffers (for A/B runs).
"""
from __future__ import annotations

import torch

from .. import compat
from ..switches import BUCKET_SIZE, switch_on
from .stage3 import rank_order as stage3_rank_order

FEATURE_Z12 = "stage12_bucket_size"
FEATURE_Z3 = "stage3_bucket_size"
_SETUP = "setup_buckets"
_ADD_GRAD = compat._MANGLED + "add_grad_to_ipg_bucket"
_EPILOGUE = "independent_gradient_partition_epilogue"


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


def _add_grad_allocating(self, param):
    """DeepSpeed's ``__add_grad_to_ipg_bucket``; the bucket's buffer is allocated by its first gradient
    of a backward (see [Note: ZeRO-3's bucket exists during a backward only])."""
    dtype = self.get_param_comm_dtype(param)
    bucket = self.ipg_buckets[dtype]
    sized = compat.state(self, FEATURE_Z3)  # "buffer" and "rank_order": set where stage3_rank_order applies
    if bucket.buffer is None:  # once per backward
        from deepspeed.accelerator import get_accelerator
        bucket.buffer = torch.empty(sized.get("buffer", sized["elements"]), dtype=dtype,
                                    device=get_accelerator().current_device_name())
    if sized.get("rank_order") and stage3_rank_order.place(self, param, bucket):
        return None
    return compat.original(self, _ADD_GRAD)(param)


def _epilogue_releasing(self):
    """DeepSpeed's epilogue, then the buckets it emptied let go of their buffers."""
    compat.original(self, _EPILOGUE)()
    for bucket in self.ipg_buckets.values():
        if not bucket.params:
            bucket.buffer = None


def install(optimizer) -> dict:
    """Size the bucket buffers of a ZeRO-1/2/3 optimizer for its parameters; return ``{feature: installed}``."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    done = {FEATURE_Z12: False, FEATURE_Z3: False}
    zero12, zero3 = isinstance(optimizer, DeepSpeedZeroOptimizer), isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3)
    if not (zero12 or zero3) or not switch_on(BUCKET_SIZE) or not optimizer.contiguous_gradients:
        return done
    elements = bucket_elements(optimizer)
    # ZeRO-1/2's flush rule is stage12_bucket_pack's method: checked there (and warned about there).
    if (zero12 and elements < int(optimizer.reduce_bucket_size) and compat.fast_path_exact(optimizer, FEATURE_Z12)
            and compat.fast_path_exact(optimizer, "stage12_bucket_pack", warn=False)):
        compat.replace_method(optimizer, _SETUP, _sized_setup_buckets(elements), FEATURE_Z12)
        done[FEATURE_Z12] = True
    elif (zero3 and compat.fast_path_exact(optimizer, FEATURE_Z3)  # the epilogue: checked (and warned) by lazy_grads
          and compat.exact(optimizer, DeepSpeedZeroOptimizer_Stage3, (_EPILOGUE, ), FEATURE_Z3, warn=False)):
        for bucket in optimizer.ipg_buckets.values():
            bucket.buffer = None  # allocated by the first gradient of each backward, at ``elements``
        compat.replace_method(optimizer, _ADD_GRAD, _add_grad_allocating, FEATURE_Z3)
        compat.replace_method(optimizer, _EPILOGUE, _epilogue_releasing, FEATURE_Z3)
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
