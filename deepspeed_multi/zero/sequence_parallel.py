"""Ulysses sequence parallelism (DeepSpeed's ALST): ZeRO-1/2 averaging, and the tiled loss refused.

[Note: averaging over the sequence-data-parallel group]
Under Ulysses sequence parallelism (an ``mpu`` from ``UlyssesSPAttentionHF.register_with_transformers``,
``sequence_parallel_size`` s > 1) every rank of an SP group holds a slice of the same sequences, and
the loss of ALST's tutorial and of the Trainer (``transformers.integrations.deepspeed``,
``deepspeed_sp_compute_loss``) is the same on each of them: the slices' mean losses, all-gathered
differentiably (``torch.distributed.nn.functional.all_gather``) and weighted by their tokens, i.e.
the whole sequence's mean L. The all-gather's backward sums the s ranks' incoming gradients, so
each rank backpropagates s times its slice's share of L, and the sum of the per-rank gradients
over an SP group is s times dL. An engine reduces over ``seq_data_parallel_group`` (W = d x s
ranks, d data-parallel replicas): the sum is s times the sum of the d replicas' gradients, and the
mean over the replicas, which plain PyTorch gives on the global batch, is that sum divided by W.

ZeRO-3's default reduction (``reduce_scatter``, ``__avg_scatter_grads``) divides by W and is right.
ZeRO-1/2 divide by W / s (``average_tensor``, ``gradient_reduction_w_predivide``,
``allreduce_bucket``: ``world_size / float(self.sequence_parallel_size)``), and so does ZeRO-3
without ``reduce_scatter`` (``__avg_scatter_contiguous_grads``): their gradients, and so each SGD
update, are s times too large, upstream too (tiny Llama, 2 ranks, s = 2: the first update is
exactly 2.0x plain PyTorch's, 1.0x at ZeRO-3; tests/multi_gpu/test_sequence_parallel.py). That
divisor would be right for a loss whose per-rank gradients already sum to dL over an SP group
(each rank's slice sum over the global token count, the count all-reduced without gradient); the
stages disagree on which loss they expect, and ours follow ZeRO-3 and the two losses DeepSpeed and
Transformers document.

So on an optimizer built under SP the attribute those divisions read, ``sequence_parallel_size``,
is 1 on the instance (DeepSpeed's value kept as ``_dsm_sequence_parallel_size``): each division is
by W, DeepSpeed's own code otherwise. The one other use of the attribute, ZeRO-1/2's
``allreduce_bucket`` communicating in fp32 under SP, is kept by passing fp32 to it (and
``stage12.reduce`` asks :func:`size`). Without SP (s = 1) nothing is installed. A correctness fix,
installed before the fast paths.

[Note: TiledFusedLogitsLoss under sequence parallelism]
DeepSpeed's ``TiledFusedLogitsLoss`` runs the backward of each logits shard inside its forward,
from a fixed incoming gradient (1, or 1/shards for ``"mean"``), so ``lm_head``'s gradient is final
before the loss is weighted; its own backward scales only the hidden states' gradient by the
gradient that really arrives. Under SP that gradient is never 1 (the rank's token weight times s,
see the Note above), so ``lm_head``'s update is wrong, upstream too (tiny Llama, 2 ranks, s = 2,
ZeRO-3, ``"sum"`` then the ALST weighting: 0.16 off plain PyTorch after 3 SGD steps, the update
4.0x its norm). Making it exact would mean a new backward for it, so a call that
could train (an input or a compute parameter that requires grad) under SP, once an engine was
built under SP in this process, is refused by name (:func:`refuse_tiled_loss`).
"""
from __future__ import annotations

from .. import compat

FEATURE = "sequence_parallel_average"
_TILED_REFUSED = "_dsm_refused_under_sp"


def size(optimizer) -> int:
    """The ``sequence_parallel_size`` DeepSpeed built ``optimizer`` with (1 outside SP)."""
    return optimizer.__dict__.get("_dsm_sequence_parallel_size", getattr(optimizer, "sequence_parallel_size", 1))


def allreduce_bucket(self, bucket, communication_data_type, *args, **kwargs):
    """DeepSpeed's ``allreduce_bucket`` in fp32, as it communicates under SP (see the Note)."""
    import torch
    return compat.original(self, "allreduce_bucket")(bucket, torch.float32, *args, **kwargs)


def applies(optimizer) -> bool:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    return (isinstance(optimizer, (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3))
            and getattr(optimizer, "sequence_parallel_size", 1) > 1)


def install(optimizer) -> bool:
    """Average over the sequence-data-parallel group (see the Note); refuse the tiled loss under SP.
    Return whether the averaging needed the fix."""
    if _sequence_parallel_world_size() > 1:
        refuse_tiled_loss()
    if not applies(optimizer):
        return False
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    optimizer._dsm_sequence_parallel_size = optimizer.sequence_parallel_size
    optimizer.sequence_parallel_size = 1
    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        compat.replace_method(optimizer, "allreduce_bucket", allreduce_bucket, FEATURE)
    return True


def _sequence_parallel_world_size() -> int:
    import deepspeed.comm as dist
    if not dist.is_initialized():
        return 1
    from deepspeed.utils import groups
    return groups._get_sequence_parallel_world_size()


def refuse_tiled_loss() -> None:
    """Wrap ``TiledFusedLogitsLoss.forward`` (process-wide, once) so that a call that could train
    under SP raises (see [Note: TiledFusedLogitsLoss under sequence parallelism])."""
    try:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss as cls
    except ImportError:  # a DeepSpeed without it: nothing to refuse
        return
    if getattr(cls.forward, _TILED_REFUSED, False):
        return
    original = cls.forward

    def forward(ctx, fn, self, x, y, mask, shards, compute_params, output_reduction):
        sp = _sequence_parallel_world_size()
        trains = getattr(x, "requires_grad", False) or any(p.requires_grad for p in compute_params or ())
        if sp > 1 and trains:
            raise RuntimeError(
                f"deepspeed_multi: DeepSpeed's TiledFusedLogitsLoss is not supported under sequence parallelism "
                f"(sequence_parallel_size={sp}): it computes lm_head's gradient inside its forward, from a fixed "
                "incoming gradient, so the weight this rank's loss gets afterwards (ALST's token-weighted average "
                "over the sequence-parallel ranks) never reaches that gradient and lm_head's update is wrong "
                "(upstream DeepSpeed too: 0.16 off plain PyTorch after 3 SGD steps on a tiny Llama). Compute the "
                "loss from the logits (lm_head(hidden_states), then the cross entropy) instead; to save activation "
                "memory, tile the MLPs with TiledMLP, which is exact.")
        return original(ctx, fn, self, x, y, mask, shards, compute_params, output_reduction)

    setattr(forward, _TILED_REFUSED, True)
    forward.__wrapped__ = original
    cls.forward = staticmethod(forward)
