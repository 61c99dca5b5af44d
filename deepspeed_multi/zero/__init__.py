"""ZeRO integration: what MultiEngine changes in DeepSpeed's ZeRO optimizers, installed in one order.

Correctness (always): ``buffers`` (gradients kept and discarded with PyTorch's meaning),
``stage3.counters`` (a retained graph backpropagated again at ZeRO-3), the direct-use check
(``autograd.outside_use``), ``stage3.predivide`` (ZeRO-3 averaging at
``gradient_predivide_factor`` == world size), ``sequence_parallel`` (averaging over the
sequence-data-parallel group under Ulysses SP at ZeRO-1/2; DeepSpeed's tiled loss refused there),
``offload_grads`` (no stale gradient after a window without one under CPU offload) and
``stage12.round_robin`` (each parameter linked to its own fp32 slice under ``round_robin_gradients``),
the last four installed here before the fast paths, and ``stage12.overlap_order`` (ZeRO-1's update
reduces in the backward's order where the config asked for ``overlap_comm``: upstream's bits) and
``stage0.fp16_norm`` (fp16 ZeRO-0's unfused optimizer keeps the gradient norm unscaled). Fast paths
(each gives DeepSpeed's bits, each checked by ``compat.fast_path_exact`` and skipped where it
does not apply):

=====================  ==========  ==================================================================
feature                stages      what it replaces
=====================  ==========  ==================================================================
stage12_bucket_size    1, 2        bucket buffers of reduce_bucket_size elements, allocated every window
stage3_bucket_size     3           the bucket buffer of reduce_bucket_size elements, held from construction on
                                   (both: bucket_size)
stage12_master_alias   1, 2        the fp32 master partition cloned from fp32 parameters
stage3_master_alias    3           the fp32 master partition cloned from fp32 parameters (both: master_alias)
stage12_hook_count     1, 2        the per-backward used-parameter count in DeepSpeed's grad hooks
stage3_grad_view       3           the flattened copy of the fp32 gradient before each sub-group step
stage3_lazy_grads      3           the gradient partition buffer held from construction to the end
stage3_cast_on_gather  3           the bf16/fp16 parameter partition beside the fp32 master (cast at each gather)
stage3_joined_fetch    3           each engine's own first all-gather of a forward (one for several engines)
stage3_release_between 3           gathered parameters kept through other engines' forwards and backwards
stage12_grad_view      1, 2        the flattened copy of the gradient partition before the update
stage12_overflow       1, 2        the overflow flag's all-reduce (the norm's all-reduce decides)
stage3_partition       3           one copy/add per parameter after the reduce-scatter (fused_reduce)
stage3_scatter         3           the per-slice interleave before the reduce-scatter (fused_reduce)
stage3_rank_order      3           the bucket's second copy at each flush (its rank-interleaved buffer)
stage12_reduce         1, 2        the flattened all-reduce and copy-back of each bucket (fused_reduce)
stage12_bucket_pack    1, 2        one copy per parameter into the bucket (fused_reduce)
=====================  ==========  ==================================================================

[Note: the install order]
Features replace disjoint methods, so their order changes no result; three things depend on it:
the direct-use check wraps DeepSpeed's per-parameter hook methods before anything else so that
it sees every gradient first; a feature that relies on a method another one replaces checks it
before that one is installed (``stage3_lazy_grads`` the ZeRO-3 epilogue ``stage3_bucket_size``
wraps, ``stage12_bucket_size`` the flush method ``stage12_bucket_pack`` replaces); and the
rank-agreement wait rides on ``stage12_bucket_pack`` (right before the bucket's first
collective), so it is attached after the fused features and falls back to
``allreduce_gradients`` where the pack is not installed.
"""
import logging

from .. import compat, ops
from ..switches import FUSED_ZERO, switch_on
from . import bucket_size, master_alias, offload_grads, sequence_parallel
from .stage0 import fp16_norm as stage0_fp16_norm
from .stage12 import bucket_pack as stage12_bucket_pack
from .stage12 import grad_view as stage12_grad_view
from .stage12 import hook_count as stage12_hook_count
from .stage12 import overflow as stage12_overflow
from .stage12 import overlap_order as stage1_overlap_order
from .stage12 import reduce as stage12_reduce
from .stage12 import round_robin as stage12_round_robin
from .stage3 import cast_on_gather as stage3_cast_on_gather
from .stage3 import grad_view as stage3_grad_view
from .stage3 import joined_fetch as stage3_joined_fetch
from .stage3 import lazy_grads as stage3_lazy_grads
from .stage3 import partition as stage3_partition
from .stage3 import predivide as stage3_predivide
from .stage3 import rank_order as stage3_rank_order
from .stage3 import release_between as stage3_release_between
from .stage3 import scatter as stage3_scatter

logger = logging.getLogger(__name__)
FUSED = (stage3_partition, stage3_scatter, stage12_reduce, stage12_bucket_pack)


def install(optimizer, options) -> dict:
    """Install every fast path that applies to ``optimizer``, in the order of the Note; return
    ``{feature: installed}``. ``options`` are the engine's (config.MultiOptions)."""
    done = {stage3_predivide.FEATURE: stage3_predivide.install(optimizer),
            stage1_overlap_order.FEATURE: stage1_overlap_order.install(optimizer, options.zero1_overlap_comm),
            stage0_fp16_norm.FEATURE: stage0_fp16_norm.install(optimizer),
            sequence_parallel.FEATURE: sequence_parallel.install(optimizer),
            offload_grads.FEATURE: offload_grads.install(optimizer),
            # before master_alias, whose relink of the fp32 fragments then goes through it
            stage12_round_robin.FEATURE: stage12_round_robin.install(optimizer)}
    # stage3_lazy_grads checks the ZeRO-3 epilogue that bucket_size then wraps; bucket_size checks the
    # ZeRO-1/2 flush method that stage12_bucket_pack replaces.
    done[stage3_lazy_grads.FEATURE] = stage3_lazy_grads.install(optimizer)
    done.update(bucket_size.install(optimizer))
    done.update(master_alias.install(optimizer))
    # after stage3_lazy_grads, whose offload_states then restores its buffer before this one's
    done[stage3_cast_on_gather.FEATURE] = stage3_cast_on_gather.install(optimizer)
    for module in (stage12_hook_count, stage3_grad_view, stage12_grad_view, stage12_overflow, stage3_joined_fetch,
                   stage3_release_between):
        done[module.FEATURE] = module.install(optimizer)
    done.update(install_fused(optimizer) if options.fused_reduce else {m.FEATURE: False for m in FUSED})
    # the bucket stage3_bucket_size allocates and stage3_scatter flushes, laid out for the flush
    done[stage3_rank_order.FEATURE] = bool(
        done.get(bucket_size.FEATURE_Z3) and done.get(stage3_scatter.FEATURE)
        and stage3_rank_order.install(optimizer, compat.state(optimizer, bucket_size.FEATURE_Z3)))
    return done


def hand_back(optimizer) -> None:
    """``engine.destroy()``: undo what the fast paths changed outside ``optimizer`` (on the module's
    parameters), so that a new engine over the module starts from DeepSpeed's state."""
    stage3_joined_fetch.forget(optimizer)
    stage3_release_between.forget(optimizer)
    stage1_overlap_order.forget(optimizer)
    stage3_cast_on_gather.hand_back(optimizer)


def install_fused(optimizer) -> dict:
    """The fused bucket passes (``deepspeed_multi.ops``) that apply to ``optimizer``, unless
    ``DSM_FUSED_ZERO=0``; return ``{feature: installed}``."""
    on = switch_on(FUSED_ZERO)
    done = {}
    # The pass before the collective goes with the pass after it: where the copy after the
    # reduction is not fused (offload, an overridden method), the pack before it is not either.
    for after, before in ((stage3_partition, stage3_scatter), (stage12_reduce, stage12_bucket_pack)):
        done[after.FEATURE] = on and after.install(optimizer)
        done[before.FEATURE] = done[after.FEATURE] and before.install(optimizer)
    if any(done.values()):
        logger.info("deepspeed_multi: fused bucket passes %s on %s, backend %s",
                    [f for f, on in done.items() if on], type(optimizer).__name__, ops.active_backend())
    return done
